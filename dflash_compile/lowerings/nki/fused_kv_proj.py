"""NKI kernel for ``dflash::fused_kv_proj``: one stacked K/V projection with an RMSNorm + RoPE epilogue on K.

Per tile of up to 128 context rows, ``ctx`` is transposed on the Tensor Engine so the hidden (contraction)
dim lies on partitions, then each group of whole heads (at most 512 output features, one fp32 PSUM bank) is
accumulated over 128-wide hidden chunks in PSUM. V heads are cast and stored; K heads are RMS-normed over
``D`` in fp32 (sum of squares on the Scalar Engine's reduce path), scaled by their layer's norm weight and
rotated (rotate-half RoPE) before the store.
"""

from __future__ import annotations

from torch import Tensor

from . import _runtime

nl = nisa = None  # bound by _kernel(): importing this module never needs the Neuron SDK


def _norm_rope(head, norm_w, cos_t, sin_t, eps_t, out, nt, D):
    """RMSNorm (fp32 statistics) + rotate-half RoPE of one K head ``head [nt, D]`` (PSUM), stored to ``out``."""
    half = D // 2
    x = nl.ndarray((nt, D), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=x, src=head)
    sq = nl.ndarray((nt, D), dtype=nl.float32, buffer=nl.sbuf)
    ssq = nl.ndarray((nt, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=sq, op=nl.square, data=x, reduce_op=nl.add, reduce_res=ssq,
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)
    rstd = nl.ndarray((nt, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=rstd, op=nl.rsqrt, data=ssq, scale=1.0 / D, bias=eps_t)  # 1 / sqrt(mean(x^2) + eps)
    xn = nl.ndarray((nt, D), dtype=nl.float32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=xn, data=x, op0=nl.multiply, operand0=rstd, op1=nl.multiply, operand1=norm_w)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[half:], x[:half])
    y = nl.ndarray((nt, D), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=y, data1=xn, data2=cos_t, op=nl.multiply)
    rot = nl.ndarray((nt, D), dtype=nl.float32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=rot[:, 0:D - half], data=xn[:, half:D], op0=nl.multiply, operand0=-1.0,
                              op1=nl.multiply, operand1=sin_t[:, 0:D - half])
    if half:
        nisa.tensor_tensor(dst=rot[:, D - half:D], data1=xn[:, 0:half], data2=sin_t[:, D - half:D], op=nl.multiply)
    res = nl.ndarray((nt, D), dtype=out.dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=res, data1=y, data2=rot, op=nl.add)
    nisa.dma_copy(dst=out, src=res)


def _fused_kv_proj_kernel(ctx, w_t, k_norm_weight, cos, sin, eps):
    """``ctx [N, H]``, ``w_t [H, 2 * L * Hkv * D]`` (the stacked weight, transposed), ``k_norm_weight [L, D]``,
    ``cos``/``sin [N, D]`` -> ``k, v [L, N, Hkv, D]`` in ``ctx.dtype``."""
    N, H = ctx.shape
    F = w_t.shape[1]
    L, D = k_norm_weight.shape
    Hkv = F // (2 * L * D)
    P = nl.tile_size.pmax
    # whole heads per matmul: moving free dim and one fp32 PSUM bank (512 on trn2; trn3 allows wider moving tiles)
    heads_per_tile = max(1, min(nl.tile_size.gemm_moving_fmax, nl.tile_size.psum_bank_fmax) // D)
    k_out = nl.ndarray((L, N, Hkv, D), dtype=ctx.dtype, buffer=nl.shared_hbm)
    v_out = nl.ndarray((L, N, Hkv, D), dtype=ctx.dtype, buffer=nl.shared_hbm)
    n_h_chunks = (H + P - 1) // P  # 128-wide chunks of the contraction (hidden) dim

    for n0 in range(0, N, P):
        nt = min(P, N - n0)
        # ctx rows transposed on the Tensor Engine: the contraction dim goes on partitions
        ctx_t = []
        for c in range(n_h_chunks):
            h0 = c * P
            h1 = min(H, h0 + P)
            rows = nl.ndarray((nt, h1 - h0), dtype=ctx.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=rows, src=ctx[n0:n0 + nt, h0:h1])
            rows_t_ps = nl.ndarray((h1 - h0, nt), dtype=ctx.dtype, buffer=nl.psum)
            nisa.nc_transpose(dst=rows_t_ps, data=rows)
            rows_t = nl.ndarray((h1 - h0, nt), dtype=ctx.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=rows_t, src=rows_t_ps)
            ctx_t.append(rows_t)
        cos_t = nl.ndarray((nt, D), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=cos_t, src=cos[n0:n0 + nt, :])
        sin_t = nl.ndarray((nt, D), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=sin_t, src=sin[n0:n0 + nt, :])
        eps_t = nl.ndarray((nt, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=eps_t, value=eps)
        norm_w = []
        for layer in range(L):  # the layer's norm weight, broadcast to every row (partition)
            w = nl.ndarray((nt, D), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=w, src=k_norm_weight[layer:layer + 1, :].broadcast(0, nt))
            norm_w.append(w)

        for kv in range(2):  # 0: K heads, 1: V heads
            is_v = kv == 1
            for hh0 in range(0, L * Hkv, heads_per_tile):
                nh = min(heads_per_tile, L * Hkv - hh0)
                f0 = ((L * Hkv if is_v else 0) + hh0) * D
                acc = nl.ndarray((nt, nh * D), dtype=nl.float32, buffer=nl.psum)
                for c in range(n_h_chunks):
                    h0 = c * P
                    h1 = min(H, h0 + P)
                    w_tile = nl.ndarray((h1 - h0, nh * D), dtype=w_t.dtype, buffer=nl.sbuf)
                    nisa.dma_copy(dst=w_tile, src=w_t[h0:h1, f0:f0 + nh * D])
                    nisa.nc_matmul(dst=acc, stationary=ctx_t[c], moving=w_tile, accumulate=c > 0)
                if is_v:
                    v_tile = nl.ndarray((nt, nh * D), dtype=ctx.dtype, buffer=nl.sbuf)
                    nisa.tensor_copy(dst=v_tile, src=acc)
                for j in range(nh):
                    layer, kvh = divmod(hh0 + j, Hkv)
                    if is_v:
                        nisa.dma_copy(dst=v_out[layer, n0:n0 + nt, kvh, :], src=v_tile[:, j * D:(j + 1) * D])
                    else:
                        _norm_rope(acc[:, j * D:(j + 1) * D], norm_w[layer], cos_t, sin_t, eps_t,
                                   k_out[layer, n0:n0 + nt, kvh, :], nt, D)
    return k_out, v_out


def _kernel():
    global nl, nisa
    nki, nl, nisa = _runtime.import_nki()
    return _runtime.jitted(nki, _fused_kv_proj_kernel)


def _launch(ctx, weight, k_norm_weight, cos, sin, eps):
    L, D = k_norm_weight.shape
    N = ctx.shape[0]
    if weight.shape[0] % (2 * L * D) or weight.shape[1] != ctx.shape[1]:
        raise ValueError(f"fused_kv_proj: weight {tuple(weight.shape)} is not [2 * L * Hkv * D, H] for L={L}, "
                         f"D={D}, H={ctx.shape[1]}")
    if D > 512:
        raise ValueError(f"fused_kv_proj: head_dim {D} > 512 does not fit one PSUM bank")
    Hkv = weight.shape[0] // (2 * L * D)
    if N == 0 or Hkv == 0:
        empty = ctx.new_empty(L, N, Hkv, D)
        return empty, empty.clone()
    # The kernel streams the weight with the hidden dim on partitions. Under torch.compile with freezing the
    # transpose of a parameter is constant-folded; eagerly it is one copy per call.
    w_t = weight.t().contiguous()
    k, v = _runtime.launch(_kernel(), ctx.contiguous(), w_t, k_norm_weight.contiguous(), cos.contiguous(),
                           sin.contiguous(), float(eps))
    return k.to(ctx.dtype), v.to(ctx.dtype)


def fused_kv_proj(
    ctx: Tensor, weight: Tensor, k_norm_weight: Tensor, cos: Tensor, sin: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """Same contract as :func:`dflash_compile.lowerings.ops.fused_kv_proj`; results in ``ctx.dtype``."""
    return _launch(ctx, weight, k_norm_weight, cos, sin, eps)
