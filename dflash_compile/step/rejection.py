"""Acceptance and sampling. Sync-free: fixed shapes, no host reads.

Sampled tokens are drawn by position, not by step: the token at position ``t`` of a request seeded ``s`` is
``argmax(scores_t + g(s, t))``, with Gumbel noise ``g`` hashed from ``(s, t, token)`` (``sample_at_positions``).
Verification computes that token at every verified position and keeps the drafts that equal it (``greedy_accept``,
as for greedy rows); the drafter proposes with the same noise (``argmax(draft scores + g)``), so a drafter close to
the target proposes the token the target will draw. What a request emits is then a function of its seed, each
position and the target's (processed) distribution there: never of ``K``, the batch, the step's graph or the rank.
The law is exact: each token is a Gumbel-max sample of the target's processed conditional, with noise independent
across positions (its 32-bit uniforms are the one approximation, a probability resolution of 2**-32 per token).
"""

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


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds) on int64 tensors holding values in ``[0, 2**32)``; its
    constant is below 2**27, so no product leaves int64 (no overflow, the same bits eager, compiled, on any device)."""
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def noise_bits(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """32 random bits ``[R, T, V]`` (int64) per (seed, position, token id): a counter-based hash in integer
    arithmetic, the same bits in every step, batch row, bucket, graph, device and rank."""
    seeds = seeds.to(torch.long)
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    h = _mix32((_mix32(hi) + lo + 0x9E3779B9) & _M32)  # [R]
    h = _mix32((h[:, None] + (positions.to(torch.long) & _M32) * 0x2545F49) & _M32)  # [R, T]
    token = torch.arange(vocab_size, device=positions.device, dtype=torch.long)
    return _mix32((h[..., None] + token * 0x27D4EB2F + 0x165667B1) & _M32)  # [R, T, V]


def position_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel noise ``[R, T, V]`` (fp32) for the tokens at ``positions [R, T]`` of the requests seeded ``seeds [R]``
    (int64), from ``noise_bits``. Uniforms have 32 bits: ``w = 1 - u`` is formed directly so the upper tail (the
    noise that wins an argmax) keeps full precision, ``g = -log(-log1p(-w))``. The bits are exact everywhere; the
    two logarithms are as exact as the kernel that runs them (compiled and eager may differ in the last bit, as the
    target's own logits do)."""
    h = noise_bits(seeds, positions, vocab_size)
    w = (0x100000000 - h).to(torch.float32) * (1.0 / 0x100000000) - (0.5 / 0x100000000)  # 1 - u, u in (0, 1)
    # fp32 cannot hold 1 - 2**-32: the lower tail stops at u = 2**-24 (finite noise, so a row whose one allowed
    # token drew there still draws it)
    return -torch.log(-torch.log1p(-w.clamp(max=1.0 - 2.0**-24)))


def sample_at_positions(scores: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One token per position, ``argmax(scores + position_noise)`` (the Gumbel-max trick): an exact sample of
    ``softmax(scores)`` at each position (``-inf`` scores are never drawn), and a function of (seed, position,
    scores) alone. ``scores [R, T, V]`` (processed logits), ``seeds [R]``, ``positions [R, T]`` -> ``[R, T]``."""
    return (scores.float() + position_noise(seeds, positions, scores.shape[-1])).argmax(-1)
