"""NKI kernel for ``dflash::block_attention``: a query block attending to its paged context and its own keys.

For each batch row and KV head, the query rows of the heads sharing that KV head (GQA) are stacked on
partitions (``r = g * T + i``, whole groups per chunk of <= 128 rows). The context is walked in tiles of up
to 128 key positions that never straddle a page: the page ids are gathered from the block table by indirect
DMA, turned into slots, and the K/V rows gathered from the pool by a second indirect DMA (out-of-range slots
are skipped and read as zeros). Scores come from ``nc_matmul`` into fp32 PSUM, then an online softmax keeps
a running max, sum and output per query row. The block's own keys, if given, are one more tile.

Masking: invisible scores are replaced (not multiplied) by a large negative number, so a NaN in a masked key
cannot leak in; values of keys that no query row of the chunk sees are zeroed the same way. With ``T <= 128``
a chunk holds all ``T`` queries of its heads, so this is exactly the reference's ``mask.any(queries)`` rule
(with ``T > 128`` it is per chunk, which only differs when a key some query sees holds NaN). A row that sees
no key ends with sum 0 and output 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...primitives.slots import pages
from . import _runtime

nl = nisa = None  # bound by _kernel(): importing this module never needs the Neuron SDK

_NEG = -3.0e38  # masked score: exp(_NEG - m) == 0 for every running max m >= _M_INIT
_M_INIT = -1.0e30  # initial running max: finite, so a fully masked tile gives exp(_NEG - _M_INIT) == 0, not NaN


def _restrict(vis, dist, op, bound):
    """``vis *= (dist <op> bound)``: one more visibility condition on a [rows, keys] 0/1 tile."""
    nisa.scalar_tensor_tensor(dst=vis, data=dist, op0=op, operand0=bound, op1=nl.multiply, operand1=vis)


def _attend(q_t, k_rows, v_rows, vis, n, R, state, scale, mm_dtype, zeros):
    """Fold ``n`` keys into the running softmax of ``R`` query rows.

    ``q_t``: the queries transposed, per 128-wide head-dim chunk ``[dc, R]``; ``k_rows [n, D]`` (``mm_dtype``) and
    ``v_rows [n, D]`` (fp32) one key per partition; ``vis [R, n]`` 0/1 fp32; ``state = (m, l, acc)``.
    """
    m_run, l_run, acc = state
    D = v_rows.shape[1]
    scores = nl.ndarray((R, n), dtype=nl.float32, buffer=nl.psum)
    P = nl.tile_size.pmax
    for c in range(len(q_t)):
        d0 = c * P
        d1 = min(D, d0 + P)
        k_t_ps = nl.ndarray((d1 - d0, n), dtype=mm_dtype, buffer=nl.psum)
        nisa.nc_transpose(dst=k_t_ps, data=k_rows[:, d0:d1])
        k_t = nl.ndarray((d1 - d0, n), dtype=mm_dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=k_t, src=k_t_ps)
        nisa.nc_matmul(dst=scores, stationary=q_t[c], moving=k_t, accumulate=c > 0)

    keep = nl.ndarray((R, n), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.tensor_copy(dst=keep, src=vis)
    scaled = nl.ndarray((R, n), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=scaled, data=scores, op0=nl.multiply, operand0=scale)
    masked = nl.ndarray((R, n), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=masked, value=_NEG)
    nisa.tensor_copy_predicated(dst=masked, src=scaled, predicate=keep)

    # keys no row sees: zero their values (0 * NaN would otherwise poison every row)
    vis_t = nl.ndarray((n, R), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_transpose(dst=vis_t, data=vis)
    seen = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=seen, op=nl.maximum, data=vis_t, axis=1, keepdims=True)
    v_keep = nl.ndarray((n, D), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=v_keep, data=zeros[0:n, :], op0=nl.add, operand0=seen)
    values = nl.ndarray((n, D), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=values, value=0.0)
    nisa.tensor_copy_predicated(dst=values, src=v_rows, predicate=v_keep)

    # online softmax: m' = max(m, rowmax), l' = l * exp(m - m') + sum(p), acc' = acc * exp(m - m') + p @ v
    tile_max = nl.ndarray((R, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=tile_max, op=nl.maximum, data=masked, axis=1, keepdims=True)
    m_new = nl.ndarray((R, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=m_new, data1=m_run, data2=tile_max, op=nl.maximum)
    neg_m = nl.ndarray((R, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=neg_m, data=m_new, op0=nl.multiply, operand0=-1.0)
    probs = nl.ndarray((R, n), dtype=nl.float32, buffer=nl.sbuf)
    probs_sum = nl.ndarray((R, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=probs, op=nl.exp, data=masked, bias=neg_m, scale=1.0, reduce_op=nl.add,
                    reduce_res=probs_sum, reduce_cmd=nisa.reduce_cmd.reset_reduce)
    corr = nl.ndarray((R, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=corr, op=nl.exp, data=m_run, bias=neg_m, scale=1.0)
    nisa.tensor_scalar(dst=l_run, data=l_run, op0=nl.multiply, operand0=corr, op1=nl.add, operand1=probs_sum)

    probs_t_ps = nl.ndarray((n, R), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_transpose(dst=probs_t_ps, data=probs)
    probs_t = nl.ndarray((n, R), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=probs_t, src=probs_t_ps)
    pv = nl.ndarray((R, D), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=pv, stationary=probs_t, moving=values, accumulate=False)
    nisa.scalar_tensor_tensor(dst=acc, data=acc, op0=nl.multiply, operand0=corr, op1=nl.add, operand1=pv)
    nisa.tensor_copy(dst=m_run, src=m_new)


def _block_attention_kernel(q, k_pool, v_pool, block_table, ctx_lens, q_positions, q_index, pos_table, k_block,
                            v_block, page_size, causal, window, scale):
    """``q [B, Hq, T, D]``; ``k_pool``/``v_pool [num_slots, Hkv * D]``; ``block_table [B * NB, 1]`` int32
    (invalid pages: one past the pool); ``ctx_lens [B, 1]``, ``q_positions [B, T]``, ``q_index [T]`` (= arange) int32;
    ``pos_table [KT, 2]`` int32 = ``(i // page_size, i % page_size)`` for the KT keys of a context tile;
    ``k_block``/``v_block [B, Hkv, T, D]`` or None. Returns ``[B, Hq, T, D]`` in ``q.dtype``."""
    B, Hq, T, D = q.shape
    Hkv = k_pool.shape[1] // D
    G = Hq // Hkv
    NB = block_table.shape[0] // B
    KT = pos_table.shape[0]
    S = NB * page_size
    P = nl.tile_size.pmax
    has_block = k_block is not None
    same = q.dtype == k_pool.dtype and (not has_block or k_block.dtype == q.dtype)
    mm_dtype = q.dtype if same else nl.float32  # a float32 matmul operand needs a float32 partner
    out = nl.ndarray((B, Hq, T, D), dtype=q.dtype, buffer=nl.shared_hbm)

    # Query-row chunks: with T <= 128, ``per`` whole groups of T queries each; else one group's queries in
    # chunks of 128 (``t_chunks`` per group). Chunk ``rc`` covers groups [g0, g0 + gcnt), queries [i0, i0 + icnt).
    per = max(1, P // T)
    t_chunks = (T + P - 1) // P
    if T <= P:
        n_row_chunks = (G + per - 1) // per
        rows_max = min(per, G) * T
    else:
        n_row_chunks = G * t_chunks
        rows_max = P
    n_d_chunks = (D + P - 1) // P
    n_ctx_tiles = (S + KT - 1) // KT
    n_block_tiles = t_chunks if has_block else 0

    pos_sb = nl.ndarray((KT, 2), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=pos_sb, src=pos_table)
    page_size_sb = nl.ndarray((KT, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.memset(dst=page_size_sb, value=page_size)
    zeros = nl.ndarray((P, D), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=zeros, value=0.0)

    for b in range(B):
        # slots of row b's context tiles (shared by every KV head and query chunk):
        # slot(p) = block_table[b, p // page_size] * page_size + p % page_size
        slots = []
        for ti in range(n_ctx_tiles):
            t0 = ti * KT
            kt = min(KT, S - t0)
            page = nl.ndarray((kt, 1), dtype=nl.int32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=page, data=pos_sb[0:kt, 0:1], op0=nl.add, operand0=float(b * NB + t0 // page_size))
            page_id = nl.ndarray((kt, 1), dtype=nl.int32, buffer=nl.sbuf)
            nisa.dma_copy(dst=page_id, src=block_table.ap(pattern=[[1, kt], [1, 1]], offset=0, vector_offset=page,
                                                          indirect_dim=0))
            in_page = nl.ndarray((kt, 1), dtype=nl.int32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=in_page, data=pos_sb[0:kt, 1:2], op0=nl.add, operand0=float(t0 % page_size))
            slot = nl.ndarray((kt, 1), dtype=nl.int32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=slot, data1=page_id, data2=page_size_sb[0:kt, :], op=nl.multiply)
            nisa.tensor_tensor(dst=slot, data1=slot, data2=in_page, op=nl.add)
            slots.append(slot)
        ctx_len = nl.ndarray((rows_max, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=ctx_len, src=ctx_lens[b:b + 1, :].broadcast(0, rows_max))

        for kvh in range(Hkv):
            for rc in range(n_row_chunks):
                if T <= P:
                    g0 = rc * per
                    gcnt = min(per, G - g0)
                    i0 = 0
                    icnt = T
                else:
                    g0, ic = divmod(rc, t_chunks)
                    gcnt = 1
                    i0 = ic * P
                    icnt = min(P, T - i0)
                R = gcnt * icnt
                q_pos = nl.ndarray((R, 1), dtype=nl.float32, buffer=nl.sbuf)
                q_idx = nl.ndarray((R, 1), dtype=nl.float32, buffer=nl.sbuf) if has_block and causal else None
                q_rows = nl.ndarray((R, D), dtype=mm_dtype, buffer=nl.sbuf)
                for gg in range(gcnt):
                    r0 = gg * icnt
                    nisa.dma_copy(dst=q_pos[r0:r0 + icnt, :], src=q_positions[b, i0:i0 + icnt])
                    if q_idx is not None:
                        nisa.dma_copy(dst=q_idx[r0:r0 + icnt, :], src=q_index[i0:i0 + icnt])
                    nisa.dma_copy(dst=q_rows[r0:r0 + icnt, :], src=q[b, kvh * G + g0 + gg, i0:i0 + icnt, :])
                q_t = []
                for dc in range(n_d_chunks):
                    d0 = dc * P
                    d1 = min(D, d0 + P)
                    q_t_ps = nl.ndarray((d1 - d0, R), dtype=mm_dtype, buffer=nl.psum)
                    nisa.nc_transpose(dst=q_t_ps, data=q_rows[:, d0:d1])
                    q_t_sb = nl.ndarray((d1 - d0, R), dtype=mm_dtype, buffer=nl.sbuf)
                    nisa.tensor_copy(dst=q_t_sb, src=q_t_ps)
                    q_t.append(q_t_sb)
                m_run = nl.ndarray((R, 1), dtype=nl.float32, buffer=nl.sbuf)
                nisa.memset(dst=m_run, value=_M_INIT)
                l_run = nl.ndarray((R, 1), dtype=nl.float32, buffer=nl.sbuf)
                nisa.memset(dst=l_run, value=0.0)
                acc = nl.ndarray((R, D), dtype=nl.float32, buffer=nl.sbuf)
                nisa.memset(dst=acc, value=0.0)
                state = (m_run, l_run, acc)

                for ti in range(n_ctx_tiles):
                    t0 = ti * KT
                    kt = min(KT, S - t0)
                    slot = slots[ti]
                    k_rows = nl.ndarray((kt, D), dtype=mm_dtype, buffer=nl.sbuf)
                    nisa.memset(dst=k_rows, value=0.0)
                    nisa.dma_copy(dst=k_rows, src=k_pool.ap(pattern=[[Hkv * D, kt], [1, D]], offset=kvh * D,
                                                            vector_offset=slot, indirect_dim=0),
                                  oob_mode=nisa.oob_mode.skip)
                    v_rows = nl.ndarray((kt, D), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.memset(dst=v_rows, value=0.0)
                    nisa.dma_copy(dst=v_rows, src=v_pool.ap(pattern=[[Hkv * D, kt], [1, D]], offset=kvh * D,
                                                            vector_offset=slot, indirect_dim=0),
                                  oob_mode=nisa.oob_mode.skip)
                    key_pos = nl.ndarray((R, kt), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.iota(dst=key_pos, pattern=[[1, kt]], offset=t0, channel_multiplier=0)
                    vis = nl.ndarray((R, kt), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.tensor_scalar(dst=vis, data=key_pos, op0=nl.less, operand0=ctx_len[0:R, :])  # p < ctx_len
                    if causal or window:
                        dist = nl.ndarray((R, kt), dtype=nl.float32, buffer=nl.sbuf)  # P - p
                        nisa.tensor_scalar(dst=dist, data=key_pos, op0=nl.subtract, operand0=q_pos, reverse0=True)
                        if causal:
                            _restrict(vis, dist, nl.greater_equal, 0.0)
                        if window:
                            _restrict(vis, dist, nl.less, float(window))
                    _attend(q_t, k_rows, v_rows, vis, kt, R, state, scale, mm_dtype, zeros)

                for bi in range(n_block_tiles):
                    j0 = bi * P
                    jt = min(P, T - j0)
                    k_rows = nl.ndarray((jt, D), dtype=mm_dtype, buffer=nl.sbuf)
                    nisa.dma_copy(dst=k_rows, src=k_block[b, kvh, j0:j0 + jt, :])
                    v_rows = nl.ndarray((jt, D), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.dma_copy(dst=v_rows, src=v_block[b, kvh, j0:j0 + jt, :])
                    vis = nl.ndarray((R, jt), dtype=nl.float32, buffer=nl.sbuf)
                    if causal:  # j <= i
                        key_idx = nl.ndarray((R, jt), dtype=nl.float32, buffer=nl.sbuf)
                        nisa.iota(dst=key_idx, pattern=[[1, jt]], offset=j0, channel_multiplier=0)
                        nisa.tensor_scalar(dst=vis, data=key_idx, op0=nl.less_equal, operand0=q_idx)
                    else:
                        nisa.memset(dst=vis, value=1.0)
                    if window:  # P - q_positions[b, j] < window
                        key_pos = nl.ndarray((R, jt), dtype=nl.float32, buffer=nl.sbuf)
                        nisa.dma_copy(dst=key_pos, src=q_positions[b:b + 1, j0:j0 + jt].broadcast(0, R))
                        dist = nl.ndarray((R, jt), dtype=nl.float32, buffer=nl.sbuf)
                        nisa.tensor_scalar(dst=dist, data=key_pos, op0=nl.subtract, operand0=q_pos, reverse0=True)
                        _restrict(vis, dist, nl.less, float(window))
                    _attend(q_t, k_rows, v_rows, vis, jt, R, state, scale, mm_dtype, zeros)

                # out = acc / l; a row that saw nothing has acc == 0 and l == 0 (l >= 1 otherwise)
                l_safe = nl.ndarray((R, 1), dtype=nl.float32, buffer=nl.sbuf)
                nisa.tensor_scalar(dst=l_safe, data=l_run, op0=nl.maximum, operand0=1.0)
                inv_l = nl.ndarray((R, 1), dtype=nl.float32, buffer=nl.sbuf)
                nisa.reciprocal(dst=inv_l, data=l_safe)
                res = nl.ndarray((R, D), dtype=q.dtype, buffer=nl.sbuf)
                nisa.tensor_scalar(dst=res, data=acc, op0=nl.multiply, operand0=inv_l)
                for gg in range(gcnt):
                    nisa.dma_copy(dst=out[b, kvh * G + g0 + gg, i0:i0 + icnt, :],
                                  src=res[gg * icnt:(gg + 1) * icnt, :])
    return out


def _kernel():
    global nl, nisa
    nki, nl, nisa = _runtime.import_nki()
    return _runtime.jitted(nki, _block_attention_kernel)


def _context_tile(page_size: int) -> int:
    """Keys per context tile: <= 128, and a multiple or a divisor of ``page_size`` so tiles never straddle pages."""
    if page_size <= 128:
        return (128 // page_size) * page_size
    return max(d for d in range(1, 129) if page_size % d == 0)


def _launch(q, k_pool, v_pool, block_table, ctx_lens, q_positions, k_block, v_block, page_size, causal, window,
            scale):
    B, Hq, T, D = q.shape
    num_slots, Hkv, Dk = k_pool.shape
    if Dk != D or Hq % Hkv:
        raise ValueError(f"block_attention: q {tuple(q.shape)} does not match the pool {tuple(k_pool.shape)}")
    if D > 512:
        raise ValueError(f"block_attention: head_dim {D} > 512 does not fit one PSUM bank")
    if (k_block is None) != (v_block is None):
        raise ValueError("block_attention: pass both k_block and v_block, or neither")
    if q.numel() == 0:
        return torch.zeros_like(q)
    NB = block_table.shape[1]
    KT = _context_tile(page_size)
    num_pages = pages(num_slots, page_size)
    if (num_pages + 1) * page_size > 2**31:
        raise ValueError("block_attention: the pool is too large for the kernel's int32 slots")
    # Pages outside the pool (-1 padding included) become num_pages, one past the pool: their slots are
    # >= num_slots, out of bounds, and the K/V gathers skip them (no negative index reaches the DMA).
    bt = block_table.to(torch.int64)
    bt = torch.where((bt >= 0) & (bt < num_pages), bt, num_pages).to(torch.int32).reshape(B * NB, 1)
    i = torch.arange(KT, dtype=torch.int32, device=q.device)
    pos_table = torch.stack([i // page_size, i % page_size], dim=1)
    out = _runtime.launch(
        _kernel(),
        q.contiguous(),
        k_pool.reshape(num_slots, Hkv * D),
        v_pool.reshape(num_slots, Hkv * D),
        bt,
        ctx_lens.to(torch.int32).reshape(B, 1),
        q_positions.to(torch.int32).contiguous(),
        torch.arange(T, dtype=torch.int32, device=q.device),
        pos_table,
        None if k_block is None else k_block.contiguous(),
        None if v_block is None else v_block.contiguous(),
        int(page_size),
        bool(causal),
        int(window),
        float(scale),
    )
    return out.to(q.dtype)


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
    """Same contract as :func:`dflash_compile.lowerings.ops.block_attention`; chunked attention (``chunk``) is not
    in the NKI kernel yet and is refused with that reason."""
    if chunk:
        raise NotImplementedError(f"dflash::block_attention with chunk={chunk} (chunked attention) has no NKI kernel "
                                  f"yet; compile a chunked-attention target with backend='dflash'")
    return _launch(q, k_pool, v_pool, block_table, ctx_lens, q_positions, k_block, v_block, page_size, causal,
                   window, scale)
