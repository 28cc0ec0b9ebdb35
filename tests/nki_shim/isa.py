"""The shim's ``nki.isa``: the instructions the dflash kernels use, each checking the hardware rules it models.

Semantics follow the NKI ISA reference of NKI 0.5.0 / Neuron SDK 2.31+ (the floor the kernels need): compute
engines work in fp32 and cast to ``dst.dtype``; ``nc_matmul`` reads SBUF and writes fp32 PSUM; DMA moves data
between HBM and SBUF (with a cast through fp32 when dtypes differ) and does indirect gather/scatter through
``.ap(vector_offset=...)``.
"""

import enum as _enum
import math as _math

import numpy as _np

from . import _core
from . import language as _nl
from ._core import MemoryRegion as _Mem
from ._core import NkiTensor as _Tensor
from ._core import NkiValidationError
from ._core import ShimNotImplementedError as _NotImplemented
from ._core import check as _check

__getattr__ = _core.strict_module_getattr("nki.isa")

__all__ = ["NkiValidationError"]


# ------------------------------------------------------------------------------------------------ enums
class oob_mode(_enum.Enum):
    error = 0
    skip = 1


class reduce_cmd(_enum.Enum):
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


class dge_mode(_enum.Enum):
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class engine(_enum.Enum):
    unknown = 0
    tensor = 1
    scalar = 2
    gpsimd = 3
    dma = 4
    vector = 5
    sync = 6


# ------------------------------------------------------------------------------------------------ checks
_QUADRANT = 32


def _tile(t, what, buffers=(_Mem.sbuf, _Mem.psum)):
    """An operand of a compute engine: an on-chip tile starting on a quadrant boundary."""
    _check(isinstance(t, _Tensor), f"{what}: expected a tile, got {type(t).__name__}")
    _check(t.buffer in buffers, f"{what}: a {t.buffer.name} tensor cannot be used here (allowed: "
                               f"{', '.join(b.name for b in buffers)}); move HBM data on chip with nisa.dma_copy")
    _check(t.ndim >= 2 and t.partitions <= _core.PMAX,
          f"{what}: partition dim {t.shape[0]} of {t.shape} exceeds {_core.PMAX}")
    _check(t.start_partition % _QUADRANT == 0,
          f"{what}: compute engines access partitions from a quadrant boundary (0/32/64/96); this tile starts "
          f"at partition {t.start_partition}")
    return t


def _same_layout(a, b, what):
    _check(a.partitions == b.partitions, f"{what}: partition dims differ ({a.shape} vs {b.shape})")
    _check(a.free_size == b.free_size, f"{what}: elements per partition differ ({a.shape} vs {b.shape})")


def _operand(x, partitions, what):
    """A scalar, or a ``(P, 1)`` fp32 tile broadcast along the free dims."""
    if isinstance(x, (int, float, _np.integer, _np.floating)) and not isinstance(x, bool):
        return _np.float32(x)
    _tile(x, what)
    _check(x.partitions == partitions and x.free_size == 1,
          f"{what}: a vector operand must have shape ({partitions}, 1), got {x.shape}")
    _check(x.dtype == _np.dtype(_np.float32), f"{what}: vector operands must be float32, got {x.dtype}")
    return x.read().reshape(partitions, 1).astype(_np.float32)


def _f32(t):
    return t.read().astype(_np.float32).reshape(t.partitions, t.free_size)


def _cast(values, dtype, what):
    """Cast computed (or DMA'd) values to ``dtype``; float -> int must be exact (rounding is not modelled)."""
    dtype = _np.dtype(dtype)
    values = _np.asarray(values)
    if values.dtype == dtype:
        return values
    if not _core.is_float(dtype) and _core.is_float(values.dtype):
        v = values.astype(_np.float64)
        _check(_np.isfinite(v).all() and (v == _np.round(v)).all(),
              f"{what}: converting non-integral values to {dtype} (rounding is not modelled by the shim)")
        info = _np.iinfo(dtype)
        _check(v.min(initial=0) >= info.min and v.max(initial=0) <= info.max, f"{what}: values overflow {dtype}")
    with _np.errstate(over="ignore", invalid="ignore"):
        return values.astype(_np.float32).astype(dtype) if _core.is_float(dtype) else values.astype(dtype)


def _store(dst, values_2d, what):
    out = _cast(values_2d, dst.dtype, what)
    dst.write(out.reshape(dst.shape))
    if dst.buffer is _Mem.psum:
        dst.matmul_mask()[...] = False


