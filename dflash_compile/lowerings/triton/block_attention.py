"""Triton kernel for ``dflash::block_attention``: paged flash attention of a query block.

One program handles one request ``b``, one KV head ``g`` and a tile of ``BLOCK_M`` query rows, where the rows
are the ``G = Hq // Hkv`` query heads sharing ``g`` times the ``T`` block queries (row ``r`` is head
``g * G + r // T``, query ``r % T``), so every gathered K/V tile serves the whole GQA group. The context is
walked in tiles of ``BLOCK_N`` positions whose K/V rows are gathered from the pools through the block table;
then the ``T`` block keys. Softmax is online (running max and sum in fp32). Keys that no row of the tile may
see are never loaded, so garbage (even NaN) in the pool at masked slots cannot reach the output.

The launcher depends on shapes only (context lengths are read by the kernel, bounded by the static
``block_table.shape[1] * page_size``) and launches through ``torch.library.wrap_triton``, so tracing
:func:`block_attention` with make_fx records a ``triton_kernel_wrapper_mutation`` node that Inductor compiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

_LOG2E = 1.4426950408889634


@triton.jit
def _online_update(acc, m_i, l_i, q, k, v, visible, qk_scale, DOT_PRECISION: tl.constexpr):
    # q [M, D] fp32, k/v [N, D] fp32 (zero where no row sees the key), visible [M, N]
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # log2-scaled scores
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # m_i starts finite, so m_new is never -inf
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])  # exactly 0 where masked
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["window"])
def _kernel(
    q_ptr, k_pool_ptr, v_pool_ptr, block_table_ptr, ctx_lens_ptr, q_pos_ptr, k_blk_ptr, v_blk_ptr, out_ptr,
    sq_b, sq_h, sq_t, sq_d,
    skp_s, skp_h, skp_d,
    svp_s, svp_h, svp_d,
    sbt_b, sbt_n,
    sqp_b, sqp_t,
    skb_b, skb_h, skb_t, skb_d,
    svb_b, svb_h, svb_t, svb_d,
    so_b, so_h, so_t, so_d,
    T, D, G, max_ctx, page_size, window, qk_scale,
    CAUSAL: tl.constexpr,
    HAS_BLOCK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # [M]
    row_ok = rows < G * T
    head = g * G + rows // T
    qi = rows % T  # query index inside the block
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D

    q_off = b * sq_b + head[:, None] * sq_h + qi[:, None] * sq_t + d[None, :] * sq_d
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # [M, D]
    P = tl.load(q_pos_ptr + b * sqp_b + qi * sqp_t, mask=row_ok, other=0).to(tl.int64)  # [M]

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    # Context keys: only the range some row of the tile can see is walked.
    ctx_len = tl.minimum(tl.load(ctx_lens_ptr + b).to(tl.int64), max_ctx)
    hi = ctx_len
    if CAUSAL:
        hi = tl.minimum(hi, tl.max(tl.where(row_ok, P, -1), 0) + 1)
    lo = tl.min(tl.where(row_ok, P, 1 << 62), 0) - window + 1
    lo = tl.where(window > 0, tl.maximum(lo, 0), 0)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N).to(tl.int64)  # [N]
        in_ctx = pos < ctx_len
        visible = row_ok[:, None] & in_ctx[None, :]
        if CAUSAL:
            visible &= pos[None, :] <= P[:, None]
        visible &= (window == 0) | (P[:, None] - pos[None, :] < window)
        needed = tl.max(visible.to(tl.int32), 0) > 0  # [N] some row sees the key: load it
        page = tl.load(block_table_ptr + b * sbt_b + (pos // page_size) * sbt_n, mask=needed, other=0)
        slot = page.to(tl.int64) * page_size + pos % page_size
        kv_mask = needed[:, None] & d_ok[None, :]
        k = tl.load(k_pool_ptr + slot[:, None] * skp_s + g * skp_h + d[None, :] * skp_d, mask=kv_mask, other=0.0)
        v = tl.load(v_pool_ptr + slot[:, None] * svp_s + g * svp_h + d[None, :] * svp_d, mask=kv_mask, other=0.0)
        acc, m_i, l_i = _online_update(
            acc, m_i, l_i, q, k.to(tl.float32), v.to(tl.float32), visible, qk_scale, DOT_PRECISION
        )

    # Block keys: key j sits at position q_positions[b, j]; causality is by index inside the block.
    if HAS_BLOCK:
        for start in range(0, T, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)  # [N]
            j_ok = j < T
            Pj = tl.load(q_pos_ptr + b * sqp_b + j * sqp_t, mask=j_ok, other=0).to(tl.int64)
            visible = row_ok[:, None] & j_ok[None, :]
            if CAUSAL:
                visible &= j[None, :] <= qi[:, None]
            visible &= (window == 0) | (P[:, None] - Pj[None, :] < window)
            needed = tl.max(visible.to(tl.int32), 0) > 0
            kv_mask = needed[:, None] & d_ok[None, :]
            k = tl.load(
                k_blk_ptr + b * skb_b + g * skb_h + j[:, None] * skb_t + d[None, :] * skb_d, mask=kv_mask, other=0.0
            )
            v = tl.load(
                v_blk_ptr + b * svb_b + g * svb_h + j[:, None] * svb_t + d[None, :] * svb_d, mask=kv_mask, other=0.0
            )
            acc, m_i, l_i = _online_update(
                acc, m_i, l_i, q, k.to(tl.float32), v.to(tl.float32), visible, qk_scale, DOT_PRECISION
            )

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row that saw nothing keeps acc == 0
    o_off = b * so_b + head[:, None] * so_h + qi[:, None] * so_t + d[None, :] * so_d
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _launch(
    q, k_pool, v_pool, block_table, ctx_lens, q_positions, k_block, v_block, page_size, causal, window, scale,
    block_m=None, block_n=None,
):
    B, Hq, T, D = q.shape
    Hkv = k_pool.shape[-2]
    assert Hq % Hkv == 0, f"Hq={Hq} is not a multiple of Hkv={Hkv}"
    G = Hq // Hkv
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    # tl.dot needs every tile dimension >= 16.
    block_m = block_m or max(16, min(64, triton.next_power_of_2(G * T)))
    block_n = block_n or (32 if D > 64 else 64)
    block_d = max(16, triton.next_power_of_2(D))
    has_block = k_block is not None
    kb, vb = (k_block, v_block) if has_block else (q, q)  # placeholders: never read when HAS_BLOCK is False
    kb_strides = (kb.stride(0), kb.stride(1), kb.stride(2), kb.stride(3))
    vb_strides = (vb.stride(0), vb.stride(1), vb.stride(2), vb.stride(3))
    grid = (B, Hkv, triton.cdiv(G * T, block_m))
    wrap_triton(_kernel)[grid](
        q, k_pool, v_pool, block_table, ctx_lens, q_positions, kb, vb, out,
        *q.stride(),
        *k_pool.stride(),
        *v_pool.stride(),
        *block_table.stride(),
        *q_positions.stride(),
        *kb_strides,
        *vb_strides,
        *out.stride(),
        T, D, G, block_table.shape[1] * page_size, page_size, window, scale * _LOG2E,
        CAUSAL=bool(causal),
        HAS_BLOCK=has_block,
        # fp32 inputs need exact fp32 products; fp16/bf16 values upcast to fp32 are exact in tf32.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        num_warps=4,
    )
    return out


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
    """Triton implementation of :func:`dflash_compile.lowerings.ops.block_attention` (same contract)."""
    return _launch(
        q, k_pool, v_pool, block_table, ctx_lens, q_positions, k_block, v_block, page_size, causal, window, scale
    )
