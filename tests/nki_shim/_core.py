"""Tensors, buffers and the hardware checks shared by the shim's ``nki.language`` and ``nki.isa``.

Everything is eager numpy. On-chip tensors (SBUF, PSUM) are fresh numpy allocations filled with a sentinel
(NaN for floats, 4 for integers, as the real simulator does) so that reading memory nothing wrote shows up.
HBM tensors handed to a kernel wrap the caller's array itself, so a kernel that writes an input updates it in
place, like ``nki.simulate``.
"""

from __future__ import annotations

import enum
import math

import numpy as np

# Trn2 (NeuronCore-v3) limits, the ones the issue and the kernels rely on.
PMAX = 128  # partitions of SBUF / PSUM
GEMM_STATIONARY_FMAX = 128  # free size of the stationary matmul operand (PE columns)
GEMM_MOVING_FMAX = 512  # free size of the moving matmul operand (fp32 elements of one PSUM bank)
PSUM_BANK_FMAX = 512
PSUM_PARTITION_BYTES = 16 * 1024  # 8 banks x 2 KiB per partition
SBUF_PARTITION_BYTES = 192 * 1024


class NkiValidationError(Exception):
    """A violated hardware or API constraint (the real SDK raises ``nisa.NkiValidationError`` / asserts)."""


class ShimNotImplementedError(NotImplementedError, AttributeError):
    """An NKI name the shim does not implement. Also an ``AttributeError`` so that ``hasattr`` stays sane."""


