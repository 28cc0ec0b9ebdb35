"""NKI kernels for the DFlash custom ops, one module per op (AWS Neuron; ``nki.simulate`` runs them on CPU).

Nothing here needs the Neuron SDK at import time: each kernel module imports ``nki`` when a kernel is first
built. On a Neuron device the public functions call the ``@nki.jit`` kernels with the torch tensors; on CPU
tensors they run the same kernels through ``nki.simulate`` with numpy arrays.
"""

from __future__ import annotations

import importlib.util
import logging

from ._runtime import logical_nc_config, nki_available

log = logging.getLogger(__name__)

_registered = False


def _neuron_device_type(torch) -> str:
    """The device-type name under which TorchNeuron registered the Neuron device (its PrivateUse1 backend,
    renamed to ``"neuron"`` when ``torch_neuronx`` is imported); ``"privateuseone"`` if it was not renamed."""
    get_name = getattr(torch._C, "_get_privateuse1_backend_name", None)
    return get_name() if callable(get_name) else "privateuseone"


def register_neuron_kernels() -> bool:
    """Register the NKI kernels as the Neuron implementations of the ``dflash`` ops (idempotent).

    Returns whether they are registered: False, doing nothing, when ``nki`` (NKI 0.5.0+) or ``torch_neuronx``
    is missing. The ops are defined once, device-independently, in ``lowerings/ops.py``; this adds their
    Neuron-device kernels with ``torch.library.register_kernel`` under the device type ``torch_neuronx``
    registers (``"neuron"``). Each kernel calls its ``@nki.jit`` kernel on the Neuron tensors, which is NKI's
    documented PyTorch integration (``nki.jit`` compiles the kernel as a custom operator of the framework of
    its arguments), launched with the LNC degree of ``NEURON_LOGICAL_NC_CONFIG`` (see ``_runtime``).
    """
    global _registered
    if _registered:
        return True
    if not nki_available() or importlib.util.find_spec("torch_neuronx") is None:
        log.info("dflash: the Neuron SDK (nki >= 0.5.0, torch_neuronx) is not available; NKI kernels not "
                 "registered")
        return False
    import torch
    import torch_neuronx  # noqa: F401  (registers the Neuron device with PyTorch)

    from .. import ops  # noqa: F401  (defines the ops)
    from .block_attention import block_attention
    from .fused_kv_proj import fused_kv_proj
    from .paged_kv_write import paged_kv_write

    device = _neuron_device_type(torch)
    torch.library.register_kernel("dflash::fused_kv_proj", device, fused_kv_proj)
    torch.library.register_kernel("dflash::paged_kv_write", device, paged_kv_write)
    torch.library.register_kernel("dflash::block_attention", device, block_attention)
    log.info("dflash: NKI kernels registered for device %r (LNC=%d)", device, logical_nc_config())
    _registered = True
    return True


__all__ = ["logical_nc_config", "nki_available", "register_neuron_kernels"]
