"""One step graph for every K against one graph per K: the step's cost at each K, side by side.

    python benchmarks/bench_dynamic_k.py [--pair tiny|default] [--batch 1] [--ks 1 2 4 7] [--repeats 9]

The wrapper compiles one graph per batch bucket whose block length (``K + 1``) is a dynamic size
(``docs/compile.md``). This benchmark compiles the same step both ways in one process, with the ``dflash`` backend
and the wrapper's default regions: the wrapper's own graph, and, through a ``CompiledSteps`` keyed the way it was
before (one static graph per ``K``), a graph per ``K``. Each is called on the same inputs (a batch prefilled through
the wrapper's own admission), after an untimed warm-up, in interleaved rounds; the table gives each median and the
ratio, and the compile seconds of each side.
"""

from __future__ import annotations

import argparse
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
from dflash_compile.runtime.step_keys import StepKey, StepKeys  # noqa: E402


class PerKKeys(StepKeys):
    """Step keys as before one graph served every K: the block length is part of the key."""

    def key(self, batch, context_pages, sampled, verify_len, propose=True):
        key = super().key(batch, context_pages, sampled, verify_len, propose)
        return StepKey(key.batch, verify_len, key.sampled, key.context_pages, key.propose)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", choices=("tiny", "default"), default="tiny")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 7])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from dflash_compile.assets import default_pair_paths, tiny_pair_paths

    t, d = tiny_pair_paths() if args.pair == "tiny" else default_pair_paths()
    target = AutoModelForCausalLM.from_pretrained(t, dtype=torch.float32).eval()
    draft = DFlashDraftModel.from_pretrained(d, dtype=torch.float32)
    kw = dict(speculation="fixed", num_speculative_tokens=max(args.ks), max_batch_size=args.batch,
              max_seq_len=args.prompt_len + 4 * draft.block_size)
    specs, compile_s = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("one graph", "graph per K"):
            spec = DFlashSpecWrapper(target, draft, **kw)
            spec.compile(backend="dflash", cache_dir=Path(tmp) / name.replace(" ", "-"))
            if name == "graph per K":
                steps = spec.compiled_steps = CompiledSteps(spec, "dflash", cache_dir=Path(tmp) / "per-k")
                steps.keys = PerKKeys(spec, steps.dynamic_context, None)
            specs[name] = (spec, step_inputs(spec, args.batch, args.prompt_len))
        calls = {}
        with torch.no_grad():
            for name, (spec, inputs) in specs.items():
                start = time.perf_counter()
                for k in args.ks:
                    x = (inputs[0][:, :k + 1],) + tuple(inputs[1:])
                    calls[name, k] = (spec, x)
                    for _ in range(3):  # compiles (or not) on the first call; then warm
                        spec.step(*x)
                compile_s[name] = time.perf_counter() - start
            times = {c: [] for c in calls}
            for _ in range(args.repeats):  # interleaved: both sides see the same machine
                for c, (spec, x) in calls.items():
                    t0 = time.perf_counter()
                    spec.step(*x)
                    times[c].append(time.perf_counter() - t0)
        graphs = {name: len(spec.compiled_steps.compiled_keys()) for name, (spec, _) in specs.items()}
    med = {c: statistics.median(v) * 1e3 for c, v in times.items()}
    lines = [f"# One step graph for every K vs a graph per K ({Path(t).name}, batch {args.batch}, context "
             f"{args.prompt_len}, `dflash`, {torch.get_num_threads()} thread(s), median of {args.repeats} interleaved "
             f"calls)", "", "Command: `python benchmarks/bench_dynamic_k.py " + " ".join(argv or sys.argv[1:]) + "`",
             "", "| K | graph per K (ms) | one graph (ms) | one / per K |", "|---|---|---|---|"]
    for k in args.ks:
        a, b = med["graph per K", k], med["one graph", k]
        lines.append(f"| {k} | {a:.2f} | {b:.2f} | {b / a:.3f} |")
    lines += ["", f"Graphs compiled: one graph {graphs['one graph']} ({compile_s['one graph']:.1f} s), graph per K "
              f"{graphs['graph per K']} ({compile_s['graph per K']:.1f} s)."]
    print("\n".join(lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"-{args.pair}-b{args.batch}"
    (out / f"bench_dynamic_k{tag}.md").write_text("\n".join(lines) + "\n")
    (out / f"bench_dynamic_k{tag}.json").write_text(json.dumps(
        {"args": vars(args), "ms": {f"{n}|{k}": v for (n, k), v in med.items()}, "compile_s": compile_s,
         "graphs": graphs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
