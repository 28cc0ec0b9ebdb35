"""Pass ``fused_kv_proj``: the drafter's context K/V projection becomes ``dflash.fused_kv_proj``.

Matches: one ``linear`` of the context rows ``ctx [B, S, H]`` against the K and V weights of every draft
layer stacked ``[2 * L * Hkv * D, H]``, split into K and V per layer, K RMS-normed over ``D`` with the
stacked per-layer ``k_norm`` weights ``[L, D]`` and rotated (rotate-half RoPE) with ``cos``/``sin
[B, S, D]`` — ``primitives.kv_projection.context_kv``, which the drafter runs — in its fp32/fp64 form and in its half-precision form (fp32
statistics).
Rewrite to: ``dflash.fused_kv_proj`` over the ``B * S`` rows, its ``[L, B * S, Hkv, D]`` outputs viewed
back to ``[L, B, S, Hkv, D]``.
"""

from __future__ import annotations

import operator

import torch
from torch._inductor.pattern_matcher import Match, PatternMatcherPass, register_replacement

from ..lowerings import ops  # noqa: F401  (registers torch.ops.dflash.*)
from ..primitives.kv_projection import context_kv
from ._common import DFlashPass, aten, same_shape, trace_pre_dispatch, val


# ---- search pattern: the drafter's own maths (``primitives.kv_projection.context_kv``), traced
_context_kv = context_kv


# ---- replacement
def _fused(ctx, weight, k_norm, cos, sin, eps):
    B, S, H = ctx.shape
    L, D = k_norm.shape
    k, v = torch.ops.dflash.fused_kv_proj(
        ctx.reshape(B * S, H), weight, k_norm, cos.reshape(B * S, D), sin.reshape(B * S, D), eps
    )
    return k.view(L, B, S, -1, D), v.view(L, B, S, -1, D)


def _extra_check(match: Match) -> bool:
    ctx, weight, k_norm, cos, sin = (val(match.kwargs[k]) for k in ("ctx", "weight", "k_norm", "cos", "sin"))
    if any(t is None for t in (ctx, weight, k_norm, cos, sin)) or ctx.dim() != 3 or k_norm.dim() != 2:
        return False
    B, S, H = ctx.shape
    L, D = k_norm.shape
    return (
        same_shape(weight.shape[1:], (H,))
        and weight.shape[0] % (2 * L * D) == 0
        and D % 2 == 0
        and same_shape(cos.shape, (B, S, D)) and same_shape(sin.shape, (B, S, D))
        and ctx.dtype == weight.dtype == k_norm.dtype == cos.dtype == sin.dtype
    )


class FusedKVProjPass(DFlashPass):
    name = "fused_kv_proj"

    def __init__(self):
        self.patterns = PatternMatcherPass(pass_name=self.name)
        for dtype in (torch.float32, torch.float16):  # the two traced forms of the RMSNorm
            ex = [torch.empty(2, 3, 16, dtype=dtype), torch.empty(2 * 2 * 2 * 4, 16, dtype=dtype),
                  torch.empty(2, 4, dtype=dtype), torch.empty(2, 3, 4, dtype=dtype), torch.empty(2, 3, 4, dtype=dtype)]
            register_replacement(_context_kv, _fused, ex, trace_pre_dispatch, self.patterns,
                                 extra_check=_extra_check, scalar_workaround={"eps": 1e-6})

    def apply(self, graph, region=None):
        n = self.patterns.apply(graph)
        for fused in graph.find_nodes(op="call_function", target=torch.ops.dflash.fused_kv_proj.default):
            _wire_v(graph, fused)
        return n


def _wire_v(graph: torch.fx.Graph, fused: torch.fx.Node) -> None:
    """Point the readers of the matched V at the op's second output.

    The pattern matcher replaces a multi-output pattern's outputs only where the pattern's output node is the
    matched graph's own: V (``kv[1]``, a ``select`` of the permuted projection) stayed an output of the original
    stacked ``linear``, which then ran beside the op for V alone (every step computed the context rows' K/V matmul
    twice). Here each ``select(permute(view(linear(ctx, weight))), 0, 1)`` over the op's own ``ctx`` and ``weight``
    reads the op's V instead, viewed as the replacement views K (``[L, B, S, Hkv, D]``); the linear is then dead."""
    reshape, weight = fused.args[0], fused.args[1]
    k_views = [v for g in fused.users if g.target is operator.getitem and g.args[1] == 0
               for v in g.users if v.target == aten.view.default]
    if not (isinstance(reshape, torch.fx.Node) and reshape.target == aten.reshape.default and k_views):
        return
    selects = [sel for linear in reshape.args[0].users
               if linear.target == aten.linear.default and linear.args[1] is weight and len(linear.args) == 2
               for view in linear.users for permute in view.users if permute.target == aten.permute.default
               for sel in permute.users if sel.target == aten.select.int and tuple(sel.args[1:]) == (0, 1)]
    for sel in selects:
        with graph.inserting_after(k_views[0]):
            v = graph.call_function(operator.getitem, (fused, 1))
        with graph.inserting_after(v):
            viewed = graph.call_function(aten.view.default, (v, k_views[0].args[1]))
        v.meta["val"] = val(fused)[1] if val(fused) is not None else None
        viewed.meta["val"] = val(sel)
        sel.replace_all_uses_with(viewed)
