"""One step graph for every batch bucket from 2 rows against a graph per bucket: the step's cost, side by side.

    python benchmarks/bench_dynamic_batch.py [--pair chat|tiny] [--batches 2 4 8 16] [--ks 0 7] [--repeats 9]
        [--prompt-len 200] [--name NAME]

The wrapper compiles one graph per variant whose batch is a dynamic size from 2 rows (``StepKeys.open_batch``,
``docs/compile.md``). This benchmark builds the same step both ways in one process (``dflash``, the wrapper's
default regions, fresh compile caches): the wrapper's own graphs, and, through a ``CompiledSteps`` keyed the way it
was before (the batch bucket part of the key), a graph per bucket. Each case ``(batch, K)`` is called on the same
inputs (the bucket's random prompts prefilled through the wrapper's own admission): ``K = 0`` as plain decoding
(no proposal: what ``speculation="auto"`` runs most), ``K >= 1`` verifying ``K`` drafts and proposing. After an
untimed warm-up, the two sides alternate call by call for ``--repeats`` rounds; the table gives each median, the
ratio, and what each side compiled (graphs and seconds).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_step import step_inputs  # noqa: E402

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper  # noqa: E402
from dflash_compile.runtime.compiled_steps import CompiledSteps  # noqa: E402
from dflash_compile.runtime.step_keys import StepKeys  # noqa: E402


class PerBucketKeys(StepKeys):
    """Step keys as before one graph served every bucket from 2 rows: the bucket is part of the key."""

    def key(self, batch, context_pages, sampled, verify_len, propose=True):
        return dataclasses.replace(super().key(batch, context_pages, sampled, verify_len, propose), batch=batch)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", choices=("chat", "tiny"), default="chat")
    p.add_argument("--batches", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--ks", type=int, nargs="+", default=[0, 7])
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--name", default=None)
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    if min(args.batches) < 2 or len(set(args.batches)) < 2:
        p.error("--batches: two or more bucket sizes, each 2 or more (one row keeps a static graph either way)")

    from transformers import AutoModelForCausalLM

    from dflash_compile.assets import chat_pair_paths, tiny_pair_paths

    t, d = tiny_pair_paths() if args.pair == "tiny" else chat_pair_paths()
    target = AutoModelForCausalLM.from_pretrained(t, dtype=torch.float32).eval()
    draft = DFlashDraftModel.from_pretrained(d, dtype=torch.float32)
    kmax = max(max(args.ks), 1)
    kw = dict(speculation="fixed", num_speculative_tokens=kmax, max_batch_size=max(args.batches),
              batch_buckets=tuple(sorted(args.batches)), max_seq_len=args.prompt_len + 8 * draft.block_size)
    names = ("one graph", "graph per bucket")
    calls, compiled = {}, {}
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        for name in names:
            spec = DFlashSpecWrapper(target, draft, **kw)
            spec.compile(backend="dflash", cache_dir=Path(tmp) / name.replace(" ", "-"))
            if name == "graph per bucket":
                steps = spec.compiled_steps = CompiledSteps(spec, "dflash", cache_dir=Path(tmp) / "per-bucket")
                steps.keys = PerBucketKeys(spec, steps.dynamic_context, None)
            keys, (lo, hi) = spec.compiled_steps.keys, (min(args.batches), max(args.batches))
            assert (keys.key(lo, 2, False, 1, False) == keys.key(hi, 2, False, 1, False)) == (name == "one graph")
            start = time.perf_counter()
            for b in args.batches:
                inputs = step_inputs(spec, b, args.prompt_len)
                for k in args.ks:
                    x = (inputs[0][:, :k + 1],) + tuple(inputs[1:])
                    calls[name, b, k] = (spec, x, k > 0)
                    for _ in range(3):  # compiles (or not) on the first call; then warm
                        spec.step(*x, propose=k > 0)
            compiled[name] = (len(spec.compiled_steps.compiled_keys()), time.perf_counter() - start)
        times = {c: [] for c in calls}
        for _ in range(args.repeats):  # alternating: both sides see the same machine
            for b in args.batches:
                for k in args.ks:
                    for name in names:
                        spec, x, propose = calls[name, b, k]
                        t0 = time.perf_counter()
                        spec.step(*x, propose=propose)
                        times[name, b, k].append(time.perf_counter() - t0)
    med = {c: statistics.median(v) * 1e3 for c, v in times.items()}
    command = "python benchmarks/bench_dynamic_batch.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [f"# One step graph for every bucket from 2 rows vs a graph per bucket ({Path(t).name}, context "
             f"{args.prompt_len}, `dflash`, {torch.get_num_threads()} thread(s), median of {args.repeats} "
             f"alternating calls)", "", f"Command: `{command}`", "",
             "| batch | K | graph per bucket (ms) | one graph (ms) | one / per bucket |", "|---|---|---|---|---|"]
    for b in args.batches:
        for k in args.ks:
            a, o = med["graph per bucket", b, k], med["one graph", b, k]
            lines.append(f"| {b} | {k}{'' if k else ' (plain)'} | {a:.2f} | {o:.2f} | {o / a:.3f} |")
    lines += ["", "Compiled (graphs, seconds, cold caches): " + "; ".join(
        f"{name} {n} ({s:.1f} s)" for name, (n, s) in compiled.items()) + "."]
    print("\n".join(lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = args.name or f"bench_dynamic_batch-{args.pair}"
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    (out / f"{name}.json").write_text(json.dumps(
        {"args": vars(args), "ms": {f"{n}|{b}|{k}": v for (n, b, k), v in med.items()},
         "runs": {f"{n}|{b}|{k}": v for (n, b, k), v in times.items()}, "compiled": compiled}, indent=1) + "\n")


if __name__ == "__main__":
    main()
