"""CPU lowering of ``dflash::block_attention``: fp32 attention with few queries (decoding, short blocks, small
batches: ``KERNEL_MAX_QUERIES``) calls the C++ paged attention (``block_attention.cpp``,
``dflash_cpu.block_attention``: K/V read in place from the pool); anything else, or where the kernel cannot be built
or ``DFLASH_CPU_ATTENTION=0``, runs the op as plain ATen, for Inductor to compile into C++ (``aten_block_attention``).

The backend traces this function into the step graph in place of the op (``lowerings.lower``), so the compiled
step never calls back into Python for attention. The ATen form walks exactly the context the block table spans: the
step hands each graph the table of its context-length bucket, so the cost follows the live context with no host
read. GQA runs without repeating K/V: the ``G = Hq // Hkv`` query heads of a KV head are stacked on the query
dim (``[B, Hkv, G * T, D]``). Keys no query sees are zeroed, so garbage (even NaN) in the pool at masked slots
cannot reach the output; a query that sees no key returns zeros (SDPA would return NaN). Half-precision inputs
accumulate in fp32.
"""

from __future__ import annotations

import torch
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
    chunk: int = 0,
) -> Tensor:
    """CPU implementation of :func:`dflash_compile.lowerings.ops.block_attention` (same contract)."""
    args = (q, k_pool, v_pool, block_table, ctx_lens, q_positions, k_block, v_block, page_size, causal, window, scale,
            chunk)
    if _kernel_takes(q, k_pool, v_pool, k_block, v_block):
        return torch.ops.dflash_cpu.block_attention(*args)
    return aten_block_attention(*args)


#: The kernel takes a graph's attention when, for every size the graph may see, each KV head serves at most
#: ``KERNEL_MAX_QUERIES`` queries (query heads per KV head times the block length) or the call has at most
#: ``KERNEL_MAX_TOTAL_QUERIES`` (rows times query heads times the block length). It reads each key once per query (a
#: dot product with a horizontal sum); the ATen form multiplies all of a head's queries by the gathered keys in one
#: matmul, which wins with many queries, and costs a fixed ~0.1 ms more per call, which loses with few. SmolLM2-135M's
#: heads (9 query, 3 KV), 200 tokens of context, one thread, us per layer (``kernel / ATen form compiled``): 8 rows,
#: block of 1: 225 / 452, 2: 368 / 533, 4: 660 / 657, 8: 1264 / 1092; block of 8, 1 row: 326 / 568, 2 rows: 331 /
#: 377, 4 rows: 639 / 620; 4 rows, block of 4: 351 / 398.
KERNEL_MAX_QUERIES = 8
KERNEL_MAX_TOTAL_QUERIES = 256


def _kernel_takes(q, k_pool, v_pool, k_block, v_block) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    from . import row_linear  # the library of the CPU kernels

    tensors = [t for t in (q, k_pool, v_pool, k_block, v_block) if t is not None]
    B, Hq, T = q.shape[:3]
    few = (statically_known_true((Hq // k_pool.shape[-2]) * T <= KERNEL_MAX_QUERIES)
           or statically_known_true(B * Hq * T <= KERNEL_MAX_TOTAL_QUERIES))
    return (all(t.dtype == torch.float32 and t.stride(-1) == 1 for t in tensors) and k_pool.dim() == 3 and few
            and row_linear.attention_enabled() and row_linear.load())


def aten_block_attention(
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
    """The op as plain ATen (every dtype): the context gathered out of the pool, then two matmuls."""
    B, Hq, T, D = q.shape
    Hkv = k_pool.shape[-2]
    G = Hq // Hkv
    S = block_table.shape[1] * page_size
    offsets = torch.arange(page_size, device=q.device)
    slots = (block_table.clamp(min=0)[:, :, None] * page_size + offsets).reshape(B, S)  # unallocated: masked below
    k, v = k_pool[slots], v_pool[slots]  # [B, S, Hkv, D]
    if k_block is not None:
        k = torch.cat([k, k_block.transpose(1, 2)], dim=1)  # [B, S + T, Hkv, D]
        v = torch.cat([v, v_block.transpose(1, 2)], dim=1)
    visible = block_attention_mask(ctx_lens, q_positions, S, T if k_block is not None else 0, causal, window,
                                   chunk)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    used = visible.any(1)[:, :, None, None]  # [B, K, 1, 1]: keys some query sees
    # K as a contiguous [B, Hkv, K, D] buffer, read transposed by the score matmul (a BLAS flag): the gather then
    # copies whole head rows (D contiguous values). Without the contiguous(), the matmul's [B * Hkv, D, K] reshape is
    # no view for B > 1, and Inductor wrote K in that order, gathering it value by value with a stride of Hkv * D:
    # this op 1.3-2.3x slower at B = 2-8, the same at B = 1 (benchmarks.md, "The attention gather").
    k = torch.where(used, k, 0.0).to(acc).transpose(1, 2).contiguous()  # [B, Hkv, K, D]
    v = torch.where(used, v, 0.0).to(acc).transpose(1, 2)  # [B, Hkv, K, D]
    qg = q.to(acc).reshape(B, Hkv, G * T, D)  # query heads of one KV head stacked: h = kv * G + g
    scores = (qg @ k.transpose(-2, -1)) * scale  # [B, Hkv, G * T, K]
    mask = visible[:, None, None].expand(B, 1, G, T, visible.shape[-1]).reshape(B, 1, G * T, -1)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(mask.any(-1, keepdim=True), probs, 0.0)  # a query with no visible key -> zeros
    return (probs @ v).reshape(B, Hq, T, D).to(q.dtype)