def _alu(op, a, b, what):
    _check(isinstance(op, _nl._Op) and op.kind in ("binary", "compare"),
          f"{what}: {op!r} is not a binary ALU operator")
    with _np.errstate(all="ignore"):
        r = op.fn(a, b)
    return r.astype(_np.float32)


# ------------------------------------------------------------------------------------------------ DMA
def _is_indirect(x):
    return isinstance(x, _core._IndirectView)


def dma_copy(dst, src, priority=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown, engine=engine.unknown,
             name=None):
    for x, what in ((dst, "dst"), (src, "src")):
        _check(isinstance(x, _Tensor) or _is_indirect(x), f"dma_copy: {what} must be a tensor")
    if priority is not None:
        raise _NotImplemented("dma_copy(priority=...) is not implemented by the test shim")
    _check(oob_mode in (_OOB_ERROR, _OOB_SKIP), f"dma_copy: bad oob_mode {oob_mode!r}")
    kinds = {dst.buffer.on_chip, src.buffer.on_chip}
    _check(_Mem.psum not in (dst.buffer, src.buffer),
          "dma_copy: DMA moves data between HBM and SBUF; PSUM must be copied to SBUF with a compute engine first")
    _check(kinds == {True, False}, f"dma_copy: the shim allows HBM<->SBUF transfers only, got {src.buffer.name} -> "
                                  f"{dst.buffer.name}")
    _check(not (_is_indirect(dst) and _is_indirect(src)), "dma_copy: only one side may be indirect")
    if _is_indirect(dst) or _is_indirect(src):
        _check(dge_mode in (_DGE_UNKNOWN, _DGE_SW), "dma_copy: indirect gather/scatter needs software DGE")
        return _dma_indirect(dst, src, oob_mode)
    _check(oob_mode is _OOB_ERROR, "dma_copy: oob_mode only applies to indirect (dynamic) accesses")
    _check(dst.size == src.size, f"dma_copy: element counts differ ({src.shape} -> {dst.shape})")
    dst.write(_cast(src.read(), dst.dtype, "dma_copy").reshape(dst.shape))


def _dma_indirect(dst, src, oob):
    if _is_indirect(src):  # gather: partition p of dst <- row src.index[p]
        view, tile, scatter = src, dst, False
    else:  # scatter: row dst.index[p] <- partition p of src
        view, tile, scatter = dst, src, True
    _check(tile.buffer is _Mem.sbuf, "dma_copy: the direct side of an indirect DMA must be an SBUF tile")
    _check(tile.partitions == view.partitions and tile.free_size == view.free_size,
          f"dma_copy: tile {tile.shape} does not match the indirect access {view.shape}")
    storage = view._alloc.array.reshape(-1)
    rows = view.rows()
    if any(r is None for r in rows):
        _check(oob is _OOB_SKIP, "dma_copy: out-of-bounds indirect index (pass oob_mode=nisa.oob_mode.skip to skip "
                                "such rows)")
    data = tile.read().reshape(tile.partitions, tile.free_size)
    if scatter:
        targets = _np.concatenate([r for r in rows if r is not None]) if any(r is not None for r in rows) else []
        _check(len(_np.unique(targets)) == len(targets), "dma_copy: an indirect scatter writes the same element "
                                                       "twice (hardware order is undefined)")
        for p, r in enumerate(rows):
            if r is not None:
                storage[r.reshape(-1)] = _cast(data[p], storage.dtype, "dma_copy")
    else:
        out = tile.read()
        _check(tile._writable, "dma_copy: dst is read-only")
        for p, r in enumerate(rows):
            if r is not None:
                out[p] = _cast(storage[r.reshape(-1)], tile.dtype, "dma_copy").reshape(out.shape[1:])


_OOB_ERROR, _OOB_SKIP = oob_mode.error, oob_mode.skip
_DGE_UNKNOWN, _DGE_SW = dge_mode.unknown, dge_mode.swdge


# ------------------------------------------------------------------------------------------ data movement
def tensor_copy(dst, src, engine=engine.unknown, name=None):
    _tile(dst, "tensor_copy dst")
    _tile(src, "tensor_copy src")
    _same_layout(dst, src, "tensor_copy")
    _check(not (engine is _GPSIMD and _Mem.psum in (dst.buffer, src.buffer)), "tensor_copy: GpSimd cannot "
                                                                                       "access PSUM")
    values = src.read().reshape(src.partitions, src.free_size)
    _store(dst, values if src.dtype == dst.dtype else values.astype(_np.float32), "tensor_copy")


