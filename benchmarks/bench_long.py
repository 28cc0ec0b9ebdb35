"""A long generation with the compiled step: how many graphs it compiles, what each costs, the first pass against
the second, and the warm step time per context range.

    python benchmarks/bench_long.py [--target DIR --draft DIR] [--new-tokens 1984] [--cold] [--out benchmarks/results]

One HumanEval prompt (the first), greedy, batch 1, eos ignored so the row runs to ``--new-tokens`` (default:
up to the capacity, 2048 positions for the default pair). The first pass compiles the step graph of batch 1 (one
graph for every context length; the compile is the key's first call: dynamo, passes, lowering, AOTAutograd,
Inductor, C++ compile, saving). ``--cold`` uses an empty compile cache (and so an empty Inductor cache inside it);
without it, the repository's ``build/dflash-cache``, where an earlier run's graph is loaded. The second pass is
timed: tokens/s, and the mean step time per context range (the step walks the live pages, so its time grows with
the context). Writes ``bench_long[_cold].{json,md}`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper
from dflash_compile.assets import tiny_pair_paths

sys.path.insert(0, str(Path(__file__).parent))
from bench_humaneval import humaneval_prompts


class _StepClock:
    """Times every call of the compiled step, with the pages of its block table."""

    def __init__(self, spec: DFlashSpecWrapper):
        self.calls: list[tuple[int, float]] = []
        inner = spec.compiled_steps.run

        def timed(key, args, kwargs):
            t0 = time.perf_counter()
            out = inner(key, args, kwargs)
            self.calls.append((args[2].shape[1], time.perf_counter() - t0))
            return out

        spec.compiled_steps.run = timed


@torch.no_grad()
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None)
    p.add_argument("--draft", default=None)
    p.add_argument("--new-tokens", type=int, default=None, help="default: up to the capacity")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cold", action="store_true", help="an empty compile cache (measure the compile from scratch)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target_dir, draft_dir = (args.target, args.draft) if args.target else tiny_pair_paths()
    tok = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    draft = DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32)
    spec = DFlashSpecWrapper(target, draft, speculation="fixed", max_batch_size=1)
    cache_dir = tempfile.mkdtemp(prefix="dflash-cold-") if args.cold else Path(__file__).resolve().parents[1] / \
        "build" / "dflash-cache"
    spec.compile(backend="dflash", cache_dir=cache_dir)
    clock = _StepClock(spec)
    ids = tok(humaneval_prompts(1), return_tensors="pt").input_ids
    new = args.new_tokens or spec.max_seq_len - ids.shape[1]
    kw = dict(max_new_tokens=new, eos_token_id=[], return_dict_in_generate=True)

    t0 = time.perf_counter()
    first = spec.generate(ids, **kw)
    first_s = time.perf_counter() - t0
    compiles = [(str(key), how, round(seconds, 2)) for key, how, seconds in spec.compiled_steps.events]
    clock.calls.clear()
    t0 = time.perf_counter()
    second = spec.generate(ids, **kw)
    second_s = time.perf_counter() - t0
    assert torch.equal(first.sequences, second.sequences)
    assert len(spec.compiled_steps.events) == len(compiles), "the second pass compiled"
    ranges = [b * spec.page_size for b in spec.context_buckets]  # 128, 256, ... tokens: report per range
    per_range = {}
    for pages, s in clock.calls:
        per_range.setdefault(next(r for r in ranges if r >= pages * spec.page_size), []).append(s)
    tokens = sum(second.num_new_tokens)
    report = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "cold_cache": args.cold,
        "prompt_tokens": ids.shape[1],
        "new_tokens": tokens,
        "page_size": spec.page_size,
        "graphs": compiles,
        "first_pass_s": first_s,
        "second_pass_s": second_s,
        "first_over_second": first_s / second_s,
        "warm_tok_s": tokens / second_s,
        "acceptance_length": second.acceptance_length,
        "warm_step_ms_per_range": {r: round(1e3 * sum(v) / len(v), 3) for r, v in sorted(per_range.items())},
        "steps_per_range": {r: len(v) for r, v in sorted(per_range.items())},
    }
    print(json.dumps(report, indent=2))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "bench_long_cold" if args.cold else "bench_long"
    (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"{report['prompt_tokens']}-token prompt + {tokens} new tokens, batch 1, greedy, default pair unless stated; "
        f"{report['machine']}; compile cache {'empty (cold)' if args.cold else 'as left by earlier runs'}.",
        "",
        "Graphs: " + "; ".join(f"{k}: {how} in {s:.1f} s" for k, how, s in compiles) + f". First pass "
        f"{first_s:.1f} s, second {second_s:.1f} s ({first_s / second_s:.1f}x); warm {report['warm_tok_s']:.0f} tok/s, "
        f"acceptance length {report['acceptance_length']:.2f}.",
        "",
        "| context (tokens, up to) | warm steps | warm step (ms) |",
        "|---|---|---|",
    ]
    for r in sorted(per_range):
        lines.append(f"| {r} | {report['steps_per_range'][r]} | {report['warm_step_ms_per_range'][r]:.3f} |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
