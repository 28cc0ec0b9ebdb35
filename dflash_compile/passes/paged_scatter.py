"""Pass ``paged_kv_write``: the paged-pool scatter becomes ``dflash.paged_kv_write``.

Matches: ``pool[(slice,) * k + (slots,)] = values`` on a ``[*lead, num_slots, heads, head_dim]`` pool, i.e.
``aten.index_put_(pool, [None] * k + [slots], values)`` with ``k == pool.dim() - 3``, 1-D integer ``slots``
and ``values [*lead, len(slots), heads, head_dim]`` of the pool's dtype (k = 0, 1 or 2: a bare pool, the
target's per-layer ``[2, slots, ...]`` view, the drafter's ``[layers, 2, slots, ...]`` pool).
Rewrite to: ``dflash.paged_kv_write(pool, slots, values)`` in place; every later use of the ``index_put_``
result reads the pool itself. The op indexes slots as torch does (a negative slot counts from the end of the
pool: the step's trash slot), so the rewrite keeps the values exactly.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch._inductor.pattern_matcher import Match, PatternMatcherPass, register_replacement

from ..lowerings import ops  # noqa: F401  (registers torch.ops.dflash.*)
from ._common import DFlashPass, same_shape, trace_pre_dispatch, val

aten = torch.ops.aten


# ---- search patterns (plain torch), one per number of leading pool dims
def _scatter_0(pool, slots, values):
    return aten.index_put_(pool, [slots], values)


def _scatter_1(pool, slots, values):
    return aten.index_put_(pool, [None, slots], values)


def _scatter_2(pool, slots, values):
    return aten.index_put_(pool, [None, None, slots], values)


# ---- replacement
def _write(pool, slots, values):
    lead = pool.dim() - 3
    values = values.expand(*pool.shape[:lead], slots.shape[0], *pool.shape[-2:])  # setitem drops leading 1s
    torch.ops.dflash.paged_kv_write(pool, slots, values)
    return pool


def _check(lead: int):
    def extra_check(match: Match) -> bool:
        pool, slots, values = (val(match.kwargs[k]) for k in ("pool", "slots", "values"))
        if pool is None or slots is None or values is None:
            return False
        return (
            pool.dim() == lead + 3
            and slots.dim() == 1
            and not slots.is_floating_point()
            and slots.dtype != torch.bool
            and values.dtype == pool.dtype
            and _broadcasts_to(tuple(values.shape), (*pool.shape[:lead], slots.shape[0], *pool.shape[-2:]))
        )

    return extra_check


def _broadcasts_to(shape, full) -> bool:
    """``shape`` is ``full`` with some leading size-1 dims dropped (what ``pool[..., slots] = v`` accepts)."""
    k = len(full) - len(shape)
    return k >= 0 and same_shape(shape, full[k:]) and all(statically_known_true(d == 1) for d in full[:k])


class PagedKVWritePass(DFlashPass):
    name = "paged_kv_write"

    def __init__(self):
        self.patterns = PatternMatcherPass(pass_name=self.name)
        ex = {
            0: [torch.empty(10, 2, 4), torch.zeros(3, dtype=torch.long), torch.empty(3, 2, 4)],
            1: [torch.empty(2, 10, 2, 4), torch.zeros(3, dtype=torch.long), torch.empty(2, 3, 2, 4)],
            2: [torch.empty(3, 2, 10, 2, 4), torch.zeros(3, dtype=torch.long), torch.empty(3, 2, 3, 2, 4)],
        }
        for lead, search in enumerate((_scatter_0, _scatter_1, _scatter_2)):
            register_replacement(search, _write, ex[lead], trace_pre_dispatch, self.patterns, extra_check=_check(lead))

    def apply(self, graph, region=None):
        return self.patterns.apply(graph)