def strict_module_getattr(module_name: str):
    def __getattr__(name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        raise ShimNotImplementedError(
            f"{module_name}.{name} is not implemented by the test shim (tests/nki_shim implements only the "
            f"NKI subset the dflash kernels use)"
        )

    return __getattr__


def check(cond: bool, message: str) -> None:
    if not cond:
        raise NkiValidationError(message)


class MemoryRegion(enum.Enum):
    sbuf = "sbuf"
    psum = "psum"
    private_hbm = "private_hbm"
    shared_hbm = "shared_hbm"

    @property
    def on_chip(self) -> bool:
        return self in (MemoryRegion.sbuf, MemoryRegion.psum)


def _supported_dtypes():
    dtypes = {np.dtype(t) for t in (np.float32, np.float16, np.int32, np.uint32, np.int16, np.uint16, np.int8,
                                    np.uint8)}
    try:
        import ml_dtypes

        dtypes.add(np.dtype(ml_dtypes.bfloat16))
    except ImportError:
        pass
    return frozenset(dtypes)


SUPPORTED_DTYPES = _supported_dtypes()


def is_float(dtype) -> bool:
    return np.dtype(dtype).kind == "f" or np.dtype(dtype).name == "bfloat16"


def check_dtype(dtype, what: str) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise NkiValidationError(f"{what}: {dtype!r} is not an NKI dtype") from None
    if dt not in SUPPORTED_DTYPES:
        hint = " (NKI has no 64-bit types: convert indices to int32)" if dt.itemsize == 8 else ""
        raise NkiValidationError(f"{what}: dtype {dt} is not supported{hint}")
    return dt


def sentinel_fill(array: np.ndarray) -> None:
    array[...] = np.nan if is_float(array.dtype) else 4


class _Allocation:
    """One allocation: its array and, for PSUM, which elements hold a matmul result (for ``accumulate``)."""

    def __init__(self, array: np.ndarray, buffer: MemoryRegion, name: str):
        self.array = array
        self.buffer = buffer
        self.name = name
        self.matmul_written = np.zeros(array.shape, dtype=bool) if buffer is MemoryRegion.psum else None


def allocate(shape, dtype, buffer, name="") -> "NkiTensor":
    check(isinstance(buffer, MemoryRegion), f"nl.ndarray: buffer must be nl.sbuf/nl.psum/nl.hbm/nl.shared_hbm, "
                                            f"got {buffer!r}")
    shape = tuple(int(s) for s in shape)
    check(len(shape) >= 1 and all(s > 0 for s in shape), f"nl.ndarray: bad shape {shape}")
    dt = check_dtype(dtype, "nl.ndarray")
    if buffer.on_chip:
        check(len(shape) >= 2, f"nl.ndarray: an on-chip ({buffer.name}) tensor needs a partition dim and a free "
                               f"dim, got shape {shape}")
        check(shape[0] <= PMAX, f"nl.ndarray: partition dim {shape[0]} of {buffer.name} tile {name or ''}"
                                f"{shape} exceeds {PMAX}")
        free_bytes = math.prod(shape[1:]) * dt.itemsize
        limit = PSUM_PARTITION_BYTES if buffer is MemoryRegion.psum else SBUF_PARTITION_BYTES
        check(free_bytes <= limit, f"nl.ndarray: {buffer.name} tile {shape} {dt} needs {free_bytes} bytes per "
                                   f"partition, more than the {limit} a partition has")
    array = np.empty(shape, dtype=dt)
    sentinel_fill(array)
    return NkiTensor(array, _Allocation(array, buffer, name))


def hbm_argument(array: np.ndarray) -> "NkiTensor":
    check_dtype(array.dtype, "kernel argument")
    check(array.flags.c_contiguous, "kernel argument: HBM tensors must be C-contiguous arrays")
    check(array.ndim >= 1, "kernel argument: 0-d arrays are not tensors; pass a Python scalar instead")
    return NkiTensor(array, _Allocation(array, MemoryRegion.shared_hbm, "arg"))


def _element_offset(view: np.ndarray, base: np.ndarray) -> int:
    delta = view.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    assert delta % base.dtype.itemsize == 0
    return delta // base.dtype.itemsize


class NkiTensor:
    """A strided view over one allocation (the shim's ``nl.ndarray`` result and every view of it)."""

    def __init__(self, view: np.ndarray, alloc: _Allocation, writable: bool = True):
        self._a = view
        self._alloc = alloc
        self._writable = writable

    # ---------------------------------------------------------------- attributes of the real NkiTensor
    @property
    def shape(self):
        return tuple(self._a.shape)

    @property
    def dtype(self):
        return self._a.dtype

    @property
    def ndim(self):
        return self._a.ndim

    @property
    def size(self):
        return int(self._a.size)

    @property
    def buffer(self):
        return self._alloc.buffer

    @property
    def name(self):
        return self._alloc.name

    @property
    def offset(self):
        return _element_offset(self._a, self._alloc.array)

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        raise ShimNotImplementedError(f"NkiTensor.{name} is not implemented by the test shim")

    def __repr__(self):
        return f"NkiTensor(shape={self.shape}, dtype={self.dtype}, buffer={self.buffer.name})"

    # ---------------------------------------------------------------- helpers for the instructions
    @property
    def on_chip(self) -> bool:
        return self.buffer.on_chip

    @property
    def partitions(self) -> int:
        return self.shape[0]

    @property
    def free_size(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def start_partition(self) -> int:
        base = self._alloc.array
        return self.offset // max(1, math.prod(base.shape[1:]))

    def read(self) -> np.ndarray:
        return self._a

    def write(self, values: np.ndarray) -> None:
        check(self._writable, f"{self!r} is a broadcast (read-only) view and cannot be written")
        self._a[...] = np.asarray(values).reshape(self._a.shape)

    def matmul_mask(self) -> np.ndarray:
        """The view of the allocation's ``matmul_written`` flags matching this view (PSUM only)."""
        mask = self._alloc.matmul_written
        itemsize = self._a.dtype.itemsize
        strides = tuple(s // itemsize for s in self._a.strides)
        return np.lib.stride_tricks.as_strided(mask.reshape(-1)[self.offset:], self._a.shape, strides)

    # ---------------------------------------------------------------- views
    def __getitem__(self, key):
        key = key if isinstance(key, tuple) else (key,)
        for k in key:
            if not (isinstance(k, (int, np.integer, slice)) or k is Ellipsis):
                raise ShimNotImplementedError(f"NkiTensor indexing with {k!r} is not implemented by the test shim")
        if self.on_chip and key and isinstance(key[0], (int, np.integer)):
            i = int(key[0]) % self.shape[0]
            key = (slice(i, i + 1),) + key[1:]  # the partition dim is kept at size 1
        view = self._a[key]
        if self.on_chip and view.ndim < 2:
            raise ShimNotImplementedError("indexing an on-chip tile down to fewer than 2 dims is not implemented "
                                          "by the test shim")
        check(view.size > 0, f"empty view {key} of {self!r}")
        return NkiTensor(view, self._alloc, self._writable)

    def permute(self, dims):
        dims = tuple(dims)
        check(sorted(dims) == list(range(self.ndim)), f"permute: {dims} is not a permutation")
        check(not self.on_chip or dims[0] == 0, "permute: the partition dim of an on-chip tensor stays first")
        return NkiTensor(self._a.transpose(dims), self._alloc, self._writable)

    def broadcast(self, dim, size):
        check(self.shape[dim] == 1, f"broadcast: dim {dim} of {self.shape} is not 1")
        check(not (self.on_chip and dim == 0), "broadcast: cannot broadcast the partition dim of an on-chip tensor")
        shape = list(self.shape)
        shape[dim] = int(size)
        return NkiTensor(np.broadcast_to(self._a, tuple(shape)), self._alloc, writable=False)

    def reshape(self, shape):
        shape = tuple(int(s) for s in shape)
        check(math.prod(shape) == self.size, f"reshape: {self.shape} -> {shape} changes the element count")
        check(not self.on_chip or shape[0] == self.shape[0], "reshape: the partition dim of an on-chip tensor "
                                                             "must be kept")
        try:
            view = self._a.reshape(shape, copy=False)
        except ValueError:
            raise NkiValidationError(f"reshape: the layout of {self!r} cannot be viewed as {shape}") from None
        return NkiTensor(view, self._alloc, self._writable)

    def ap(self, pattern, offset=None, scalar_offset=None, vector_offset=None, indirect_dim=0, dtype=None):
        if scalar_offset is not None:
            raise ShimNotImplementedError("NkiTensor.ap(scalar_offset=...) is not implemented by the test shim")
        if dtype is not None and np.dtype(dtype) != self.dtype:
            raise ShimNotImplementedError("NkiTensor.ap(dtype=...) reinterpret casts are not implemented by the "
                                          "test shim")
        base = self._alloc.array
        pattern = [(int(step), int(num)) for step, num in pattern]
        check(len(pattern) >= 1 and all(num > 0 for _, num in pattern), f"ap: bad pattern {pattern}")
        offset = self.offset if offset is None else int(offset)
        if self.on_chip:
            check(pattern[0][0] == math.prod(base.shape[1:]),
                  f"ap: the partition step of an on-chip access must be the free size {math.prod(base.shape[1:])} "
                  f"of its storage, got {pattern[0][0]}")
        if vector_offset is not None:
            return _IndirectView(self._alloc, pattern, offset, vector_offset, indirect_dim)
        hi = offset + sum((num - 1) * step for step, num in pattern if step > 0)
        lo = offset + sum((num - 1) * step for step, num in pattern if step < 0)
        check(0 <= lo and hi < base.size, f"ap: pattern {pattern} at offset {offset} leaves the storage of "
                                          f"{base.size} elements")
        flat = base.reshape(-1)
        itemsize = base.dtype.itemsize
        view = np.lib.stride_tricks.as_strided(flat[offset:], tuple(n for _, n in pattern),
                                               tuple(s * itemsize for s, _ in pattern))
        return NkiTensor(view, self._alloc, self._writable)


class _IndirectView:
    """``tensor.ap(..., vector_offset=idx, indirect_dim=0)``: partition ``p`` addresses row ``idx[p]``."""

    def __init__(self, alloc, pattern, offset, vector_offset, indirect_dim):
        check(not alloc.buffer.on_chip, "ap(vector_offset=...): the indirectly addressed tensor must be in HBM")
        check(indirect_dim == 0, "ap(vector_offset=...): only indirect_dim=0 is supported")
        check(isinstance(vector_offset, NkiTensor) and vector_offset.buffer is MemoryRegion.sbuf,
              "ap(vector_offset=...): the offsets must be an SBUF tile")
        check(vector_offset.dtype in (np.dtype(np.int32), np.dtype(np.uint32)),
              f"ap(vector_offset=...): offsets must be int32/uint32, got {vector_offset.dtype}")
        check(vector_offset.shape == (pattern[0][1], 1),
              f"ap(vector_offset=...): offsets of shape {vector_offset.shape} do not match the {pattern[0][1]} "
              f"partitions of the pattern (expected ({pattern[0][1]}, 1))")
        self._alloc = alloc
        self.pattern = pattern
        self.offset_ = offset
        self.index = vector_offset
        self.shape = tuple(n for _, n in pattern)
        self.dtype = alloc.array.dtype
        self.buffer = alloc.buffer

    @property
    def partitions(self):
        return self.shape[0]

    @property
    def free_size(self):
        return math.prod(self.shape[1:])

    def rows(self):
        """For each partition: the flat element indices it addresses, or None where the index is out of bounds."""
        base = self._alloc.array
        row_stride = math.prod(base.shape[1:])
        inner = np.zeros((), dtype=np.int64)
        for step, num in self.pattern[1:]:
            inner = (inner[..., None] + step * np.arange(num)).astype(np.int64)
        idx = self.index.read().reshape(-1)
        out = []
        for p in range(self.partitions):
            i = int(idx[p])
            if self.index.dtype == np.dtype(np.int32) and i < 0:
                out.append(None)
                continue
            flat = self.offset_ + i * row_stride + inner
            ok = 0 <= i < base.shape[0] and flat.min() >= 0 and flat.max() < base.size
            out.append(flat if ok else None)
        return out
