"""Triton epilogue for ``dflash::fused_kv_proj``: per-head RMSNorm + rotate-half RoPE on K, layout for K and V.

The projection itself is one ``F.linear`` of ``ctx [N, H]`` against the stacked ``[2 * L * Hkv * D, H]``
weight: a single large GEMM that cuBLAS already runs near peak, which a hand-written Triton matmul would
only match. The kernel then reads that ``[N, 2, L, Hkv, D]`` result once: one program per context row
``n``, layer ``l`` and tile of ``BLOCK_H`` KV heads normalises K over ``D`` (statistics in fp32), scales it
by ``k_norm_weight[l]``, applies RoPE, and writes K and V as ``[L, N, Hkv, D]``. The partner half of each K
row for the rotation is re-read from memory (same cache lines) rather than shuffled in registers.

The launch goes through ``torch.library.wrap_triton``: tracing :func:`fused_kv_proj` with make_fx records an
``aten.linear`` and a ``triton_kernel_wrapper_mutation`` node that Inductor compiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton


@triton.jit
def _kernel(
    kv_ptr, w_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr,
    skv_n, skv_s, skv_l, skv_h, skv_d,
    sw_l, sw_d,
    sc_n, sc_d,
    ss_n, ss_d,
    sk_l, sk_n, sk_h, sk_d,
    sv_l, sv_n, sv_h, sv_d,
    Hkv, D, eps,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    l = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    half = D // 2
    d_rot = tl.where(d < half, d + half, d - half)  # partner index of rotate-half
    d_ok = d < D
    mask = (h[:, None] < Hkv) & d_ok[None, :]
    dtype = k_ptr.dtype.element_ty

    k_row = kv_ptr + n * skv_n + l * skv_l + h[:, None] * skv_h  # K is s == 0
    x = tl.load(k_row + d[None, :] * skv_d, mask=mask, other=0.0).to(tl.float32)  # [BH, BD]
    x_rot = tl.load(k_row + d_rot[None, :] * skv_d, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None]  # [BH, 1]
    w = tl.load(w_ptr + l * sw_l + d * sw_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    w_rot = tl.load(w_ptr + l * sw_l + d_rot * sw_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    # Round where the reference rounds (normed K, then weighted K, in the output dtype).
    k = (x * rstd).to(dtype).to(tl.float32) * w
    k = k.to(dtype).to(tl.float32)
    k_rot = (x_rot * rstd).to(dtype).to(tl.float32) * w_rot
    k_rot = k_rot.to(dtype).to(tl.float32)
    k_rot = tl.where(d[None, :] < half, -k_rot, k_rot)
    c = tl.load(cos_ptr + n * sc_n + d * sc_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + n * ss_n + d * ss_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    k = k * c + k_rot * s
    tl.store(k_ptr + l * sk_l + n * sk_n + h[:, None] * sk_h + d[None, :] * sk_d, k.to(dtype), mask=mask)

    v = tl.load(kv_ptr + n * skv_n + skv_s + l * skv_l + h[:, None] * skv_h + d[None, :] * skv_d, mask=mask)
    tl.store(v_ptr + l * sv_l + n * sv_n + h[:, None] * sv_h + d[None, :] * sv_d, v.to(dtype), mask=mask)


def plan(N, L, Hkv, D, dtype) -> dict:
    """Pure-Python launch plan from static shapes (what :func:`_launch` runs); ``reference`` for fp64."""
    if dtype == torch.float64:
        return dict(reference="fp64 runs exactly in the eager reference")
    block_d = triton.next_power_of_2(D)
    block_h = min(triton.next_power_of_2(Hkv), max(1, 2048 // block_d))
    return dict(BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4, grid=(N, L, triton.cdiv(Hkv, block_h)))


def _launch(ctx, weight, k_norm_weight, cos, sin, eps):
    if ctx.dtype == torch.float64:  # the epilogue computes in fp32: fp64 runs exactly in the reference
        from ..ops import _fused_kv_proj_reference

        return _fused_kv_proj_reference(ctx, weight, k_norm_weight, cos, sin, eps)
    L, D = k_norm_weight.shape
    N = ctx.shape[0]
    assert D % 2 == 0, f"rotate-half RoPE needs an even head dim, got {D}"
    Hkv = weight.shape[0] // (2 * L * D)
    # One large GEMM for every layer's K and V: the vendor BLAS does this well; the kernel is the epilogue.
    kv = torch.nn.functional.linear(ctx, weight).view(N, 2, L, Hkv, D)
    k = torch.empty((L, N, Hkv, D), dtype=ctx.dtype, device=ctx.device)
    v = torch.empty((L, N, Hkv, D), dtype=ctx.dtype, device=ctx.device)
    if k.numel() == 0:
        return k, v
    p = plan(N, L, Hkv, D, ctx.dtype)
    block_h, block_d, grid = p["BLOCK_H"], p["BLOCK_D"], p["grid"]
    wrap_triton(_kernel)[grid](
        kv, k_norm_weight, cos, sin, k, v,
        *kv.stride(),
        *k_norm_weight.stride(),
        *cos.stride(),
        *sin.stride(),
        *k.stride(),
        *v.stride(),
        Hkv, D, eps,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=p["num_warps"],
    )
    return k, v


def fused_kv_proj(
    ctx: Tensor, weight: Tensor, k_norm_weight: Tensor, cos: Tensor, sin: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """Triton implementation of :func:`dflash_compile.lowerings.ops.fused_kv_proj` (same contract).

    The epilogue computes in fp32, so fp64 inputs run the eager reference instead (exact, not silently fp32).
    """
    return _launch(ctx, weight, k_norm_weight, cos, sin, eps)