def memset(dst, value, engine=engine.unknown, name=None):
    _tile(dst, "memset dst")
    _check(isinstance(value, (int, float, _np.integer, _np.floating)), "memset: value must be a compile-time constant")
    _store(dst, _np.full((dst.partitions, dst.free_size), value, dtype=_np.float64), "memset")


def tensor_copy_predicated(dst, src, predicate, reverse_pred=False, name=None):
    _tile(dst, "tensor_copy_predicated dst")
    _tile(predicate, "tensor_copy_predicated predicate")
    _check(predicate.dtype in (_np.dtype(_np.uint8), _np.dtype(_np.uint16), _np.dtype(_np.uint32)),
          f"tensor_copy_predicated: predicate must be uint8/uint16/uint32, got {predicate.dtype}")
    _same_layout(dst, predicate, "tensor_copy_predicated")
    pred = predicate.read().reshape(dst.partitions, dst.free_size) != 0
    if reverse_pred:
        pred = ~pred
    out = dst.read().reshape(dst.partitions, dst.free_size).copy()
    if isinstance(src, _Tensor):
        _tile(src, "tensor_copy_predicated src")
        _same_layout(dst, src, "tensor_copy_predicated")
        _check(src.dtype == dst.dtype, f"tensor_copy_predicated: src {src.dtype} and dst {dst.dtype} must share a "
                                      f"dtype")
        _check(not (src.buffer is _Mem.psum and predicate.buffer is _Mem.psum),
              "tensor_copy_predicated: src and predicate cannot both be in PSUM")
        values = src.read().reshape(dst.partitions, dst.free_size)
        out[pred] = values[pred]
    else:
        out[pred] = src
    _store(dst, out, "tensor_copy_predicated")


# ------------------------------------------------------------------------------------------ tensor engine
def nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False, is_transpose=False,
              accumulate=None, tile_position=(), tile_size=(), perf_mode=None, name=None):
    if is_transpose or tile_position or tile_size or perf_mode not in (None, "none"):
        raise _NotImplemented("nc_matmul transpose / tiling / perf modes are not implemented by the shim")
    for t, what in ((stationary, "stationary"), (moving, "moving")):
        _tile(t, f"nc_matmul {what}", buffers=(_Mem.sbuf,))
        _check(t.ndim == 2, f"nc_matmul {what}: the shim takes 2-D operands, got {t.shape}")
        _check(_core.is_float(t.dtype), f"nc_matmul {what}: dtype {t.dtype} is not a Tensor Engine dtype")
    _tile(dst, "nc_matmul dst", buffers=(_Mem.psum,))
    _check(dst.dtype == _np.dtype(_np.float32), f"nc_matmul: the PSUM result must be float32, got {dst.dtype}")
    k, m = stationary.shape
    k2, n = moving.shape
    _check(k == k2, f"nc_matmul: contraction (partition) dims differ: stationary {stationary.shape}, moving "
                   f"{moving.shape}")
    _check(k <= _core.PMAX, f"nc_matmul: contraction dim {k} exceeds {_core.PMAX}")
    _check(m <= _core.GEMM_STATIONARY_FMAX, f"nc_matmul: stationary free dim {m} exceeds "
                                           f"{_core.GEMM_STATIONARY_FMAX}")
    _check(n <= _core.GEMM_MOVING_FMAX, f"nc_matmul: moving free dim {n} exceeds {_core.GEMM_MOVING_FMAX}")
    _check(dst.shape == (m, n), f"nc_matmul: dst {dst.shape} must be (stationary free, moving free) = {(m, n)}")
    f32 = _np.dtype(_np.float32)
    _check((stationary.dtype == f32) == (moving.dtype == f32),
          f"nc_matmul: a float32 operand needs a float32 partner ({stationary.dtype} x {moving.dtype})")
    written = dst.matmul_mask()
    if accumulate is None:
        _check(written.all() or not written.any(), "nc_matmul: accumulate=None on a partially initialized PSUM tile")
        accumulate = bool(written.all())
    elif accumulate:
        _check(written.all(), "nc_matmul: accumulate=True needs a PSUM tile initialized by a matmul")
    result = stationary.read().astype(_np.float32).T @ moving.read().astype(_np.float32)  # fp32 accumulation
    if accumulate:
        result = dst.read() + result
    dst.write(result.astype(_np.float32))
    written[...] = True


