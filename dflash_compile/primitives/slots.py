"""Slots: one token position of one request in a paged pool, and the page arithmetic around them.

A request owns KV blocks (pages) of ``page_size`` slots; its block table lists them (``-1`` where unallocated), and
position ``p`` lives in slot ``block_table[p // page_size] * page_size + p % page_size``. Two extra slots sit at the
end of every pool:

- ``TRASH_SLOT`` (-1): every write that must land nowhere (padded rows, rejected positions, positions past
  capacity) goes here. It is never read.
- ``ZERO_SLOT`` (-2): every read of a position that holds nothing for that request maps here. It is never
  written, so masked keys are exact zeros and garbage (even NaN) in another request's blocks or in the
  trash can never leak through ``0 * x`` in attention.
"""

from __future__ import annotations

import torch

TRASH_SLOT = -1
ZERO_SLOT = -2


def pages(num_tokens: int, page_size: int) -> int:
    """Pages that hold ``num_tokens`` positions (the ceiling of ``num_tokens / page_size``)."""
    return -(-num_tokens // page_size)


def _paged_slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """``block_table[pos // block_size] * block_size + pos % block_size`` per row.

    ``block_table [B, num_blocks]``, ``positions [B, T]`` (each ``< num_blocks * block_size``) -> ``[B, T]``.
    ``block_size`` is the KV block (page) size.
    """
    return block_table.gather(1, positions // block_size) * block_size + positions % block_size


def write_slots(block_table, positions, valid, block_size):
    """Slots to write ``positions`` to; ``TRASH_SLOT`` where ``valid`` is False (``[B, T]`` each)."""
    last = block_table.shape[1] * block_size - 1
    slots = _paged_slots(block_table, positions.clamp(0, last), block_size)
    return torch.where(valid, slots, TRASH_SLOT)


def read_slots(block_table, kv_lens, block_size):
    """Slots of positions ``0 .. num_blocks * block_size - 1`` of each row; ``ZERO_SLOT`` at ``>= kv_lens``.

    Returns ``(slots [B, S], key_positions [S])``.
    """
    S = block_table.shape[1] * block_size
    key_pos = torch.arange(S, device=block_table.device)
    slots = _paged_slots(block_table, key_pos.expand(block_table.shape[0], S), block_size)
    return torch.where(key_pos[None, :] < kv_lens[:, None], slots, ZERO_SLOT), key_pos
