"""CPU kernels for the DFlash custom ops where plain torch can do better than the oracle in ``ops.py``."""

from __future__ import annotations

import functools


@functools.cache
def register_cpu_kernels() -> None:
    """Register the CPU kernels as the CPU implementations of the ``dflash`` ops (idempotent)."""
    import torch

    from .. import ops  # noqa: F401  (defines the ops)
    from .block_attention import block_attention

    torch.library.register_kernel("dflash::block_attention", "cpu", block_attention)


__all__ = ["register_cpu_kernels"]
