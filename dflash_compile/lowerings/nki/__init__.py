"""NKI kernels for the DFlash custom ops, one module per op (AWS Neuron; ``nki.simulate`` runs them on CPU).

Nothing here needs the Neuron SDK at import time: each kernel module imports ``nki`` when a kernel is first
built. On a Neuron device the public functions call the ``@nki.jit`` kernels with the torch tensors; on CPU
tensors they run the same kernels through ``nki.simulate`` with numpy arrays.
"""

from __future__ import annotations

import importlib.util
import logging

from ._runtime import nki_available

log = logging.getLogger(__name__)

_registered = False


def register_neuron_kernels() -> bool:
    """Register the NKI kernels as the Neuron implementations of the ``dflash`` ops (idempotent).

    Returns whether they are registered: False, doing nothing, when ``nki`` or ``torch_neuronx`` is missing.
    """
    global _registered
    if _registered:
        return True
    if not nki_available() or importlib.util.find_spec("torch_neuronx") is None:
        log.info("dflash: the Neuron SDK (nki, torch_neuronx) is not available; NKI kernels not registered")
        return False
    import torch

    from .. import ops  # noqa: F401  (defines the ops)
    from .block_attention import block_attention
    from .fused_kv_proj import fused_kv_proj
    from .paged_kv_write import paged_kv_write

    # TorchNeuron registers the Neuron device as PyTorch's PrivateUse1 backend ("privateuseone").
    torch.library.register_kernel("dflash::fused_kv_proj", "privateuseone", fused_kv_proj)
    torch.library.register_kernel("dflash::paged_kv_write", "privateuseone", paged_kv_write)
    torch.library.register_kernel("dflash::block_attention", "privateuseone", block_attention)
    _registered = True
    return True


__all__ = ["nki_available", "register_neuron_kernels"]
