"""The DFlash custom ops: schema, eager reference (the oracle) and fake implementation.

Each op is a ``torch.library.custom_op`` in the ``dflash`` namespace. The reference below is plain torch and
runs on every device; device kernels (``lowerings/triton``, ``lowerings/nki``) are registered on top of it
and are tested against it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..primitives.kv_projection import context_kv
from ..primitives.masks import MaskSpec, block_visibility, context_visibility


# ----------------------------------------------------------------------------------------------- fused_kv_proj
@torch.library.custom_op("dflash::fused_kv_proj", mutates_args=())
def fused_kv_proj(
    ctx: Tensor, weight: Tensor, k_norm_weight: Tensor, cos: Tensor, sin: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """K and V of context rows for every draft layer, from one matmul against the stacked weights.

    ``ctx [N, H]``; ``weight [2 * L * Hkv * D, H]`` = the K projections of layers ``0..L-1`` then their V
    projections (each ``Hkv * D`` rows); ``k_norm_weight [L, D]``; ``cos``/``sin [N, D]``.
    Returns ``k, v [L, N, Hkv, D]``: ``k`` is RMS-normed over ``D`` (statistics in fp32 for half types)
    with ``k_norm_weight[l]`` and ``eps``, then rotated (rotate-half RoPE) with ``cos``/``sin``.
    """
    return _fused_kv_proj_reference(ctx, weight, k_norm_weight, cos, sin, eps)


def _fused_kv_proj_reference(ctx, weight, k_norm_weight, cos, sin, eps):
    k, v = context_kv(ctx, weight, k_norm_weight, cos, sin, eps)
    return k.to(ctx.dtype).contiguous(), v.contiguous()


@fused_kv_proj.register_fake
def _(ctx, weight, k_norm_weight, cos, sin, eps):
    L, D = k_norm_weight.shape
    shape = (L, ctx.shape[0], weight.shape[0] // (2 * L * D), D)
    return ctx.new_empty(shape), ctx.new_empty(shape)


# ---------------------------------------------------------------------------------------------- paged_kv_write
@torch.library.custom_op("dflash::paged_kv_write", mutates_args=("pool",))
def paged_kv_write(pool: Tensor, slots: Tensor, values: Tensor) -> None:
    """Scatter rows into a paged pool in place: ``pool[..., slots[i], :, :] = values[..., i, :, :]``.

    ``pool [*lead, num_slots, Hkv, D]``, ``slots [N]`` int64 in ``[-num_slots, num_slots)``, ``values [*lead, N,
    Hkv, D]`` (leading dims of size 1 may be missing). Slots index as torch indexes: a negative slot counts from
    the end of the pool (the step sends every write that must land nowhere to slot -1, its trash slot). Rows
    written to the same slot leave it holding one of them, unspecified which: only a slot that is never read
    (the trash) may be written twice.
    """
    _paged_kv_write_reference(pool, slots, values)


def _paged_kv_write_reference(pool, slots, values):
    pool[..., slots, :, :] = values.to(pool.dtype)


@paged_kv_write.register_fake
def _(pool, slots, values):
    return None


# --------------------------------------------------------------------------------------------- block_attention
@torch.library.custom_op("dflash::block_attention", mutates_args=())
def block_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_table: Tensor,
    ctx_lens: Tensor,
    q_positions: Tensor,
    k_block: Tensor | None,
    v_block: Tensor | None,
    page_size: int,
    causal: bool,
    window: int,
    scale: float,
    chunk: int = 0,
) -> Tensor:
    """A query block per request attending to its paged context plus, optionally, the block's own keys.

    ``q [B, Hq, T, D]``; ``k_pool``/``v_pool [num_slots, Hkv, D]``; ``block_table [B, NB]`` int64;
    ``ctx_lens [B]``; ``q_positions [B, T]``; ``k_block``/``v_block [B, Hkv, T, D]`` or None. Every context
    position below ``ctx_lens[b]`` must lie in an allocated block (table entry >= 0).

    Keys of row ``b``: the context positions ``p < ctx_lens[b]``, stored at slot
    ``block_table[b, p // page_size] * page_size + p % page_size``, then the ``T`` block keys, the j-th at
    position ``q_positions[b, j]`` (a block's positions are consecutive). Query ``i`` at position ``P =
    q_positions[b, i]`` sees a key at position ``p`` (context or block) iff ``MaskSpec(causal, window or None, chunk
    or None)`` lets it (``primitives.masks``): ``(not causal or p <= P) and (window == 0 or P - p < window) and
    (chunk == 0 or p // chunk == P // chunk)``. Query head ``h`` reads
    KV head ``h // (Hq // Hkv)`` (GQA). A query that sees no key returns zeros. Returns ``[B, Hq, T, D]``.
    """
    return _block_attention_reference(
        q, k_pool, v_pool, block_table, ctx_lens, q_positions, k_block, v_block, page_size, causal, window, scale, chunk
    )


def block_attention_mask(ctx_lens, q_positions, num_ctx, block_len, causal, window, chunk=0):
    """The visibility of :func:`block_attention` as a boolean ``[B, T, num_ctx + block_len]`` tensor."""
    spec = MaskSpec(causal=causal, window=window or None, chunk=chunk or None)
    key_pos = torch.arange(num_ctx, device=q_positions.device)
    B, T = q_positions.shape
    ctx = context_visibility(q_positions, ctx_lens, key_pos, spec).expand(B, T, num_ctx)
    if not block_len:
        return ctx
    return torch.cat([ctx, block_visibility(q_positions, spec)], dim=-1)


def _block_attention_reference(
    q, k_pool, v_pool, block_table, ctx_lens, q_positions, k_block, v_block, page_size, causal, window, scale, chunk=0
):
    B, Hq, T, D = q.shape
    Hkv = k_pool.shape[-2]
    S = block_table.shape[1] * page_size
    key_pos = torch.arange(S, device=q.device)
    slots = block_table.gather(1, key_pos.expand(B, S) // page_size) * page_size + key_pos % page_size
    slots = torch.where(key_pos[None, :] < ctx_lens[:, None], slots, 0)  # absent positions: any real slot
    k = k_pool[slots].transpose(1, 2)  # [B, Hkv, S, D]
    v = v_pool[slots].transpose(1, 2)
    if k_block is not None:
        k, v = torch.cat([k, k_block], dim=2), torch.cat([v, v_block], dim=2)
    mask = block_attention_mask(ctx_lens, q_positions, S, T if k_block is not None else 0, causal, window, chunk)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32  # fp32 accumulation for half types
    k = k.repeat_interleave(Hq // Hkv, dim=1).to(acc)
    v = v.repeat_interleave(Hq // Hkv, dim=1).to(acc)
    scores = (q.to(acc) @ k.transpose(-1, -2)) * scale  # [B, Hq, T, K]
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query with no visible key -> zeros
    v = torch.where(mask.any(1)[:, None, :, None], v, 0.0)  # keys no query sees contribute nothing, even NaN
    return (probs @ v).to(q.dtype).contiguous()


@block_attention.register_fake
def _(q, k_pool, v_pool, block_table, ctx_lens, q_positions, k_block, v_block, page_size, causal, window, scale,
      chunk=0):
    return q.new_empty(q.shape)  # contiguous, like every implementation
