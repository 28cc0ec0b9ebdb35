"""The drafter's context K/V maths, written once: the drafter runs it, the ``fused_kv_proj`` pass traces it as its
search pattern, and the reference ``dflash::fused_kv_proj`` op is it over flattened rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3 RMSNorm with a weight that broadcasts over ``x``'s last dims.

    Statistics in fp32 for half types (as HF), in the input's own precision for fp32/fp64.
    """
    dtype = x.dtype
    xf = x.float() if x.element_size() < 4 else x
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE; ``x`` is ``[..., S, H, D]`` and ``cos``/``sin`` are ``[..., S, D]``."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def context_kv(ctx: torch.Tensor, weight: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of context rows for every draft layer, from one matmul against the stacked weights.

    ``ctx [..., H]`` (any leading dims); ``weight [2 * L * Hkv * D, H]`` = the K projections of layers ``0..L-1``
    then their V projections; ``k_norm [L, D]``; ``cos``/``sin [..., D]``. Returns ``k, v [L, ..., Hkv, D]``: ``k``
    RMS-normed over ``D`` with ``k_norm[l]`` and ``eps``, then rotated with ``cos``/``sin``.
    """
    L, D = k_norm.shape
    lead = ctx.shape[:-1]
    kv = F.linear(ctx, weight).view(*lead, 2, L, -1, D)
    kv = kv.permute(len(lead), len(lead) + 1, *range(len(lead)), len(lead) + 2, len(lead) + 3)  # [2, L, ..., Hkv, D]
    k = rms_norm(kv[0], k_norm.view(L, *[1] * len(lead), 1, D), eps)
    return apply_rope(k, cos, sin), kv[1]
