"""A long generation with the compiled step: how many graphs it compiles, what each costs, and tokens/s per
context bucket once warm.

    python benchmarks/bench_long.py [--target DIR --draft DIR] [--new-tokens 1984] [--cold] [--out benchmarks/results]

One HumanEval prompt (the first), greedy, batch 1, eos ignored so the row runs to ``--new-tokens`` (default:
up to the capacity, 2048 positions for the default pair). The first pass compiles one step graph per context
bucket the row crosses; the compile time of each graph is the time of its first call (dynamo + passes +
lowering + Inductor, C++ compile included). ``--cold`` points Inductor at an empty cache directory, so nothing
comes from an earlier run's FX graph cache. The second pass is timed: tokens/s and the mean step time in each
context bucket (the step's attention spans the bucket, so the step time grows with it; the weights dominate).
Writes ``bench_long.{json,md}`` under ``--out``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

if "--cold" in sys.argv:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-cold-")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).resolve().parents[1] / "build" / "inductor-cache"))

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper  # noqa: E402
from dflash_compile.assets import default_pair_paths  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from bench_humaneval import humaneval_prompts  # noqa: E402


class _StepClock:
    """Times every call of the compiled step, keyed by its context bucket (pages of the block table)."""

    def __init__(self, spec: DFlashSpecWrapper):
        self.calls: list[tuple[int, float]] = []
        inner = spec._steps.run

        def timed(key, args, kwargs):
            t0 = time.perf_counter()
            out = inner(key, args, kwargs)
            self.calls.append((args[2].shape[1], time.perf_counter() - t0))
            return out

        spec._steps.run = timed


@torch.no_grad()
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None)
    p.add_argument("--draft", default=None)
    p.add_argument("--new-tokens", type=int, default=None, help="default: up to the capacity")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cold", action="store_true", help="empty Inductor cache (measure compiles from scratch)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target_dir, draft_dir = (args.target, args.draft) if args.target else default_pair_paths()
    tok = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    draft = DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32)
    spec = DFlashSpecWrapper(target, draft, max_batch_size=1)
    spec.compile(backend="dflash", fullgraph=True)
    clock = _StepClock(spec)
    ids = tok(humaneval_prompts(1), return_tensors="pt").input_ids
    new = args.new_tokens or spec.max_seq_len - ids.shape[1]
    kw = dict(max_new_tokens=new, eos_token_id=[], return_dict_in_generate=True)

    t0 = time.perf_counter()
    first = spec.generate(ids, **kw)
    first_s = time.perf_counter() - t0
    compiles, seen = {}, set()
    for pages, s in clock.calls:
        if pages not in seen:
            seen.add(pages)
            compiles[pages] = s
    clock.calls.clear()
    t0 = time.perf_counter()
    second = spec.generate(ids, **kw)
    second_s = time.perf_counter() - t0
    assert torch.equal(first.sequences, second.sequences)
    per_bucket = {}
    for pages, s in clock.calls:
        per_bucket.setdefault(pages, []).append(s)
    tokens = sum(second.num_new_tokens)
    report = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "cold_cache": args.cold,
        "prompt_tokens": ids.shape[1],
        "new_tokens": tokens,
        "page_size": spec.page_size,
        "context_buckets_tokens": [b * spec.page_size for b in spec.context_buckets],
        "graphs_compiled": len(compiles),
        "compile_s_per_graph": {b * spec.page_size: round(s, 2) for b, s in compiles.items()},
        "first_pass_s": first_s,
        "warm_tok_s": tokens / second_s,
        "acceptance_length": second.acceptance_length,
        "warm_step_ms_per_bucket": {b * spec.page_size: round(1e3 * sum(v) / len(v), 3) for b, v in per_bucket.items()},
        "steps_per_bucket": {b * spec.page_size: len(v) for b, v in per_bucket.items()},
    }
    print(json.dumps(report, indent=2))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "bench_long_cold" if args.cold else "bench_long"
    (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"{report['prompt_tokens']}-token prompt + {tokens} new tokens, batch 1, greedy, default pair unless stated; "
        f"{report['machine']}; Inductor cache {'empty (cold)' if args.cold else 'as left by earlier runs'}.",
        "",
        f"Graphs compiled: {len(compiles)}; first pass (compiles included) {first_s:.1f} s; warm "
        f"{report['warm_tok_s']:.0f} tok/s, acceptance length {report['acceptance_length']:.2f}.",
        "",
        "| context bucket (tokens) | compile (s) | warm steps | warm step (ms) |",
        "|---|---|---|---|",
    ]
    for b in sorted(compiles):
        t = b * spec.page_size
        lines.append(f"| {t} | {compiles[b]:.1f} | {report['steps_per_bucket'].get(t, 0)} | "
                     f"{report['warm_step_ms_per_bucket'].get(t, float('nan')):.3f} |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
