"""NKI kernel for ``dflash::paged_kv_write``: scatter rows into a paged pool by indirect DMA.

Rows go HBM -> SBUF in tiles of up to 128 (one row per partition), then SBUF -> HBM with the destination
addressed through a per-partition vector of slots (``.ap(vector_offset=...)``). Slots index as torch indexes:
the launcher wraps a slot in ``[-num_slots, 0)`` to ``slot + num_slots`` (slot -1 is the pool's last slot)
before offsetting it by the leading index. A slot outside ``[-num_slots, num_slots)`` (the reference raises an
IndexError) becomes ``Lp * num_slots``, one row past the pool, and ``oob_mode=skip`` drops that row rather than
writing elsewhere; no negative index reaches the DMA.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import _runtime

nl = nisa = None  # bound by _kernel(): importing this module never needs the Neuron SDK


def _paged_kv_write_kernel(pool, slots, values):
    """``pool [R, F]`` (written in place), ``slots [Lp, N]`` int32 rows of ``pool`` (>= R: skipped),
    ``values [Lp * N, F]`` in ``pool.dtype``."""
    R, F = pool.shape
    Lp, N = slots.shape
    P = nl.tile_size.pmax
    for lead in range(Lp):
        for n0 in range(0, N, P):
            nt = min(P, N - n0)
            idx = nl.ndarray((nt, 1), dtype=nl.int32, buffer=nl.sbuf)
            nisa.dma_copy(dst=idx, src=slots[lead, n0:n0 + nt])
            rows = nl.ndarray((nt, F), dtype=pool.dtype, buffer=nl.sbuf)  # values come in the pool dtype
            nisa.dma_copy(dst=rows, src=values[lead * N + n0:lead * N + n0 + nt, :])
            nisa.dma_copy(
                dst=pool.ap(pattern=[[F, nt], [1, F]], offset=0, vector_offset=idx, indirect_dim=0),
                src=rows,
                oob_mode=nisa.oob_mode.skip,
            )


def _kernel():
    global nl, nisa
    nki, nl, nisa = _runtime.import_nki()
    return _runtime.jitted(nki, _paged_kv_write_kernel)


def _launch(pool: Tensor, slots: Tensor, values: Tensor) -> None:
    num_slots = pool.shape[-3]
    F = pool.shape[-2] * pool.shape[-1]
    Lp = math.prod(pool.shape[:-3])
    N = slots.shape[0]
    if N == 0 or Lp == 0:
        return
    if Lp * num_slots >= 2**31:
        raise ValueError(f"paged_kv_write: {Lp * num_slots} pool rows do not fit the kernel's int32 indices")
    # cast on the host: whether a DMA casts between dtypes depends on the DMA engine (hardware DGE does not)
    values = values.to(pool.dtype).expand(*pool.shape[:-3], N, *pool.shape[-2:]).reshape(Lp * N, F)
    # lead l of the pool is rows [l * num_slots, (l + 1) * num_slots) of a [Lp * num_slots, F] view
    lead = torch.arange(Lp, device=slots.device)[:, None] * num_slots
    wrapped = torch.where(slots < 0, slots + num_slots, slots)  # [N] torch indexing: -1 is the last slot
    in_range = (wrapped >= 0) & (wrapped < num_slots)
    # out of range: row Lp * num_slots, one past the pool (skipped; no negative index reaches the DMA)
    rows = torch.where(in_range[None, :], wrapped[None, :] + lead, Lp * num_slots).to(torch.int32)  # [Lp, N]
    target = pool if pool.is_contiguous() else pool.contiguous()
    _runtime.launch(_kernel(), target.view(Lp * num_slots, F), rows, values.contiguous(), inout=(0,))
    if target is not pool:
        pool.copy_(target)


def paged_kv_write(pool: Tensor, slots: Tensor, values: Tensor) -> None:
    """Same contract as :func:`dflash_compile.lowerings.ops.paged_kv_write` (writes ``pool`` in place)."""
    _launch(pool, slots, values)
