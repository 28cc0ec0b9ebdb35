"""``dflash::fused_kv_proj``: eager reference vs ``torch.compile`` (Inductor), and the Triton epilogue on CUDA.

    python benchmarks/bench_fused_kv_proj.py [--repeats 10] [--batch 1 4 16] [--threads N] [--out benchmarks/results]

The drafter's case: ``T`` new context rows per request (N = B * T rows of hidden size 1024) projected to the
K and V of every draft layer (L=4, Hkv=2, D=128) by one stacked matmul, K RMS-normed and rotated. Median of
``--repeats`` after one warm-up call (which, for Inductor, is the compile). fp32 on CPU, bf16 on CUDA.
"""

from __future__ import annotations

import json

import torch
from _harness import median_ms, parser, run

from dflash_compile.lowerings.ops import _fused_kv_proj_reference


def _inputs(N, args, device, dtype, gen):
    L, Hkv, D, H = args.layers, args.hkv, args.head_dim, args.hidden
    ctx = torch.randn(N, H, generator=gen).to(device, dtype)
    weight = (torch.randn(2 * L * Hkv * D, H, generator=gen) / H**0.5).to(device, dtype)
    k_norm_weight = (torch.rand(L, D, generator=gen) + 0.5).to(device, dtype)
    angles = torch.arange(N)[:, None] * 10000 ** (-torch.arange(0, D, 2) / D)  # [N, D/2]
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(device, dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(device, dtype)
    return ctx, weight, k_norm_weight, cos, sin, 1e-6


def bench(device, args):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    rows = []
    for B in args.batch:
        N = B * args.block
        inputs = _inputs(N, args, device, dtype, torch.Generator().manual_seed(B))
        k_ref, v_ref = _fused_kv_proj_reference(*inputs)
        row = {"device": device, "dtype": str(dtype).removeprefix("torch."), "B": B, "N": N}
        from dflash_compile.lowerings.triton.fused_kv_proj import plan  # the Triton launcher's choice on CUDA

        row["triton_plan"] = str(plan(N, args.layers, args.hkv, args.head_dim, torch.bfloat16))
        row["eager_ms"], _ = median_ms(lambda: _fused_kv_proj_reference(*inputs), args.repeats, device)
        compiled = torch.compile(_fused_kv_proj_reference, backend="inductor", dynamic=False)
        row["inductor_ms"], compile_ms = median_ms(lambda: compiled(*inputs), args.repeats, device)
        row["inductor_compile_s"] = compile_ms / 1e3
        k, v = compiled(*inputs)
        torch.testing.assert_close((k, v), (k_ref, v_ref), atol=3e-2, rtol=3e-2)
        if device == "cuda":
            from dflash_compile.lowerings.triton.fused_kv_proj import fused_kv_proj

            row["triton_ms"], _ = median_ms(lambda: fused_kv_proj(*inputs), args.repeats, device)
            torch.testing.assert_close(fused_kv_proj(*inputs), (k_ref, v_ref), atol=3e-2, rtol=3e-2)
        rows.append(row)
        print(json.dumps(row))
    return rows


def _title(args):
    args = vars(args)
    return (
        f"fused_kv_proj: hidden {args['hidden']}, L={args['layers']}, "
        f"Hkv={args['hkv']}, D={args['head_dim']}, N = B x {args['block']} rows; median of {args['repeats']}."
    )


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args(argv)
    run("bench_fused_kv_proj", bench, args, _title(args), extra=("N",))


if __name__ == "__main__":
    main()
