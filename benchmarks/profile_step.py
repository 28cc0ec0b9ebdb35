"""Where one compiled step's time goes, kernel by kernel: torch.profiler over the step graph of a shipped pair.

    python benchmarks/profile_step.py [--pair tiny|chat] [--batch 8] [--k 0] [--prompt-len 200] [--steps 30]
        [--top 12] [--out benchmarks/results/profile_step-<pair>-b<batch>-k<k>.md]

The step is compiled with the ``dflash`` backend and Inductor's kernel profiling on (each generated C++ kernel
records itself, ``torch._inductor.config.cpp.enable_kernel_profile``), in a compile-cache folder of its own, and
called ``--steps`` times on ``--batch`` random prompts of ``--prompt-len`` tokens prefilled through the wrapper's
own admission (``bench_step.step_inputs``), after 3 untimed calls. The table lists the ``--top`` entries by self
time per step, then the rest grouped: Inductor's fused kernels, our ``dflash_cpu`` ops, ATen's matmuls, the graph's
own Python/C++ wrapper. One thread unless ``OMP_NUM_THREADS`` says otherwise.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def group(name: str) -> str:
    if "cpp_fused" in name:
        return "Inductor fused kernels"
    if name.startswith("dflash_cpu::"):
        return name
    if name in ("aten::mm", "aten::bmm", "aten::addmm", "aten::linear"):
        return "ATen matmuls (" + name + ")"
    return "the graph's wrapper and other ATen calls"


@torch.no_grad()
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", choices=("tiny", "chat"), default="tiny")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--k", type=int, default=0)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import torch._inductor.config as inductor_config
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM

    from bench_step import step_inputs
    from dflash_compile import DFlashDraftModel, DFlashSpecWrapper
    from dflash_compile.assets import chat_pair_paths, tiny_pair_paths

    inductor_config.cpp.enable_kernel_profile = True
    t, d = tiny_pair_paths() if args.pair == "tiny" else chat_pair_paths()
    target = AutoModelForCausalLM.from_pretrained(t, dtype=torch.float32).eval()
    draft = DFlashDraftModel.from_pretrained(d, dtype=torch.float32)
    spec = DFlashSpecWrapper(target, draft, speculation="fixed", num_speculative_tokens=args.k,
                             max_batch_size=args.batch, batch_buckets=(args.batch,))
    spec.compile(backend="dflash", cache_dir=REPO / "build" / "profile-step-cache")
    inputs = step_inputs(spec, args.batch, args.prompt_len)
    propose = args.k > 0
    for _ in range(3):
        spec.step(*inputs, propose=propose)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        spec.step(*inputs, propose=propose)
    wall = (time.perf_counter() - t0) / args.steps * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            spec.step(*inputs, propose=propose)
    events = [(e.key, e.self_cpu_time_total / 1e3 / args.steps, e.count // args.steps)
              for e in prof.key_averages() if e.self_cpu_time_total > 0]
    events.sort(key=lambda e: -e[1])
    total = sum(ms for _, ms, _ in events)
    lines = [f"`python benchmarks/profile_step.py --pair {args.pair} --batch {args.batch} --k {args.k} "
             f"--prompt-len {args.prompt_len} --steps {args.steps}`: {wall:.2f} ms per step unprofiled, "
             f"{total:.2f} ms of self time per step under the profiler, {torch.get_num_threads()} thread(s)", "",
             "| entry | calls per step | ms per step | share |", "|---|---|---|---|"]
    for name, ms, n in events[: args.top]:
        short = name if len(name) <= 90 else name[:87] + "..."
        lines.append(f"| `{short}` | {n} | {ms:.3f} | {100 * ms / total:.1f} % |")
    groups: dict[str, float] = {}
    for name, ms, _ in events:
        groups[group(name)] = groups.get(group(name), 0.0) + ms
    lines += ["", "| group | ms per step | share |", "|---|---|---|"]
    lines += [f"| {g} | {ms:.3f} | {100 * ms / total:.1f} % |" for g, ms in sorted(groups.items(), key=lambda x: -x[1])]
    table = "\n".join(lines) + "\n"
    print(table)
    out = Path(args.out or REPO / "benchmarks" / "results" / f"profile_step-{args.pair}-b{args.batch}-k{args.k}.md")
    out.write_text(table)


if __name__ == "__main__":
    main()
