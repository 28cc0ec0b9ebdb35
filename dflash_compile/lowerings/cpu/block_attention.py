"""CPU kernel for ``dflash::block_attention``: length-adaptive paged attention on top of SDPA.

The step is static-shaped, so eager code (and the oracle in ``ops.py``) attends over every position a block
table can hold. Inside the op, running eagerly on the host, the longest live context is known: this kernel
gathers only the KV blocks up to it and runs the fused CPU SDPA kernel with native GQA. Keys no query sees
are zeroed, so garbage (even NaN) in the pool at masked slots cannot reach the output; a query that sees no
key returns zeros (SDPA would return NaN).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..ops import block_attention_mask


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
) -> Tensor:
    """CPU implementation of :func:`dflash_compile.lowerings.ops.block_attention` (same contract)."""
    B, Hq, T, D = q.shape
    if q.numel() == 0:
        return q.new_empty(q.shape)
    longest = int(ctx_lens.max().clamp(min=0))  # a host read: free on CPU, and the point of this kernel
    num_blocks = min(-(-longest // page_size), block_table.shape[1])
    S = num_blocks * page_size
    table = block_table[:, :num_blocks].clamp(min=0)  # entries past a row's length are masked below
    slots = (table[:, :, None] * page_size + torch.arange(page_size, device=q.device)).reshape(B, S)
    k = k_pool[slots].transpose(1, 2)  # [B, Hkv, S, D]
    v = v_pool[slots].transpose(1, 2)
    if k_block is not None:
        k, v = torch.cat([k, k_block], dim=2), torch.cat([v, v_block], dim=2)
    visible = block_attention_mask(ctx_lens, q_positions, S, T if k_block is not None else 0, causal, window)
    used = visible.any(1)[:, None, :, None]  # [B, 1, K, 1]: keys some query sees
    k, v = torch.where(used, k, 0.0), torch.where(used, v, 0.0)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=visible[:, None], scale=scale, enable_gqa=k.shape[1] != Hq
    )
    return torch.where(visible.any(-1)[:, None, :, None], out, 0.0).contiguous()
