"""Triton kernel for ``dflash::paged_kv_write``: scatter rows into a paged pool in place.

The leading dims of ``pool [*lead, num_slots, Hkv, D]`` and ``values [*lead, N, Hkv, D]`` are flattened into
one. One program copies one row ``values[l, i]`` (a ``[Hkv, D]`` tile, cast to the pool dtype) to
``pool[l, slots[i]]``; a negative slot masks the store, and so does a slot past the end of the pool (which
the reference rejects with an IndexError) rather than writing out of bounds.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl
from torch import Tensor


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
    mask = (h[:, None] < H) & (d[None, :] < D) & (slot >= 0) & (slot < num_slots)  # never write out of bounds
    x = tl.load(values_ptr + lead * sv_l + i * sv_n + h[:, None] * sv_h + d[None, :] * sv_d, mask=mask)
    dst = pool_ptr + lead * sp_l + slot * sp_s + h[:, None] * sp_h + d[None, :] * sp_d
    tl.store(dst, x.to(pool_ptr.dtype.element_ty), mask=mask)


def _launch(pool, slots, values):
    *lead, num_slots, H, D = pool.shape
    N = slots.shape[0]
    lead_numel = math.prod(lead)
    if lead_numel == 0 or N == 0 or H * D == 0:
        return
    pool_flat = pool.view(lead_numel, num_slots, H, D)  # a view: the writes must land in ``pool`` (raises if not)
    values_flat = values.expand(*lead, N, H, D).reshape(lead_numel, N, H, D)
    block_d = triton.next_power_of_2(D)
    block_h = min(triton.next_power_of_2(H), max(1, 4096 // block_d))  # at most 4096 elements per program
    grid = (N, pool_flat.shape[0], triton.cdiv(H, block_h))
    _kernel[grid](
        pool_flat, slots, values_flat,
        slots.stride(0),
        *pool_flat.stride(),
        *values_flat.stride(),
        num_slots, H, D,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
    )


def paged_kv_write(pool: Tensor, slots: Tensor, values: Tensor) -> None:
    """Triton implementation of :func:`dflash_compile.lowerings.ops.paged_kv_write` (same contract)."""
    _launch(pool, slots, values)
