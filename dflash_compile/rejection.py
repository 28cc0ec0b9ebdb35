"""Acceptance rules. Sync-free: fixed shapes, no host reads."""

from __future__ import annotations

import torch


def greedy_accept(drafts: torch.Tensor, target_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Longest prefix of ``drafts`` that matches the target's greedy tokens.

    ``drafts [B, K]`` were proposed for positions 1..K of the verified block; ``target_tokens [B, K + 1]`` is
    the target's argmax at each block position. Returns ``(tokens [B, K + 1], num_accepted [B])``: the
    accepted drafts followed by the target's own next token, padded with -1. Accepted drafts equal the
    target's tokens at the same places, so the emitted tokens are ``target_tokens[:, :num_accepted + 1]``.
    """
    match = (drafts == target_tokens[:, :-1]).to(torch.int32)  # [B, K]
    num_accepted = match.cumprod(dim=1).sum(dim=1)  # [B]
    pos = torch.arange(target_tokens.shape[1], device=target_tokens.device)  # [K + 1]
    keep = pos[None, :] <= num_accepted[:, None]
    return torch.where(keep, target_tokens, torch.full_like(target_tokens, -1)), num_accepted


def process_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """HF's sampling warpers, in HF's order: temperature -> top-k -> top-p; filtered logits become ``-inf``.

    ``logits [R, ..., V]``; ``temperature``, ``top_k``, ``top_p`` are per-row ``[R]`` tensors (``top_k == 0`` and
    ``top_p == 1`` disable that warper, as in HF). Top-k keeps ties with the k-th value (``TopKLogitsWarper``);
    top-p keeps the smallest set of most likely tokens whose cumulative probability exceeds ``top_p``, and always
    at least one token (``TopPLogitsWarper``). One ascending sort serves both. Static shapes, no host reads.
    """
    V = logits.shape[-1]
    view = (-1,) + (1,) * (logits.dim() - 1)  # per-row parameter -> broadcast over the row's positions and vocab
    scores = logits.float() / temperature.float().reshape(view)
    ordered, order = torch.sort(scores, dim=-1)  # ascending, as TopPLogitsWarper sorts
    k = torch.where(top_k > 0, torch.clamp(top_k, max=V), V).reshape(view)  # [R, 1.., 1]
    kth = ordered.gather(-1, (V - k).expand(*ordered.shape[:-1], 1))  # the k-th largest score
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
    remove = (cumulative <= 1 - top_p.reshape(view)) & (top_p.reshape(view) < 1)
    remove[..., -1] = False  # min_tokens_to_keep = 1
    ordered = ordered.masked_fill(remove, float("-inf"))
    return torch.empty_like(scores).scatter(-1, order, ordered)


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample of ``probs [..., V]`` (not necessarily normalised) with one uniform ``u [...]`` in [0, 1).

    Returns the first index whose cumulative mass exceeds ``u * total``: never a zero-probability token.
    """
    cdf = probs.cumsum(dim=-1)
    threshold = (u.to(cdf.dtype) * cdf[..., -1])[..., None]
    idx = torch.searchsorted(cdf.contiguous(), threshold.contiguous(), right=True)[..., 0]
    return torch.clamp(idx, max=probs.shape[-1] - 1)


def speculative_accept(
    drafts: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    u_accept: torch.Tensor,
    u_bonus: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard speculative sampling (Leviathan et al. 2023; Chen et al. 2023): lossless at any temperature.

    ``drafts [B, K]`` were sampled from ``draft_probs [B, K, V]``; ``target_probs [B, K + 1, V]`` is the target's
    processed distribution at each block position. Draft ``i`` is accepted when ``u_accept[:, i] * p_draft <
    p_target`` (probability ``min(1, p_target / p_draft)``; always when ``p_draft == 0 < p_target``). At the first
    rejection the next token is sampled with ``u_bonus [B]`` from ``normalise(max(p_target - p_draft, 0))``
    (from ``p_target`` should that be all zero); after full acceptance, from ``p_target`` at position K (the bonus).
    Returns ``(tokens [B, K + 1], num_accepted [B])``, tokens padded with -1, as ``greedy_accept``.
    """
    B, K = drafts.shape
    p_t = target_probs[:, :K].gather(-1, drafts[..., None])[..., 0]  # [B, K]
    p_d = draft_probs.gather(-1, drafts[..., None])[..., 0]  # [B, K]
    accept = (u_accept.to(p_t.dtype) * p_d < p_t).to(torch.int32)
    num_accepted = accept.cumprod(dim=1).sum(dim=1)  # [B]

    # The distribution of the token after the accepted prefix: the residual, or the target's (bonus, p_draft = 0).
    p_draft_ext = torch.cat([draft_probs, draft_probs.new_zeros(B, 1, draft_probs.shape[-1])], dim=1)  # [B, K+1, V]
    at = num_accepted[:, None, None].expand(B, 1, target_probs.shape[-1])
    p_t_next = target_probs.gather(1, at)[:, 0]  # [B, V]
    residual = torch.clamp(p_t_next - p_draft_ext.gather(1, at)[:, 0].to(p_t_next.dtype), min=0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_t_next)
    next_token = sample_from(residual, u_bonus)  # [B]

    pos = torch.arange(K + 1, device=drafts.device)[None, :]
    drafts_ext = torch.cat([drafts, drafts.new_full((B, 1), -1)], dim=1)
    tokens = torch.where(pos < num_accepted[:, None], drafts_ext, -1)
    tokens = torch.where(pos == num_accepted[:, None], next_token[:, None], tokens)
    return tokens, num_accepted