def nc_transpose(dst, data, engine=engine.unknown, name=None):
    if engine not in (_UNKNOWN, _TENSOR):
        raise _NotImplemented("nc_transpose on the Vector Engine is not implemented by the test shim")
    _tile(data, "nc_transpose data", buffers=(_Mem.sbuf,))
    _tile(dst, "nc_transpose dst", buffers=(_Mem.psum,))
    _check(data.ndim == 2 and dst.ndim == 2, "nc_transpose: the shim takes 2-D tiles")
    _check(data.shape[1] <= _core.PMAX, f"nc_transpose: the Tensor Engine transposes at most 128x128, got "
                                       f"{data.shape}")
    _check(dst.dtype == data.dtype, f"nc_transpose: dst dtype {dst.dtype} must equal data dtype {data.dtype}")
    _check(dst.shape == data.shape[::-1], f"nc_transpose: dst {dst.shape} must be {data.shape[::-1]}")
    dst.write(data.read().T)
    dst.matmul_mask()[...] = False


_UNKNOWN, _TENSOR, _GPSIMD = engine.unknown, engine.tensor, engine.gpsimd


# ------------------------------------------------------------------------------ vector / scalar / gpsimd
def tensor_tensor(dst, data1, data2, op, engine=engine.unknown, name=None):
    for t, what in ((dst, "dst"), (data1, "data1"), (data2, "data2")):
        _tile(t, f"tensor_tensor {what}")
    _same_layout(dst, data1, "tensor_tensor")
    _same_layout(data1, data2, "tensor_tensor")
    _check(not (data1.buffer is _Mem.psum and data2.buffer is _Mem.psum),
          "tensor_tensor: data1 and data2 cannot both be in PSUM")
    ints = {_np.dtype(_np.int32), _np.dtype(_np.uint32)}
    if {dst.dtype, data1.dtype, data2.dtype} <= ints and op.kind == "binary":  # GpSimd native integer math
        a = data1.read().reshape(dst.partitions, -1).astype(_np.int64)
        b = data2.read().reshape(dst.partitions, -1).astype(_np.int64)
        r = op.fn(a, b)
        info = _np.iinfo(dst.dtype)
        _check(r.min() >= info.min and r.max() <= info.max, f"tensor_tensor: integer result overflows {dst.dtype}")
        dst.write(r.astype(dst.dtype).reshape(dst.shape))
        return
    _store(dst, _alu(op, _f32(data1), _f32(data2), "tensor_tensor"), "tensor_tensor")


def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  engine=engine.unknown, name=None):
    _tile(dst, "tensor_scalar dst")
    _tile(data, "tensor_scalar data")
    _same_layout(dst, data, "tensor_scalar")
    x = _f32(data)
    a = _operand(operand0, data.partitions, "tensor_scalar operand0")
    x = _alu(op0, a, x, "tensor_scalar") if reverse0 else _alu(op0, x, a, "tensor_scalar")
    if op1 is not None:
        b = _operand(operand1, data.partitions, "tensor_scalar operand1")
        x = _alu(op1, b, x, "tensor_scalar") if reverse1 else _alu(op1, x, b, "tensor_scalar")
    else:
        _check(operand1 is None, "tensor_scalar: operand1 must be None when op1 is None")
    _store(dst, x, "tensor_scalar")


def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, name=None):
    _tile(dst, "scalar_tensor_tensor dst")
    _tile(data, "scalar_tensor_tensor data")
    _tile(operand1, "scalar_tensor_tensor operand1")
    _same_layout(dst, data, "scalar_tensor_tensor")
    _same_layout(data, operand1, "scalar_tensor_tensor")
    _check(not (data.buffer is _Mem.psum and operand1.buffer is _Mem.psum),
          "scalar_tensor_tensor: data and operand1 cannot both be in PSUM")
    x = _f32(data)
    a = _operand(operand0, data.partitions, "scalar_tensor_tensor operand0")
    x = _alu(op0, a, x, "scalar_tensor_tensor") if reverse0 else _alu(op0, x, a, "scalar_tensor_tensor")
    y = _f32(operand1)
    x = _alu(op1, y, x, "scalar_tensor_tensor") if reverse1 else _alu(op1, x, y, "scalar_tensor_tensor")
    _store(dst, x, "scalar_tensor_tensor")


