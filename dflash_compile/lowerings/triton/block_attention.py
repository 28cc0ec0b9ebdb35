"""Triton kernels for ``dflash::block_attention``: paged flash attention of a query block, split over the context.

One program handles one request ``b``, one KV head ``g``, a tile of ``BLOCK_M`` query rows and one split of the
context. The rows are the ``G = Hq // Hkv`` query heads sharing ``g`` times the ``T`` block queries (row ``r``
is head ``g * G + r // T``, query ``r % T``), so every gathered K/V tile serves the whole GQA group. The
program walks its context chunk in tiles of ``BLOCK_N`` positions gathered through the block table, then (the
last split only) the ``T`` block keys. Softmax is online (running max and sum in fp32). Keys that no row of the
tile may see are never loaded, so garbage (even NaN) at masked pool slots cannot reach the output.

Precision. fp16/bf16: both dots take the native dtype with fp32 accumulation (``p`` is rounded to ``v``'s dtype
before the PV dot, as FlashAttention does); no upcast, so the tiles fit in registers on sm_90 (the previous fp32
upcast + tf32 dots hit 255 registers and spilled). fp32: exact ``ieee`` dots (tf32 would break the fp32
tolerance), with 16x16 tiles and 8 warps so the unrolled FMAs do not spill, up to D=128; fp32 with a larger
head dim (still spilling at 16x16), fp64 and head dims above
:data:`MAX_HEAD_DIM` (which would need more than the 227 KB of shared memory of an H100) are not run by a
kernel: they go to the eager reference, which is exact. Under the interpreter (CPU tests) bf16 operands are
upcast to fp32 before ``tl.dot``, since the interpreter's bf16 dot is wrong.

Flash decoding. When few programs would run (``B * Hkv * m_tiles`` small against the 132 SMs of an H100) and
the context span is long, the launcher splits the context into ``num_splits`` chunks: each program writes its
normalised partial output and log2-sum-exp in fp32 to a workspace and :func:`_combine_kernel` merges them.
Block keys are handled by the last split only. Every choice is made by :func:`plan` from static shapes.

Launchers read no tensor value (context lengths are read by the kernel, bounded by the static
``block_table.shape[1] * page_size``) and launch through ``torch.library.wrap_triton``, so tracing
:func:`block_attention` with make_fx records ``triton_kernel_wrapper_mutation`` nodes that Inductor compiles.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

_LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256  # D in 257..512 needs > 227 KB of shared memory on sm_90
NUM_SMS = 132  # H100 SXM; the split heuristic only needs the order of magnitude
_MIN_SPLIT_SPAN = 256  # context positions per split, at least
_MAX_SPLITS = 32


@dataclass(frozen=True)
class Plan:
    """What :func:`_launch` runs for given static shapes (``reference`` set: the eager reference, with why)."""

    reference: str | None = None
    block_m: int = 0
    block_n: int = 0
    block_d: int = 0
    num_warps: int = 4
    num_splits: int = 1
    split_span: int = 0  # context positions per split
    dot: str = ""  # "native" (fp16/bf16 dots, fp32 accumulation) or "ieee" (exact fp32)

    def describe(self) -> str:
        if self.reference:
            return f"reference ({self.reference})"
        split = f"split {self.num_splits} x {self.split_span} pos + combine" if self.num_splits > 1 else "no split"
        return (
            f"triton BLOCK_M={self.block_m} BLOCK_N={self.block_n} BLOCK_D={self.block_d} "
            f"warps={self.num_warps} dot={self.dot} {split}"
        )


def _check_block(name, value, max_value):
    if not isinstance(value, int) or value < 16 or value > max_value or value & (value - 1):
        raise ValueError(f"block_attention: {name}={value!r} must be a power of two in [16, {max_value}]")


def plan(B, Hq, Hkv, T, D, dtype, max_ctx, has_block=True, block_m=None, block_n=None, num_splits=None) -> Plan:
    """Pure-Python launch plan from static shapes: tiles, warps, and the flash-decoding split of the context."""
    if dtype == torch.float64:
        return Plan(reference="fp64 runs exactly in the eager reference")
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return Plan(reference=f"no kernel for {dtype}")
    if D > MAX_HEAD_DIM:
        return Plan(reference=f"head dim {D} > {MAX_HEAD_DIM} does not fit in sm_90 shared memory")
    if Hkv <= 0 or Hq % Hkv:
        raise ValueError(f"block_attention: Hq={Hq} is not a multiple of Hkv={Hkv}")
    G = Hq // Hkv
    block_d = max(16, triton.next_power_of_2(D))
    exact = dtype == torch.float32
    if exact and block_d > 128:
        return Plan(reference=f"exact fp32 dots at head dim {D} spill registers on sm_90")
    # Defaults measured with ptxas for sm_90a (tests/lowerings/test_triton_sm90.py): the gathered K/V tiles carry
    # one 64-bit address per element, so tiles stay small; BLOCK_M=64 spills at every head dim.
    default_n, num_warps = (16, 8) if exact else {64: (32, 4), 128: (32, 8)}.get(max(block_d, 64), (16, 8))
    block_m = 16 if block_m is None else block_m
    block_n = default_n if block_n is None else block_n
    _check_block("block_m", block_m, 128)
    _check_block("block_n", block_n, 128)
    if (block_m + 2 * block_n) * block_d * (4 if exact else 2) > 96 * 1024:
        raise ValueError(f"block_attention: tiles {block_m}x{block_n}x{block_d} are too large for one program")
    programs = B * Hkv * triton.cdiv(G * T, block_m)
    if num_splits is None:
        num_splits = 1
        if programs < NUM_SMS and max_ctx >= 2 * _MIN_SPLIT_SPAN:
            num_splits = min(_MAX_SPLITS, triton.cdiv(2 * NUM_SMS, programs), max_ctx // _MIN_SPLIT_SPAN)
    elif not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"block_attention: num_splits={num_splits!r} must be a positive int")
    num_splits = max(1, min(num_splits, triton.cdiv(max(max_ctx, 1), block_n)))
    span = triton.cdiv(triton.cdiv(max(max_ctx, 1), num_splits), block_n) * block_n
    num_splits = triton.cdiv(max(max_ctx, 1), span)
    return Plan(None, block_m, block_n, block_d, num_warps, num_splits, span, "ieee" if exact else "native")


@triton.jit
def _online_update(acc, m_i, l_i, q, k, v, visible, qk_scale, DOT_PRECISION: tl.constexpr):
    # q [M, D], k/v [N, D] in the input dtype (zero where no row sees the key), visible [M, N]; fp32 accumulation
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # log2-scaled scores, fp32
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # m_i starts finite, so m_new is never -inf
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])  # exactly 0 where masked
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["window", "chunk"])
def _kernel(
    q_ptr, k_pool_ptr, v_pool_ptr, block_table_ptr, ctx_lens_ptr, q_pos_ptr, k_blk_ptr, v_blk_ptr, out_ptr,
    ws_o_ptr, ws_l_ptr,
    sq_b, sq_h, sq_t, sq_d,
    skp_s, skp_h, skp_d,
    svp_s, svp_h, svp_d,
    sbt_b, sbt_n,
    sctx,
    sqp_b, sqp_t,
    skb_b, skb_h, skb_t, skb_d,
    svb_b, svb_h, svb_t, svb_d,
    so_b, so_h, so_t, so_d,
    T, D, G, max_ctx, window, chunk, qk_scale, split_span, m_tiles,
    PAGE_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_BLOCK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    pid2 = tl.program_id(2)
    split = pid2 // m_tiles
    rows = (pid2 % m_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)  # [M]
    row_ok = rows < G * T
    head = g * G + rows // T
    qi = rows % T  # query index inside the block
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D

    q_off = b * sq_b + head[:, None] * sq_h + qi[:, None] * sq_t + d[None, :] * sq_d
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [M, D]
    if UPCAST:
        q = q.to(tl.float32)
    P = tl.load(q_pos_ptr + b * sqp_b + qi * sqp_t, mask=row_ok, other=0).to(tl.int64)  # [M]

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    # Context keys of this split: only the range some row of the tile can see is walked.
    ctx_len = tl.minimum(tl.load(ctx_lens_ptr + b * sctx).to(tl.int64), max_ctx)
    hi = ctx_len
    if CAUSAL:
        hi = tl.minimum(hi, tl.max(tl.where(row_ok, P, -1), 0) + 1)
    lo = tl.min(tl.where(row_ok, P, 1 << 62), 0) - window + 1
    lo = tl.where(window > 0, tl.maximum(lo, 0), 0)
    if NUM_SPLITS > 1:
        lo = tl.maximum(lo, split.to(tl.int64) * split_span)
        hi = tl.minimum(hi, (split + 1).to(tl.int64) * split_span)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N).to(tl.int64)  # [N]
        in_ctx = pos < hi
        visible = row_ok[:, None] & in_ctx[None, :]
        if CAUSAL:
            visible &= pos[None, :] <= P[:, None]
        visible &= (window == 0) | (P[:, None] - pos[None, :] < window)
        visible &= (chunk == 0) | (pos[None, :] // tl.maximum(chunk, 1) == P[:, None] // tl.maximum(chunk, 1))
        needed = tl.max(visible.to(tl.int32), 0) > 0  # [N] some row sees the key: load it
        page = tl.load(block_table_ptr + b * sbt_b + (pos // PAGE_SIZE) * sbt_n, mask=needed, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE
        kv_mask = needed[:, None] & d_ok[None, :]
        k = tl.load(k_pool_ptr + slot[:, None] * skp_s + g * skp_h + d[None, :] * skp_d, mask=kv_mask, other=0.0)
        v = tl.load(v_pool_ptr + slot[:, None] * svp_s + g * svp_h + d[None, :] * svp_d, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        acc, m_i, l_i = _online_update(acc, m_i, l_i, q, k, v, visible, qk_scale, DOT_PRECISION)

    # Block keys (last split only): key j sits at position q_positions[b, j]; causality is by index in the block.
    if HAS_BLOCK:
        if split == NUM_SPLITS - 1:
            for j0 in range(0, T, BLOCK_N):
                j = j0 + tl.arange(0, BLOCK_N)  # [N]
                j_ok = j < T
                Pj = tl.load(q_pos_ptr + b * sqp_b + j * sqp_t, mask=j_ok, other=0).to(tl.int64)
                visible = row_ok[:, None] & j_ok[None, :]
                if CAUSAL:
                    visible &= j[None, :] <= qi[:, None]
                visible &= (window == 0) | (P[:, None] - Pj[None, :] < window)
                visible &= (chunk == 0) | (Pj[None, :] // tl.maximum(chunk, 1) == P[:, None] // tl.maximum(chunk, 1))
                needed = tl.max(visible.to(tl.int32), 0) > 0
                kv_mask = needed[:, None] & d_ok[None, :]
                k_off = b * skb_b + g * skb_h + j[:, None] * skb_t + d[None, :] * skb_d
                v_off = b * svb_b + g * svb_h + j[:, None] * svb_t + d[None, :] * svb_d
                k = tl.load(k_blk_ptr + k_off, mask=kv_mask, other=0.0)
                v = tl.load(v_blk_ptr + v_off, mask=kv_mask, other=0.0)
                if UPCAST:
                    k = k.to(tl.float32)
                    v = v.to(tl.float32)
                acc, m_i, l_i = _online_update(acc, m_i, l_i, q, k, v, visible, qk_scale, DOT_PRECISION)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row that saw nothing keeps acc == 0
    o_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS > 1:
        # workspace [B, Hq, T, NUM_SPLITS, BLOCK_D] fp32 and its log2-sum-exp [B, Hq, T, NUM_SPLITS]
        r = ((b * G * tl.num_programs(1) + head) * T + qi) * NUM_SPLITS + split  # [M]
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(ws_o_ptr + r[:, None] * BLOCK_D + d[None, :], out, mask=o_mask)
        tl.store(ws_l_ptr + r, lse, mask=row_ok)
    else:
        o_off = b * so_b + head[:, None] * so_h + qi[:, None] * so_t + d[None, :] * so_d
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _combine_kernel(
    ws_o_ptr, ws_l_ptr, out_ptr,
    so_b, so_h, so_t, so_d,
    Hq, T, D,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per output row (b, h, t): merge the splits' partial outputs by their log2-sum-exp."""
    row = tl.program_id(0).to(tl.int64)  # (b * Hq + h) * T + t
    t = row % T
    h = (row // T) % Hq
    b = row // (T * Hq)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    lse = tl.load(ws_l_ptr + row * NUM_SPLITS + s, mask=s_ok, other=float("-inf"))  # [S]
    m = tl.max(lse, 0)
    w = tl.where(lse > float("-inf"), tl.exp2(lse - tl.where(m > float("-inf"), m, 0.0)), 0.0)  # [S]
    parts = tl.load(
        ws_o_ptr + (row * NUM_SPLITS + s[:, None]) * BLOCK_D + d[None, :], mask=(w > 0)[:, None] & d_ok[None, :],
        other=0.0,
    )  # [S, D]; splits that saw nothing are never read
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * so_b + h * so_h + t * so_t + d * so_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _launch(
    q, k_pool, v_pool, block_table, ctx_lens, q_positions, k_block, v_block, page_size, causal, window, scale,
    block_m=None, block_n=None, num_splits=None, chunk=0,
):
    B, Hq, T, D = q.shape
    Hkv = k_pool.shape[-2]
    has_block = k_block is not None
    max_ctx = block_table.shape[1] * page_size
    p = plan(B, Hq, Hkv, T, D, q.dtype, max_ctx, has_block, block_m, block_n, num_splits)
    if p.reference:
        from ..ops import _block_attention_reference

        return _block_attention_reference(
            q, k_pool, v_pool, block_table, ctx_lens, q_positions, k_block, v_block, page_size, causal, window, scale,
            chunk
        )
    G = Hq // Hkv
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    kb, vb = (k_block, v_block) if has_block else (q, q)  # placeholders: never read when HAS_BLOCK is False
    kb_strides = (kb.stride(0), kb.stride(1), kb.stride(2), kb.stride(3))
    vb_strides = (vb.stride(0), vb.stride(1), vb.stride(2), vb.stride(3))
    m_tiles = triton.cdiv(G * T, p.block_m)
    S = p.num_splits
    if S > 1:
        ws_o = torch.empty((B, Hq, T, S, p.block_d), dtype=torch.float32, device=q.device)
        ws_l = torch.empty((B, Hq, T, S), dtype=torch.float32, device=q.device)
    else:
        ws_o = ws_l = out  # never touched when NUM_SPLITS == 1
    upcast = q.dtype == torch.bfloat16 and _interpreted()  # the interpreter's bf16 dot is wrong
    wrap_triton(_kernel)[(B, Hkv, m_tiles * S)](
        q, k_pool, v_pool, block_table, ctx_lens, q_positions, kb, vb, out, ws_o, ws_l,
        *q.stride(),
        *k_pool.stride(),
        *v_pool.stride(),
        *block_table.stride(),
        ctx_lens.stride(0),
        *q_positions.stride(),
        *kb_strides,
        *vb_strides,
        *out.stride(),
        T, D, G, max_ctx, window, chunk, scale * _LOG2E, p.split_span, m_tiles,
        PAGE_SIZE=page_size,
        CAUSAL=bool(causal),
        HAS_BLOCK=has_block,
        DOT_PRECISION="ieee" if p.dot == "ieee" or upcast else "tf32",  # tf32 is ignored for fp16/bf16 operands
        UPCAST=upcast,
        NUM_SPLITS=S,
        BLOCK_M=p.block_m,
        BLOCK_N=p.block_n,
        BLOCK_D=p.block_d,
        num_warps=p.num_warps,
    )
    if S > 1:
        wrap_triton(_combine_kernel)[(B * Hq * T,)](
            ws_o, ws_l, out,
            *out.stride(),
            Hq, T, D,
            NUM_SPLITS=S,
            BLOCK_S=max(2, triton.next_power_of_2(S)),
            BLOCK_D=p.block_d,
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
    chunk: int = 0,
) -> Tensor:
    """Triton implementation of :func:`dflash_compile.lowerings.ops.block_attention` (same contract).

    fp64 inputs and head dims above :data:`MAX_HEAD_DIM` run the eager reference (exact); see :func:`plan`.
    """
    return _launch(
        q, k_pool, v_pool, block_table, ctx_lens, q_positions, k_block, v_block, page_size, causal, window, scale,
        chunk=chunk,
    )
