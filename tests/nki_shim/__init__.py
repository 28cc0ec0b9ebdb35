"""A strict numpy stand-in for the Neuron SDK's ``nki`` package, for tests on machines without the SDK.

It implements exactly the subset of ``nki`` / ``nki.language`` / ``nki.isa`` that the dflash kernels use
(``dflash_compile/lowerings/nki``) and raises ``NotImplementedError`` for every other name. Each instruction
checks the hardware rules it models (partition dim <= 128, matmul stationary free dim <= 128 and moving free
dim <= 512, contraction <= 128, matmul results in fp32 PSUM, DMA only between HBM and SBUF, ...) and raises
:class:`nki.isa.NkiValidationError` with a message naming the rule.

What it does not model: timing, engine parallelism, SBUF/PSUM capacity across tiles, the activation
functions' piecewise-polynomial approximations, and any rule not listed in ``isa.py``. Passing here means the
kernel's arithmetic and indexing are right under these rules, not that it compiles with ``neuronx-cc``.

``nki.jit`` and ``nki.simulate`` also check the kernel function statically (:mod:`nki_shim.subset`): the NKI
compiler front end accepts only a Python subset (no comprehensions, generator expressions, lambda, ``zip`` or
``enumerate``; a short list of built-ins), which eager execution would never notice.

Install it with :func:`_install` only when the real ``nki`` is not importable.
"""

import functools as _functools
import sys as _sys

import numpy as _np

from . import _core, isa, language, subset

__getattr__ = _core.strict_module_getattr("nki")

#: The NKI release whose API the shim follows: the kernels need NKI 0.5.0 (Neuron SDK 2.31) for
#: ``tensor.broadcast`` and ``nl.tile_size.psum_bank_fmax``.
__version__ = "0.5.0"


class _Kernel:
    """What ``@nki.jit`` returns: calling it runs the kernel eagerly on numpy arrays."""

    def __init__(self, fn):
        subset.check_function(fn)  # the NKI compiler's Python subset, which running the kernel eagerly cannot see
        self.fn = fn
        _functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        return _run(self.fn, args, kwargs)

    def __getitem__(self, lnc):
        if lnc != 1:
            raise _core.ShimNotImplementedError("LNC > 1 launches are not implemented by the test shim")
        return self


def jit(fn=None, **kwargs):
    if kwargs:
        raise _core.ShimNotImplementedError(f"nki.jit options {sorted(kwargs)} are not implemented by the test shim")
    if fn is None:
        return jit
    return fn if isinstance(fn, _Kernel) else _Kernel(fn)


def simulate(kernel):
    if not isinstance(kernel, _Kernel):
        subset.check_function(kernel)
    fn = kernel.fn if isinstance(kernel, _Kernel) else kernel

    def simulated(*args, **kwargs):
        return _run(fn, args, kwargs)

    return simulated


def _wrap(x):
    if isinstance(x, _np.ndarray):
        return _core.hbm_argument(x)
    if type(x).__module__.startswith("torch"):
        raise TypeError("the nki test shim takes numpy arrays; convert torch tensors with .numpy()")
    if isinstance(x, (list, tuple, dict)) and any(isinstance(v, _np.ndarray) for v in
                                                  (x.values() if isinstance(x, dict) else x)):
        raise _core.ShimNotImplementedError("containers of arrays as kernel arguments are not implemented by the "
                                            "test shim")
    return x


def _unwrap(x):
    if isinstance(x, _core.NkiTensor):
        _core.check(not x.on_chip, f"a kernel returns HBM tensors, not the {x.buffer.name} tile {x!r}")
        return _np.array(x.read())
    if isinstance(x, (tuple, list)):
        return type(x)(_unwrap(v) for v in x)
    _core.check(x is None, f"a kernel returns tensors, got {type(x).__name__}")
    return None


def _run(fn, args, kwargs):
    isa._reset_engine_state()
    result = fn(*(_wrap(a) for a in args), **{k: _wrap(v) for k, v in kwargs.items()})
    return _unwrap(result)


_NAMES = ("nki", "nki.language", "nki.isa")


def _install():
    """Make ``import nki`` / ``nki.language`` / ``nki.isa`` resolve to this shim; returns what it replaced."""
    previous = {name: _sys.modules.get(name) for name in _NAMES}
    _sys.modules.update({"nki": _sys.modules[__name__], "nki.language": language, "nki.isa": isa})
    return previous


def _uninstall(previous):
    for name, module in previous.items():
        if module is None:
            _sys.modules.pop(name, None)
        else:
            _sys.modules[name] = module
