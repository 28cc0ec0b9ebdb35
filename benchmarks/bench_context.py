"""One step graph for every context length against one per context bucket: the step's cost at contexts 256-2048.

    python benchmarks/bench_context.py [--batches 1 8] [--contexts 256 512 1024 2048] [--repeats 7]

The shipped pair (or ``--target/--draft``), one CPU thread. For each batch size and context length, every row holds
``context - K - 1`` tokens, so the step's verify block ends exactly at ``context``: the table the step gets is the
same ``context / page_size`` pages for both graphs — the static graph compiled for that context bucket (what
``dflash_neuron`` compiles, and what every backend compiled before) and the dynamic graph that serves every
length. That is the dynamic graph's worst case: between buckets it walks only the live pages where the static one
walks the whole bucket. Reports the median over ``--repeats`` rounds of the mean of ``--calls`` steps, the two
graphs interleaved in each round, as JSON and markdown under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from _harness import load_pair
from dflash_compile import DFlashSpecWrapper
from dflash_compile.runtime.compiled_steps import CompiledSteps
from dflash_compile.runtime.generation import resolve_generation_args


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None)
    p.add_argument("--draft", default=None)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--cache-dir", default=str(Path(__file__).resolve().parents[1] / "build" / "dflash-cache"))
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args()
    torch.set_num_threads(1)
    target, draft = load_pair(args.target, args.draft)
    spec = DFlashSpecWrapper(target, draft, speculation="fixed", max_batch_size=max(args.batches),
                             max_seq_len=max(args.contexts))
    graphs = {
        "static (one per context bucket)": CompiledSteps(spec, "dflash", cache_dir=args.cache_dir,
                                                         dynamic_context=False),
        "dynamic (one for every length)": CompiledSteps(spec, "dflash", cache_dir=args.cache_dir),
    }
    rows = []
    g = torch.Generator().manual_seed(0)
    for batch in args.batches:
        for ctx in args.contexts:
            n = ctx - spec.verify_len
            prompts = [torch.randint(10, 1000, (n,), generator=g).tolist() for _ in range(batch)]
            spec.compiled_steps = graphs["dynamic (one for every length)"]  # compiled: the pools are allocated at capacity
            gen = resolve_generation_args(target, n, {"max_new_tokens": 8})
            bucket, inputs = spec.scheduler.prefill_batch(prompts, gen)
            calls = {}
            for name, steps in graphs.items():
                spec.compiled_steps = steps
                key = steps.key(bucket, inputs[2].shape[1], False, spec.verify_len)
                how, seconds = steps.prepare(key, inputs, {})
                print(f"batch {batch}, context {ctx}, {name}: {how} in {seconds:.1f} s", flush=True)
                calls[name] = (steps, key)
            times = {name: [] for name in graphs}
            with torch.no_grad():
                for name, (steps, key) in calls.items():  # untimed warm-up
                    steps.run(key, inputs, {})
                for _ in range(args.repeats):
                    for name, (steps, key) in calls.items():
                        start = time.perf_counter()
                        for _ in range(args.calls):
                            steps.run(key, inputs, {})
                        times[name].append((time.perf_counter() - start) / args.calls * 1e3)
            med = {name: statistics.median(t) for name, t in times.items()}
            static, dynamic = med.values()
            rows.append({"batch": batch, "context": ctx, "pages": inputs[2].shape[1], "ms": med,
                         "dynamic_over_static": dynamic / static})
            print(f"batch {batch}, context {ctx}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in med.items())
                  + f", ratio {dynamic / static:.3f}", flush=True)
            spec.scheduler = type(spec.scheduler)(spec)  # the next shape starts from an idle scheduler
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_context.json").write_text(json.dumps({"rows": rows, "repeats": args.repeats, "calls": args.calls,
                                                        "torch": torch.__version__}, indent=1))
    names = list(graphs)
    lines = ["# One step graph for every context length vs one per context bucket (1 thread, ms per step, median "
             f"of {args.repeats} rounds of {args.calls} calls)", "",
             "Command: `python benchmarks/bench_context.py " + " ".join(sys.argv[1:]) + "`", "",
             "| batch | context | " + " | ".join(names) + " | dynamic / static |",
             "|---|---|" + "---|" * (len(names) + 1)]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['context']} | " + " | ".join(f"{r['ms'][n]:.3f}" for n in names)
                     + f" | {r['dynamic_over_static']:.3f} |")
    (out / "bench_context.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
