"""Triton kernels for the DFlash custom ops, one module per op (CUDA; the interpreter runs them on CPU in tests).

Nothing here imports ``triton`` at package import time: the kernel modules are imported by
:func:`register_cuda_kernels` or explicitly.
"""

from __future__ import annotations

import functools


@functools.cache
def register_cuda_kernels() -> None:
    """Register the Triton kernels as the CUDA implementations of the ``dflash`` ops (idempotent)."""
    import torch

    from .. import ops  # noqa: F401  (defines the ops)
    from .block_attention import block_attention
    from .fused_kv_proj import fused_kv_proj
    from .paged_kv_write import paged_kv_write

    torch.library.register_kernel("dflash::fused_kv_proj", "cuda", fused_kv_proj)
    torch.library.register_kernel("dflash::paged_kv_write", "cuda", paged_kv_write)
    torch.library.register_kernel("dflash::block_attention", "cuda", block_attention)


__all__ = ["register_cuda_kernels"]
