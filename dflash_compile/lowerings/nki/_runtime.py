"""Host-side plumbing shared by the NKI launchers: importing the SDK lazily, and running a kernel.

Tensors on a Neuron device go to the ``@nki.jit`` kernel as they are (NKI's PyTorch integration), launched
with the logical NeuronCore (LNC) degree of ``NEURON_LOGICAL_NC_CONFIG``. CPU tensors go through
``nki.simulate`` as numpy arrays, which is how the kernels are tested without hardware.

Version floor: the kernels use ``tensor.broadcast`` and ``nl.tile_size.psum_bank_fmax``, which need NKI 0.5.0
(Neuron SDK 2.31). An older ``nki`` is reported as unavailable.
"""

from __future__ import annotations

import logging
import os
import re

import torch

log = logging.getLogger(__name__)

NKI_MIN_VERSION = (0, 5, 0)  # NKI 0.5.0 ships with Neuron SDK 2.31
NKI_MIN_VERSION_TEXT = "NKI 0.5.0 (Neuron SDK 2.31)"

_JITTED: dict = {}


def import_nki():
    """``(nki, nki.language, nki.isa)``; raises ImportError without the Neuron SDK."""
    import nki
    import nki.isa
    import nki.language

    return nki, nki.language, nki.isa


def nki_version(nki) -> tuple[int, ...] | None:
    """The ``(major, minor, patch)`` of an imported ``nki`` (``nki.__version__``, else the installed
    distribution's metadata), or None when neither says."""
    text = getattr(nki, "__version__", None)
    if not isinstance(text, str):
        try:
            from importlib.metadata import PackageNotFoundError, version

            text = version("nki")
        except (ImportError, PackageNotFoundError, ValueError):
            return None
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if match is None:
        return None
    return tuple(int(g or 0) for g in match.groups())


def nki_available() -> bool:
    """Whether ``import nki`` gives an NKI with ``jit`` and ``simulate`` (PyPI only has placeholder packages)
    that is not older than :data:`NKI_MIN_VERSION`. An NKI whose version cannot be read is accepted."""
    try:
        nki, _, _ = import_nki()
    except ImportError:
        return False
    if not (callable(getattr(nki, "jit", None)) and callable(getattr(nki, "simulate", None))):
        return False
    found = nki_version(nki)
    if found is not None and found < NKI_MIN_VERSION:
        log.warning("dflash: nki %s is older than %s, which the NKI kernels need; they are not used",
                    ".".join(map(str, found)), NKI_MIN_VERSION_TEXT)
        return False
    return True


def logical_nc_config() -> int:
    """The LNC degree to launch kernels with: ``NEURON_LOGICAL_NC_CONFIG`` (1 or 2), else 1.

    The Neuron Runtime groups ``NEURON_LOGICAL_NC_CONFIG`` physical cores into one logical core, and an NKI
    kernel must be launched with the same degree. Unset, an NKI kernel defaults to LNC=1 (the ``nki.jit``
    docs); on Trn2 the runtime and ``neuronx-cc`` default to LNC=2, so set the variable explicitly there (the
    SDK's own advice for the LNC-mismatch error NCC_EVRF066).
    """
    text = os.environ.get("NEURON_LOGICAL_NC_CONFIG", "").strip()
    if not text:
        return 1
    if text not in ("1", "2"):
        raise ValueError(f"NEURON_LOGICAL_NC_CONFIG={text!r}: the Neuron SDK supports an LNC degree of 1 or 2")
    return int(text)


def jitted(nki, fn):
    """``nki.jit(fn)``, made once per ``nki`` module."""
    key = (id(nki), fn)
    if key not in _JITTED:
        _JITTED[key] = nki.jit(fn)
    return _JITTED[key]


def _to_numpy(t: torch.Tensor):
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        try:
            import ml_dtypes
        except ImportError:  # no numpy bf16 without ml_dtypes: simulate in fp32 (the kernels compute in fp32)
            return t.float().numpy()
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _from_numpy(a) -> torch.Tensor:
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view("int16")).view(torch.bfloat16)
    return torch.from_numpy(a)


def _shares_memory(a, t: torch.Tensor) -> bool:
    return a.__array_interface__["data"][0] == t.data_ptr()


def launch(kernel, *args, inout: tuple[int, ...] = ()):
    """Run ``kernel(*args)``; ``inout`` are the positions of tensors the kernel writes in place."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if any(t.device.type != "cpu" for t in tensors):
        # kernel[lnc]: the launch-grid form NKI 0.5.0 documents for the LNC degree (it must match the runtime's).
        # The kernels do not split work by nl.program_id, so with LNC=2 both cores compute the same result.
        return kernel[logical_nc_config()](*args)

    import nki

    np_args = [_to_numpy(a) if isinstance(a, torch.Tensor) else a for a in args]
    out = nki.simulate(kernel)(*np_args)
    for i in inout:  # the simulator wrote the numpy array; copy back where it was not a view of the tensor
        if not _shares_memory(np_args[i], args[i]):
            args[i].copy_(_from_numpy(np_args[i]).view(args[i].shape))
    if out is None:
        return None
    if isinstance(out, (tuple, list)):
        return tuple(_from_numpy(o) for o in out)
    return _from_numpy(out)
