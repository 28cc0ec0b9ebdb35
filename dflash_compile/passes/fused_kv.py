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

import torch
from torch._inductor.pattern_matcher import Match, PatternMatcherPass, register_replacement

from ..lowerings import ops  # noqa: F401  (registers torch.ops.dflash.*)
from ..primitives.kv_projection import context_kv
from ._common import DFlashPass, same_shape, trace_pre_dispatch, val


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

    def apply(self, graph):
        return self.patterns.apply(graph)
