"""Triton kernel for ``dflash::paged_kv_write``: scatter rows into a paged pool in place.

The leading dims of ``pool [*lead, num_slots, Hkv, D]`` and ``values [*lead, N, Hkv, D]`` are flattened into
one (by strides: the kernel writes through ``pool`` itself, so a traced launch mutates the graph input, not a
view of it). One program copies one row ``values[l, i]`` (a ``[Hkv, D]`` tile, cast to the pool dtype) to
``pool[l, slots[i]]``. Slots index as torch indexes: a slot in ``[-num_slots, 0)`` counts from the end of
the pool. A slot outside ``[-num_slots, num_slots)`` (the reference raises an IndexError) masks the store
rather than writing out of bounds.

The launch goes through ``torch.library.wrap_triton``, so tracing :func:`paged_kv_write` with make_fx
records a ``triton_kernel_wrapper_mutation`` node that Inductor compiles; the launcher reads no tensor value.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton


@triton.jit
def _kernel(
    pool_ptr, slots_ptr, values_ptr,
    s_slot,
    sp_l, sp_s, sp_h, sp_d,
    sv_l, sv_n, sv_h, sv_d,
    num_slots, H, D,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    lead = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    slot = tl.load(slots_ptr + i * s_slot).to(tl.int64)
    slot = tl.where(slot < 0, slot + num_slots, slot)  # slot -1 is the last slot, as in torch indexing
    mask = (h[:, None] < H) & (d[None, :] < D) & (slot >= 0) & (slot < num_slots)  # never write out of bounds
    x = tl.load(values_ptr + lead * sv_l + i * sv_n + h[:, None] * sv_h + d[None, :] * sv_d, mask=mask)
    dst = pool_ptr + lead * sp_l + slot * sp_s + h[:, None] * sp_h + d[None, :] * sp_d
    tl.store(dst, x.to(pool_ptr.dtype.element_ty), mask=mask)


def _lead_stride(t, n_lead):
    """The stride of ``t``'s first ``n_lead`` dims flattened into one, which must be possible without a copy."""
    dims = [(size, stride) for size, stride in zip(t.shape[:n_lead], t.stride()[:n_lead]) if size != 1]
    for (_, outer), (size, inner) in zip(dims, dims[1:]):
        if outer != inner * size:
            raise ValueError(f"paged_kv_write: the leading dims of a pool of strides {t.stride()} do not flatten")
    return dims[-1][1] if dims else 0


def plan(N, lead_numel, H, D) -> dict:
    """Pure-Python launch plan from static shapes (what :func:`_launch` runs)."""
    block_d = triton.next_power_of_2(D)
    block_h = min(triton.next_power_of_2(H), max(1, 4096 // block_d))  # at most 4096 elements per program
    return dict(BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4, grid=(N, lead_numel, triton.cdiv(H, block_h)))


def _launch(pool, slots, values):
    *lead, num_slots, H, D = pool.shape
    N = slots.shape[0]
    lead_numel = math.prod(lead)
    if lead_numel == 0 or N == 0 or H * D == 0:
        return
    values_flat = values.expand(*lead, N, H, D).reshape(lead_numel, N, H, D)
    p = plan(N, lead_numel, H, D)
    block_h, block_d, grid = p["BLOCK_H"], p["BLOCK_D"], p["grid"]
    wrap_triton(_kernel)[grid](
        pool, slots, values_flat,
        slots.stride(0),
        _lead_stride(pool, len(lead)), *pool.stride()[-3:],
        *values_flat.stride(),
        num_slots, H, D,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=p["num_warps"],
    )


def paged_kv_write(pool: Tensor, slots: Tensor, values: Tensor) -> None:
    """Triton implementation of :func:`dflash_compile.lowerings.ops.paged_kv_write` (same contract)."""
    _launch(pool, slots, values)