def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    _tile(dst, "tensor_reduce dst")
    _tile(data, "tensor_reduce data")
    _check(dst.partitions == data.partitions, "tensor_reduce: partition dims differ")
    _check(isinstance(op, _nl._Op) and op.reducible, f"tensor_reduce: {op!r} is not a reduction operator")
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    axes = tuple(a % data.ndim for a in axes)
    _check(0 not in axes, "tensor_reduce: the partition axis cannot be reduced")
    _check(sorted(axes) == list(range(data.ndim - len(axes), data.ndim)),
          f"tensor_reduce: axes {axes} must be the last free dims of {data.shape}")
    x = data.read().astype(_np.float32)
    with _np.errstate(all="ignore"):
        r = op.fn.reduce(x, axis=axes, keepdims=False) if hasattr(op.fn, "reduce") else None
    r = _np.asarray(r, dtype=_np.float32).reshape(data.partitions, -1)
    _check(r.shape[1] == dst.free_size, f"tensor_reduce: dst {dst.shape} does not hold the reduced shape")
    _store(dst, -r if negate else r, "tensor_reduce")


_ACTIVATION_RANGES = {"rsqrt": (2.0**-87, 2.0**97)}
_scalar_engine_regs = {"value": None}  # the Scalar Engine's per-partition reduce registers


def _reset_engine_state():
    _scalar_engine_regs["value"] = None


def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd=reduce_cmd.idle,
               name=None):
    _tile(dst, "activation dst")
    _tile(data, "activation data")
    _same_layout(dst, data, "activation")
    _check(isinstance(op, _nl._Op) and op.kind == "unary", f"activation: {op!r} is not an activation function")
    P = data.partitions
    s = _operand(scale, P, "activation scale")
    x = _f32(data) * s
    if bias is not None:
        if isinstance(bias, _Tensor):
            _tile(bias, "activation bias")
            _check(bias.partitions == P and bias.free_size == 1, f"activation: bias must be ({P}, 1)")
            x = x + bias.read().reshape(P, 1).astype(_np.float32)
        else:
            x = x + _np.float32(bias)
    if op.name in _ACTIVATION_RANGES:
        lo, hi = _ACTIVATION_RANGES[op.name]
        _check(((x >= lo) & (x <= hi)).all(), f"activation: _nl.{op.name} input outside its valid range [{lo}, {hi}] "
                                             f"(the Scalar Engine returns garbage there)")
    with _np.errstate(all="ignore"):
        y = op.fn(x).astype(_np.float32)
    _store(dst, y, "activation")
    if reduce_cmd is not _IDLE:
        _check(reduce_op is _nl.add, "activation: reduce_op must be _nl.add")
        regs = _scalar_engine_regs["value"]
        if reduce_cmd in (_RESET, _RESET_REDUCE) or regs is None:
            _check(reduce_cmd in (_RESET, _RESET_REDUCE), "activation: reduce on uninitialized reduce registers")
            regs = _np.zeros((P, 1), dtype=_np.float32)
        _check(regs.shape[0] == P, "activation: reduce registers hold a different partition count")
        if reduce_cmd in (_REDUCE, _RESET_REDUCE):
            regs = regs + y.sum(axis=1, keepdims=True, dtype=_np.float32)
        _scalar_engine_regs["value"] = regs
    if reduce_res is not None:
        _tile(reduce_res, "activation reduce_res")
        _check(reduce_res.partitions == P and reduce_res.free_size == 1, f"activation: reduce_res must be ({P}, 1)")
        _check(_scalar_engine_regs["value"] is not None, "activation: reading uninitialized reduce registers")
        _store(reduce_res, _scalar_engine_regs["value"], "activation reduce_res")


_IDLE, _RESET, _REDUCE, _RESET_REDUCE = reduce_cmd.idle, reduce_cmd.reset, reduce_cmd.reduce, reduce_cmd.reset_reduce


def reciprocal(dst, data, name=None):
    _tile(dst, "reciprocal dst")
    _tile(data, "reciprocal data")
    _same_layout(dst, data, "reciprocal")
    with _np.errstate(divide="ignore"):
        _store(dst, _np.float32(1.0) / _f32(data), "reciprocal")


def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    _tile(dst, "iota dst", buffers=(_Mem.sbuf,))
    pattern = [(int(step), int(num)) for step, num in pattern]
    _check(1 <= len(pattern) <= 4, "iota: the pattern has 1 to 4 dims")
    _check(_math.prod(n for _, n in pattern) == dst.free_size,
          f"iota: pattern {pattern} does not cover the {dst.free_size} elements per partition of dst")
    values = _np.zeros((), dtype=_np.int64)
    for step, num in pattern:
        values = values[..., None] + step * _np.arange(num, dtype=_np.int64)
    channel = channel_multiplier * _np.arange(dst.partitions, dtype=_np.int64)[:, None]
    values = int(offset) + channel + values.reshape(1, -1)
    _check(_np.abs(values).max() < 2**31, "iota: values overflow int32")
    _store(dst, values.astype(_np.float64) if _core.is_float(dst.dtype) else values, "iota")
