"""Host-side plumbing shared by the NKI launchers: importing the SDK lazily, and running a kernel.

Tensors on a Neuron device go to the ``@nki.jit`` kernel as they are (NKI's PyTorch integration). CPU tensors
go through ``nki.simulate`` as numpy arrays, which is how the kernels are tested without hardware.
"""

from __future__ import annotations

import torch

_JITTED: dict = {}


def import_nki():
    """``(nki, nki.language, nki.isa)``; raises ImportError without the Neuron SDK."""
    import nki
    import nki.isa
    import nki.language

    return nki, nki.language, nki.isa


def nki_available() -> bool:
    """Whether ``import nki`` gives an NKI with ``jit`` and ``simulate`` (PyPI only has placeholder packages)."""
    try:
        nki, _, _ = import_nki()
    except ImportError:
        return False
    return callable(getattr(nki, "jit", None)) and callable(getattr(nki, "simulate", None))


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
        return kernel(*args)

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
