"""Triton kernels for the DFlash custom ops, one module per op (CUDA; the interpreter runs them on CPU in tests).

Every kernel launches through ``torch.library.wrap_triton``, and no launcher reads a tensor value, so the
public functions can be traced into an FX graph: :func:`cuda_lowerings` is the table that replaces each
``torch.ops.dflash.*`` node by its Triton implementation (``make_fx(gm, decomposition_table=...,
pre_dispatch=True)``), leaving ``triton_kernel_wrapper_mutation`` nodes that Inductor compiles. Under
``TRITON_INTERPRET=1`` ``wrap_triton`` returns the interpreted kernel itself: eager launches work, tracing
does not.

Nothing here imports ``triton`` at package import time: the kernel modules are imported by
:func:`cuda_lowerings`, :func:`register_cuda_kernels` or explicitly.
"""

from __future__ import annotations

import functools


def cuda_lowerings() -> dict:
    """``{op overload: Triton implementation}`` for every ``dflash`` op, each with the op's signature and contract.

    ``paged_kv_write``'s implementation writes ``pool`` in place and returns None, like the op.
    """
    import torch

    from .. import ops  # noqa: F401  (defines the ops)
    from .block_attention import block_attention
    from .fused_kv_proj import fused_kv_proj
    from .paged_kv_write import paged_kv_write

    return {
        torch.ops.dflash.fused_kv_proj.default: fused_kv_proj,
        torch.ops.dflash.paged_kv_write.default: paged_kv_write,
        torch.ops.dflash.block_attention.default: block_attention,
    }


@functools.cache
def register_cuda_kernels() -> None:
    """Register the Triton kernels as the CUDA implementations of the ``dflash`` ops (idempotent)."""
    import torch

    for op, fn in cuda_lowerings().items():
        torch.library.register_kernel(op, "cuda", fn)


__all__ = ["cuda_lowerings", "register_cuda_kernels"]
