"""CPU lowering of ``dflash::block_attention``: fp32 attention calls the C++ paged attention (``block_attention.cpp``,
``dflash_cpu.block_attention``: K/V read in place from the pool); other dtypes, or where the kernel cannot be built
or ``DFLASH_CPU_ATTENTION=0``, run the op as plain ATen, for Inductor to compile into C++ (``aten_block_attention``).

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


def _kernel_takes(q, k_pool, v_pool, k_block, v_block) -> bool:
    """The kernel takes every fp32 call: it multiplies a task's queries by its keys as a small matrix product (the
    queries across the vector lanes), and beats the ATen form compiled (gather, then two matmuls) at every size
    measured (SmolLM2-135M's heads, 9 query and 3 KV of dim 64, ~200 tokens of context, one thread, µs per layer,
    kernel / ATen form: the plain step at 1 and 16 rows 30 / 152 and 430 / 1011, a verify of 8 positions 70 / 252 and
    1033 / 3214; ``benchmarks/bench_block_attention.py``, docs/kernels.md)."""
    from . import row_linear  # the library of the CPU kernels

    tensors = [t for t in (q, k_pool, v_pool, k_block, v_block) if t is not None]
    return (all(t.dtype == torch.float32 and t.stride(-1) == 1 for t in tensors) and k_pool.dim() == 3
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
