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
