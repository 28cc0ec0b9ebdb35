"""Compiled vs eager time of one DFlash step (verify + accept + propose) per batch bucket, on this machine.

    python benchmarks/bench_step.py [--backends dflash inductor] [--buckets 1 4 16] [--repeats 7]

A random Qwen3 target and drafter (the step's cost does not depend on the weights). Each backend compiles
the step once per bucket (the compile time is reported separately), then the median of ``--repeats`` timed
calls is compared with eager in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper
from dflash_compile.runtime.generation import resolve_generation_args
from dflash_compile.runtime.scheduler import Scheduler


def build(args):
    config = Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256), head_dim=64, max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(config).eval()
    draft = DFlashDraftModel.from_target(target, num_layers=args.draft_layers, block_size=args.block_size, seed=0)
    return target, draft


@torch.no_grad()
def step_inputs(spec, bucket, prompt_len):
    """``bucket`` random prompts prefilled together through ``spec``'s own admission, and the step's inputs for
    them, exactly as ``generate`` builds them (fresh pools each call)."""
    spec.pools.cache = None
    spec.scheduler = Scheduler(spec)
    g = torch.Generator().manual_seed(bucket)
    vocab = spec.draft.config.vocab_size
    prompts = [torch.randint(0, vocab - 1, (prompt_len,), generator=g).tolist() for _ in range(bucket)]
    args = resolve_generation_args(spec.target, prompt_len, dict(max_new_tokens=spec.max_seq_len))
    return spec.scheduler.prefill_batch(prompts, args)[1]


@torch.no_grad()
def time_step(fn, inputs, repeats, warmup=3):
    for _ in range(warmup):  # the first calls after a compile are slow (lazy initialisation)
        fn(*inputs)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*inputs)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="the wrapper's capacity per request (default: prompt + 4 blocks); every step attends over "
                        "the context bucket that holds the live rows, whatever the capacity")
    p.add_argument("--buckets", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--backends", nargs="+", default=["dflash", "inductor"])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)

    target, draft = build(args)
    kw = dict(speculation="fixed", max_batch_size=max(args.buckets),
              max_seq_len=args.max_seq_len or args.prompt_len + 4 * args.block_size)
    eager = DFlashSpecWrapper(target, draft, **kw)
    rows = {}
    for bucket in args.buckets:
        inputs = step_inputs(eager, bucket, args.prompt_len)
        rows[bucket] = {"eager_ms": time_step(eager.step, inputs, args.repeats) * 1e3}
    for backend in args.backends:
        torch._dynamo.reset()
        counters.clear()
        spec = DFlashSpecWrapper(target, draft, **kw)
        spec.compile(backend=backend, fullgraph=True)
        for bucket in args.buckets:
            inputs = step_inputs(spec, bucket, args.prompt_len)
            t0 = time.perf_counter()
            with torch.no_grad():  # as the scheduler runs every step (the graph is guarded on grad mode)
                spec.step(*inputs)
            rows[bucket][f"{backend}_compile_s"] = time.perf_counter() - t0
            rows[bucket][f"{backend}_ms"] = time_step(spec.step, inputs, args.repeats) * 1e3
            rows[bucket][f"{backend}_speedup"] = rows[bucket]["eager_ms"] / rows[bucket][f"{backend}_ms"]
        rows["passes_" + backend] = dict(counters["dflash"])
    params = sum(p.numel() for p in target.parameters()) / 1e6
    head = f"Step time, random Qwen3 {params:.1f}M target fp32, drafter {args.draft_layers} layers, block " \
           f"{args.block_size}, context {args.prompt_len}, capacity {kw['max_seq_len']}; median of {args.repeats}; " \
           f"{torch.get_num_threads()} threads."
    lines = [head, "", "| bucket | eager (ms) | " + " | ".join(f"{b} (ms) | {b} speed-up" for b in args.backends)
             + " |", "|---" * (2 + 2 * len(args.backends)) + "|"]
    for bucket in args.buckets:
        r = rows[bucket]
        lines.append(f"| {bucket} | {r['eager_ms']:.1f} | " + " | ".join(
            f"{r[f'{b}_ms']:.1f} | {r[f'{b}_speedup']:.2f}x" for b in args.backends) + " |")
    print("\n".join(lines))
    print({k: v for k, v in rows.items() if str(k).startswith("passes")})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_step.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
    (out / "bench_step.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
