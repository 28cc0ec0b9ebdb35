"""The shim's ``nki.language``: dtypes, buffers, tile sizes, ``ndarray`` and the operator tokens.

Operators (``nl.add``, ``nl.exp``, ...) exist only as the ``op`` of ``nki.isa`` instructions: calling one as a
high-level function raises ``NotImplementedError``, as does every name not defined here.
"""

import numpy as _np

from . import _core

__getattr__ = _core.strict_module_getattr("nki.language")

# ------------------------------------------------------------------------------------------------ dtypes
float32 = _np.dtype(_np.float32)
float16 = _np.dtype(_np.float16)
int32 = _np.dtype(_np.int32)
uint32 = _np.dtype(_np.uint32)
uint8 = _np.dtype(_np.uint8)
try:
    import ml_dtypes as _ml_dtypes

    bfloat16 = _np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # without ml_dtypes, nl.bfloat16 raises NotImplementedError like any other missing name
    pass

# ----------------------------------------------------------------------------------------------- buffers
sbuf = _core.MemoryRegion.sbuf
psum = _core.MemoryRegion.psum
private_hbm = _core.MemoryRegion.private_hbm
hbm = _core.MemoryRegion.private_hbm  # alias, as in the real module
shared_hbm = _core.MemoryRegion.shared_hbm


class _TileSize:
    pmax = _core.PMAX
    gemm_stationary_fmax = _core.GEMM_STATIONARY_FMAX
    gemm_moving_fmax = _core.GEMM_MOVING_FMAX
    psum_bank_fmax = _core.PSUM_BANK_FMAX

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        raise _core.ShimNotImplementedError(f"nki.language.tile_size.{name} is not implemented by the test shim")


tile_size = _TileSize()


def ndarray(shape, dtype, buffer=sbuf, name="", address=None):
    if address is not None:
        raise _core.ShimNotImplementedError("nl.ndarray(address=...) is not implemented by the test shim")
    return _core.allocate(shape, dtype, buffer, name)


# -------------------------------------------------------------------------------------- operator tokens
class _Op:
    """An ALU / activation operator: ``kind`` is 'binary' (ALU), 'compare' (ALU, yields 1.0/0.0) or 'unary'."""

    def __init__(self, name, kind, fn, reducible=False):
        self.name = name
        self.kind = kind
        self.fn = fn
        self.reducible = reducible

    def __call__(self, *args, **kwargs):
        raise _core.ShimNotImplementedError(
            f"nki.language.{self.name}(...) as a high-level function is not implemented by the test shim; "
            f"use it as the op of a nki.isa instruction"
        )

    def __repr__(self):
        return f"nl.{self.name}"


add = _Op("add", "binary", _np.add, reducible=True)
subtract = _Op("subtract", "binary", _np.subtract)
multiply = _Op("multiply", "binary", _np.multiply, reducible=True)
maximum = _Op("maximum", "binary", _np.maximum, reducible=True)
minimum = _Op("minimum", "binary", _np.minimum, reducible=True)
less = _Op("less", "compare", _np.less)
less_equal = _Op("less_equal", "compare", _np.less_equal)
greater_equal = _Op("greater_equal", "compare", _np.greater_equal)
exp = _Op("exp", "unary", _np.exp)
square = _Op("square", "unary", _np.square)
copy = _Op("copy", "unary", lambda x: x)


def _rsqrt(x):
    with _np.errstate(divide="ignore", invalid="ignore"):
        return (_np.float32(1.0) / _np.sqrt(x)).astype(_np.float32)


rsqrt = _Op("rsqrt", "unary", _rsqrt)
