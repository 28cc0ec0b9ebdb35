"""``dflash::block_attention``: eager reference vs ``torch.compile`` (Inductor over the CPU lowering on CPU, over the
reference on CUDA), and the Triton kernel on CUDA.

    python benchmarks/bench_block_attention.py [--repeats 10] [--batch 1 4 16] [--threads N] [--out benchmarks/results]
        [--target-case] [--hq 8 --hkv 2 --head-dim 128 --block 16 --min-ctx 256 --max-ctx 1024] [--pools 30]
        [--name NAME]

The drafter's case: a block of T queries per row attends, non-causally, to its paged context (256..1024
positions per row, page size 16) plus the block's own keys; Hq=8, Hkv=2, D=128. ``--target-case``: the target's
verify instead, causal, the block's K/V already in the pool (its last T positions). Median of ``--repeats`` after one
warm-up call (which, for Inductor, is the compile). fp32 on CPU, bf16 on CUDA. On CPU the compiled op is the
lowering a step runs (the C++ kernel for fp32, plus a compiled function's call), beside the kernel called directly
(``kernel``: what a step's graph pays; ``kernel, N pools``: the same over ``--pools`` copies of the pools in
turn, as a step's layers read theirs, from memory rather than the cache) and the ATen form compiled (``aten form``:
the context gathered, then two matmuls).
"""

from __future__ import annotations

import json

import torch
from _harness import median_ms, parser, run

from dflash_compile.lowerings.cpu.block_attention import aten_block_attention
from dflash_compile.lowerings.cpu.block_attention import block_attention as block_attention_cpu
from dflash_compile.lowerings.ops import _block_attention_reference


def _inputs(B, args, device, dtype, gen):
    NB = args.max_ctx // args.page_size
    num_pages = B * NB + 1
    k_pool = torch.randn(num_pages * args.page_size, args.hkv, args.head_dim, generator=gen).to(device, dtype)
    v_pool = torch.randn(num_pages * args.page_size, args.hkv, args.head_dim, generator=gen).to(device, dtype)
    block_table = torch.randperm(num_pages, generator=gen)[: B * NB].view(B, NB).to(device)
    ctx_lens = torch.randint(args.min_ctx, args.max_ctx + 1, (B,), generator=gen).to(device)
    q = torch.randn(B, args.hq, args.block, args.head_dim, generator=gen).to(device, dtype)
    if args.target_case:  # the block's K/V are the last T positions of the context, in the pool
        q_positions = ctx_lens[:, None] - args.block + torch.arange(args.block, device=device)
        return (q, k_pool, v_pool, block_table, ctx_lens, q_positions, None, None, args.page_size, True, 0,
                args.head_dim**-0.5)
    q_positions = ctx_lens[:, None] + torch.arange(args.block, device=device)
    k_block = torch.randn(B, args.hkv, args.block, args.head_dim, generator=gen).to(device, dtype)
    v_block = torch.randn(B, args.hkv, args.block, args.head_dim, generator=gen).to(device, dtype)
    return (q, k_pool, v_pool, block_table, ctx_lens, q_positions, k_block, v_block,
            args.page_size, False, 0, args.head_dim**-0.5)


def bench(device, args):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    rows = []
    for B in args.batch:
        gen = torch.Generator().manual_seed(B)
        inputs = _inputs(B, args, device, dtype, gen)
        expected = _block_attention_reference(*inputs)
        row = {"device": device, "dtype": str(dtype).removeprefix("torch."), "B": B}
        # What the Triton launcher picks for these static shapes on CUDA (bf16), from its pure-Python plan().
        from dflash_compile.lowerings.triton.block_attention import plan

        max_ctx = args.max_ctx // args.page_size * args.page_size
        row["triton_plan"] = plan(B, args.hq, args.hkv, args.block, args.head_dim, torch.bfloat16, max_ctx).describe()
        row["eager_ms"], _ = median_ms(lambda: _block_attention_reference(*inputs), args.repeats, device)
        # What a compiled step runs: on CPU the op's lowering (plain ATen, compiled by Inductor into C++); on CUDA
        # Inductor over the reference, beside the Triton kernel.
        impl = block_attention_cpu if device == "cpu" else _block_attention_reference
        compiled = torch.compile(impl, backend="inductor", dynamic=False)
        row["inductor_ms"], compile_ms = median_ms(lambda: compiled(*inputs), args.repeats, device)
        row["inductor_compile_s"] = compile_ms / 1e3
        torch.testing.assert_close(compiled(*inputs), expected, atol=2e-2, rtol=2e-2)
        row["kernel (ms)"] = row["aten form (ms)"] = row[f"kernel, {args.pools} pools (ms)"] = "n/a"
        if device == "cpu":  # the C++ kernel called directly (no compiled function around it), and the ATen form
            kernel_ms, _ = median_ms(lambda: torch.ops.dflash_cpu.block_attention(*inputs), args.repeats, device)
            row["kernel (ms)"] = f"{kernel_ms:.3f}"
            # a step's layers each read their own pool: the kernel over --pools copies in turn, ms per call
            copies = [inputs] + [(inputs[0], inputs[1].clone(), inputs[2].clone(), *inputs[3:])
                                 for _ in range(args.pools - 1)]

            def every_pool():
                for c in copies:
                    torch.ops.dflash_cpu.block_attention(*c)

            pools_ms, _ = median_ms(every_pool, args.repeats, device)
            row[f"kernel, {args.pools} pools (ms)"] = f"{pools_ms / args.pools:.3f}"
            aten = torch.compile(aten_block_attention, backend="inductor", dynamic=False)
            aten_ms, _ = median_ms(lambda: aten(*inputs), args.repeats, device)
            row["aten form (ms)"] = f"{aten_ms:.3f}"
        if device == "cuda":
            from dflash_compile.lowerings.triton.block_attention import block_attention

            row["triton_ms"], _ = median_ms(lambda: block_attention(*inputs), args.repeats, device)
            torch.testing.assert_close(block_attention(*inputs), expected, atol=2e-2, rtol=2e-2)
        rows.append(row)
        print(json.dumps(row))
    return rows


def _title(args):
    args = vars(args)
    return (
        f"block_attention: Hq={args['hq']}, Hkv={args['hkv']}, D={args['head_dim']}, "
        f"T={args['block']}, context {args['min_ctx']}..{args['max_ctx']} (page {args['page_size']}), "
        + ("causal, the block in the pool (the target's verify)" if args["target_case"] else
           "non-causal + block keys (the drafter)") + f"; median of {args['repeats']}."
    )


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--hq", type=int, default=8)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--min-ctx", type=int, default=256)
    p.add_argument("--max-ctx", type=int, default=1024)
    p.add_argument("--target-case", action="store_true", help="causal, the block's K/V in the pool (the target's)")
    p.add_argument("--pools", type=int, default=30,
                   help="the kernel also over this many copies of the pools in turn, ms per call: each layer of a step "
                        "reads its own pool, so the K/V come from memory rather than the cache (30: SmolLM2's layers)")
    p.add_argument("--name", default="bench_block_attention", help="the result files' name")
    args = p.parse_args(argv)
    run(args.name, bench, args, _title(args),
        extra=("kernel (ms)", f"kernel, {args.pools} pools (ms)", "aten form (ms)"))


if __name__ == "__main__":
    main()
