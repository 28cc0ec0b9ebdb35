"""Which keys a query sees: the one visibility rule of the package.

``MaskSpec(causal, window, chunk)`` says it for one kind of attention layer; the target's masks over the paged
context, the drafter's masks (context and block), the reference ``block_attention`` op and the pattern the
``block_attention`` pass matches are all built from :meth:`MaskSpec.visible`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MaskSpec:
    """A key at position ``p`` is visible to a query at position ``P`` iff ``p <= P`` when ``causal``, ``P - p <
    window`` when ``window``, and ``p // chunk == P // chunk`` when ``chunk`` (chunked attention: a query sees its own
    chunk of positions only)."""

    causal: bool = True
    window: int | None = None
    chunk: int | None = None

    def __post_init__(self):
        for name in ("window", "chunk"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"MaskSpec.{name} must be None or a positive int, got {v!r}")

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor, within: torch.Tensor | None = None):
        """``within & rule(q_pos, k_pos)`` broadcast (``within``: the keys that exist; None: all of them), the
        conditions and-ed left to right in the order above. None when nothing restricts (``within`` None and a
        non-causal, unwindowed, unchunked spec)."""
        out = within
        if self.causal:
            out = _and(out, k_pos <= q_pos)
        if self.window:
            out = _and(out, q_pos - k_pos < self.window)
        if self.chunk:
            out = _and(out, k_pos // self.chunk == q_pos // self.chunk)
        return out


def _and(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    return b if a is None else a & b


def context_visibility(q_positions, ctx_lens, key_pos, spec: MaskSpec) -> torch.Tensor:
    """Which context keys each query sees: ``[B, T, S]`` (``[B, 1, S]`` when ``spec`` restricts nothing).

    Key ``p`` (``key_pos [S]``) is visible to the query at ``q_positions[b, i]`` iff ``p < ctx_lens[b]`` and
    ``spec`` lets it."""
    kp = key_pos[None, None, :]
    return spec.visible(q_positions[:, :, None], kp, kp < ctx_lens[:, None, None])


def block_visibility(q_positions, spec: MaskSpec) -> torch.Tensor:
    """Which of a block's own keys each of its queries sees: ``[B, T, T]`` (the block's keys sit at its own
    ``q_positions [B, T]``)."""
    B, T = q_positions.shape
    rule = spec.visible(q_positions[:, :, None], q_positions[:, None, :])
    every = torch.ones(B, T, T, dtype=torch.bool, device=q_positions.device)
    return every if rule is None else every & rule
