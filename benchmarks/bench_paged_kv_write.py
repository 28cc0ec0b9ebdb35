"""``dflash::paged_kv_write``: eager reference vs ``torch.compile`` (Inductor), and the Triton kernel on CUDA.

    python benchmarks/bench_paged_kv_write.py [--repeats 10] [--batch 1 4 16] [--threads N] [--out benchmarks/results]

The drafter's case: the K and V of ``T`` new context rows per request, for every draft layer, scattered into
a ``[2, L, num_slots, Hkv, D]`` pool (L=4, Hkv=2, D=128; 1024 slots per row); the last row is padding
(slot -1). Median of ``--repeats`` after one warm-up call (which, for Inductor, is the compile). fp32 on CPU,
bf16 on CUDA.
"""

from __future__ import annotations

import json

import torch
from _harness import median_ms, parser, run

from dflash_compile.lowerings import ops

_reference = ops.paged_kv_write._init_fn  # the plain torch body of the custom op


def _inputs(B, args, device, dtype, gen):
    pool = torch.zeros(2, args.layers, B * args.max_ctx + 1, args.hkv, args.head_dim, dtype=dtype, device=device)
    ctx_lens = torch.randint(0, args.max_ctx - args.block + 1, (B,), generator=gen)
    slots = (torch.arange(B)[:, None] * args.max_ctx + ctx_lens[:, None] + torch.arange(args.block)).flatten()
    if B > 1:
        slots[-args.block:] = -1  # a padded row
    values = torch.randn(2, args.layers, B * args.block, args.hkv, args.head_dim, generator=gen).to(device, dtype)
    return pool, slots.to(device), values


def bench(device, args):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    rows = []
    for B in args.batch:
        gen = torch.Generator().manual_seed(B)
        pool, slots, values = _inputs(B, args, device, dtype, gen)
        expected = pool.clone()
        _reference(expected, slots, values)
        row = {"device": device, "dtype": str(dtype).removeprefix("torch."), "B": B, "rows": slots.numel()}
        from dflash_compile.lowerings.triton.paged_kv_write import plan  # the Triton launcher's choice on CUDA

        row["triton_plan"] = str(plan(slots.numel(), 2 * args.layers, args.hkv, args.head_dim))
        row["eager_ms"], _ = median_ms(lambda: _reference(pool, slots, values), args.repeats, device)
        compiled = torch.compile(_reference, backend="inductor", dynamic=False)
        pool.zero_()
        row["inductor_ms"], compile_ms = median_ms(lambda: compiled(pool, slots, values), args.repeats, device)
        row["inductor_compile_s"] = compile_ms / 1e3
        torch.testing.assert_close(pool, expected, atol=0, rtol=0)
        if device == "cuda":
            from dflash_compile.lowerings.triton.paged_kv_write import paged_kv_write

            pool.zero_()
            row["triton_ms"], _ = median_ms(lambda: paged_kv_write(pool, slots, values), args.repeats, device)
            torch.testing.assert_close(pool, expected, atol=0, rtol=0)
        rows.append(row)
        print(json.dumps(row))
    return rows


def _title(args):
    args = vars(args)
    return (
        f"paged_kv_write: pool [2, L={args['layers']}, slots, Hkv={args['hkv']}, "
        f"D={args['head_dim']}], T={args['block']} rows per request; median of {args['repeats']}."
    )


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--max-ctx", type=int, default=1024)
    args = p.parse_args(argv)
    run("bench_paged_kv_write", bench, args, _title(args), extra=("rows",))


if __name__ == "__main__":
    main()
