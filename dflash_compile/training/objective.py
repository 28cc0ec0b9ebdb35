"""The DFlash drafter training objective: many masked blocks per sequence, one forward, weighted cross-entropy.

Convention (the same as inference, ``DFlashSpecWrapper.prefill``/``_propose``): a block anchored at position
``a`` is ``[x_a, mask, ..., mask]`` at positions ``a .. a+B-1``. ``x_a`` plays the bonus token: at inference it
is the target's newest token, whose own hidden state is NOT yet in the drafter's cache, so the block sees the
context rows of positions ``< a`` only (``ctx_lens = a``), plus every position of its own block
(non-causal), and nothing else — not the rows at or after ``a``, not the other blocks. Block position ``k``
(``1 <= k < B``) is trained to predict ``x_{a+k}``, the target's own token there, with weight
``exp(-(k-1)/gamma)`` (early positions matter most: a draft is only useful if everything before it is accepted).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..models.draft_model import DFlashDraftModel


def position_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """``[B-1]`` loss weights of block positions ``1..B-1``: ``exp(-(k-1)/gamma)``."""
    k = torch.arange(1, block_size, dtype=torch.float32, device=device)
    return torch.exp(-(k - 1) / gamma)


def default_gamma(block_size: int) -> float:
    """Our default decay: 7 for blocks of 16 or more, 5 for 10..15, 4 below."""
    return 7.0 if block_size >= 16 else 5.0 if block_size >= 10 else 4.0


def sample_anchors(lengths: torch.Tensor, num_blocks: int, block_size: int, min_anchor: torch.Tensor | int,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``num_blocks`` anchors per row, uniform in ``[min_anchor, length - block_size]`` (so every label exists).

    ``lengths [N]`` valid tokens per row, ``min_anchor`` int or ``[N]`` (>= 1: a block needs one context row).
    Returns ``anchors [N, num_blocks]`` (sorted) and ``valid [N]`` (False for rows too short for one block;
    their anchors are clamped into range and their loss is masked out).
    """
    lo = torch.as_tensor(min_anchor, device=lengths.device).clamp(min=1).expand_as(lengths)
    hi = lengths - block_size  # inclusive
    valid = hi >= lo
    span = (hi - lo + 1).clamp(min=1)
    u = torch.rand(lengths.shape[0], num_blocks, generator=generator).to(lengths.device)
    anchors = lo[:, None] + (u * span[:, None]).long().clamp(max=span[:, None] - 1)
    anchors = torch.minimum(anchors, lengths[:, None].clamp(min=1) - 1).clamp(min=0)
    return anchors.sort(dim=1).values, valid


def block_inputs(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int):
    """-> ``block_ids``, ``block_positions`` ``[N, nb * B]`` and ``labels [N, nb, B-1]`` (``x_{a+k}``, k >= 1)."""
    N, nb = anchors.shape
    offsets = torch.arange(block_size, device=tokens.device)
    positions = anchors[:, :, None] + offsets  # [N, nb, B]
    ids = torch.full_like(positions, mask_token_id)
    ids[:, :, 0] = tokens.gather(1, anchors)
    idx = positions[:, :, 1:].clamp(max=tokens.shape[1] - 1)
    labels = tokens.gather(1, idx.flatten(1)).view(N, nb, block_size - 1)
    return ids.flatten(1), positions.flatten(1), labels


def block_mask(anchors: torch.Tensor, num_ctx: int, block_size: int, window: int | None = None) -> torch.Tensor:
    """``[N, 1, nb*B, num_ctx + nb*B]`` bool visibility (True = visible).

    A query in block ``j`` (anchor ``a_j``) sees context rows ``p < a_j`` and the ``B`` keys of block ``j``.
    With a ``window`` (a sliding-attention layer), a query at position ``q`` also loses every key at position
    ``q - window`` or before, as ``DFlashDraftModel.attention_mask`` hides them at inference.
    """
    N, nb = anchors.shape
    Q = nb * block_size
    block_of = torch.arange(Q, device=anchors.device) // block_size  # [Q]
    q_anchor = anchors[:, block_of]  # [N, Q]
    key_pos = torch.arange(num_ctx, device=anchors.device)[None, None, :]
    ctx = key_pos < q_anchor[:, :, None]  # [N, Q, S]
    own = (block_of[:, None] == block_of[None, :]).expand(N, Q, Q)
    if window is not None:
        q_pos = q_anchor + torch.arange(Q, device=anchors.device) % block_size  # [N, Q]
        ctx = ctx & (q_pos[:, :, None] - key_pos < window)
        own = own & (q_pos[:, :, None] - q_pos[:, None, :] < window)
    return torch.cat([ctx, own], dim=-1)[:, None]


def layer_masks(draft: DFlashDraftModel, anchors: torch.Tensor, num_ctx: int) -> list[torch.Tensor]:
    """``block_mask`` for each drafter layer: sliding-attention layers with the drafter's window."""
    cfg = draft.dflash_config
    masks = {kind: block_mask(anchors, num_ctx, draft.block_size, cfg.sliding_window if kind == "sliding_attention"
                              else None) for kind in set(cfg.layer_types)}
    return [masks[kind] for kind in cfg.layer_types]


def dflash_loss(
    draft: DFlashDraftModel,
    aux_hidden: torch.Tensor,
    tokens: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    gamma: float,
) -> tuple[torch.Tensor, dict]:
    """The weighted block cross-entropy for one batch.

    ``aux_hidden [N, T, n_ids*H]``: the frozen target's concatenated hidden states over ``tokens [N, T]``;
    ``anchors [N, nb]``, ``valid [N]`` from ``sample_anchors``. Returns the loss and detached metrics:
    ``acc [B-1]`` (top-1 accuracy per block position) and ``tau`` (mean accepted prefix + 1 under greedy
    acceptance of this batch's blocks, an estimate of the acceptance length).
    """
    B = draft.block_size
    N, T = tokens.shape
    nb = anchors.shape[1]
    ctx = draft.context_features(aux_hidden)  # [N, T, H]
    positions = torch.arange(T, device=tokens.device).expand(N, T)
    ctx_k, ctx_v = draft.context_kv(ctx, positions)  # [L, N, T, Hkv, D]
    ids, pos, labels = block_inputs(tokens, anchors, B, draft.mask_token_id)
    logits = draft.forward_blocks(ids, pos, ctx_k, ctx_v, layer_masks(draft, anchors, T))
    logits = logits.view(N, nb, B, -1)[:, :, 1:]  # [N, nb, B-1, Vd]
    # A reduced draft vocabulary: labels outside it (-1) cannot be drafted; they count as misses, not in the loss.
    labels = draft.target_to_draft(labels)
    ce = F.cross_entropy(logits.float().flatten(0, 2), labels.flatten(), reduction="none", ignore_index=-1)
    ce = ce.view(N, nb, B - 1)
    w = position_weights(B, gamma, tokens.device) * valid[:, None, None].float()  # [N, nb, B-1] by broadcast
    w = w * (labels >= 0)
    loss = (ce * w).sum() / w.sum().clamp(min=1e-9)
    with torch.no_grad():
        hit = (logits.argmax(-1) == labels) & valid[:, None, None]
        nv = valid.sum().clamp(min=1) * nb
        acc = hit.flatten(0, 1).sum(0).float() / nv
        prefix = hit.long().cumprod(-1).sum(-1).float()  # [N, nb]
        tau = 1.0 + (prefix * valid[:, None]).sum() / nv
    return loss, {"acc": acc, "tau": float(tau), "ce_first": float(ce.detach()[..., 0][valid].mean()) if bool(valid.any()) else math.nan}
