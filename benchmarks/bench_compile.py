"""Where the seconds of a compile go: a cold and a warm start of the compiled DFlash step, phase by phase.

    python benchmarks/bench_compile.py [--target DIR --draft DIR | --pair tiny] [--backend dflash] [--batch 1]
        [--speculation auto] [--regions auto|on|off] [--scenarios cold,warm,copied,background] [--repeats 3]

Each scenario runs in a fresh process (``--worker``), one CPU thread, and times ``spec.compile()`` up to the first
new token a caller receives and up to the first generated tokens of ``--batch`` prompts (8 new tokens after 8-token
prompts) on a wrapper of ``max_batch_size = --batch`` with the default speculation policy: the ``generate`` call
readies every graph a batch of that size may step through (each batch bucket up to it, each K the policy may choose)
before its first step, so both times cover every graph the default path needs for batch sizes 1 to ``--batch``.
With the phases torch records (``compile_times``) plus the DFlash ones:

- ``cold``: an empty compile cache (and so an empty Inductor cache inside it): dynamo traces the step, the DFlash
  passes and the lowering retrace run, AOTAutograd traces, Inductor generates and compiles C++ (Triton on CUDA),
  and the result is saved;
- ``warm``: the cache the cold run left: the saved graph is loaded, nothing is traced or compiled;
- ``copied``: the compile cache without its ``inductor/`` folder (what a machine gets when only the saved graphs
  travel): the saved graph loads, and Inductor compiles its C++ source again;
- ``cold, background``: an empty cache with ``on_miss="background"``: the first tokens come from the eager step
  while the graph compiles on a background thread (nothing of the compile is waited for: its phases read 0 and
  the whole time is "other").

Reports the median of ``--repeats`` runs of each scenario (a cold run gets a new empty cache each time) as JSON and
markdown under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def phases_of(metrics: dict, loaded_s: float, total_s: float) -> dict:
    """Phases from torch's timers (``compilation_time_metrics``, summed per name, over this process and the worker
    processes that compiled graphs for it) and the time spent loading saved graphs; ``other`` is the rest of the wall
    time (prefill, the step, saving), 0 when graphs compiled side by side and the phases add up to more than it."""
    m = lambda name: metrics.get(name, 0.0)  # noqa: E731
    native = m("PyCodeCache.load_by_key_path")
    phases = {
        "dynamo trace": m("bytecode_tracing"),
        "DFlash passes (retrace + rewrite)": m("dflash.retrace") + m("dflash.passes"),
        "lowering retrace": m("dflash.lower"),
        "AOTAutograd": max(0.0, m("create_aot_dispatcher_function") - m("compile_fx_inner")),
        "Inductor lowering + codegen": max(0.0, m("compile_fx_inner") - native),
        "C++/Triton compile and load": native,
        "guards": m("build_guards"),
        "loading the saved graph": max(0.0, loaded_s - (native if loaded_s else 0.0)),
    }
    phases["other (prefill, steps, save)"] = max(0.0, total_s - sum(phases.values()))
    return phases


def worker(args) -> dict:
    import torch
    from torch._dynamo.utils import compilation_time_metrics
    from transformers import AutoModelForCausalLM

    from dflash_compile import DFlashDraftModel, DFlashSpecWrapper
    from dflash_compile.runtime.handles import RequestHandle

    first_token = []  # when the first new token reached a caller (the prefill's, after every graph is ready)
    put = RequestHandle._put

    def timed_put(handle, token):
        if not first_token:
            first_token.append(time.perf_counter())
        put(handle, token)

    RequestHandle._put = timed_put

    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    draft = DFlashDraftModel.from_pretrained(args.draft, dtype=torch.float32)
    spec = DFlashSpecWrapper(target, draft, speculation=args.speculation, max_batch_size=args.batch,
                             max_seq_len=args.max_seq_len)
    prompts = [[(7 * i + 13 * r) % 1000 + 10 for i in range(8)] for r in range(args.batch)]
    regions = {"auto": None, "on": True, "off": False}[args.regions]
    start = time.perf_counter()
    spec.compile(backend=args.backend, cache_dir=args.cache_dir, on_miss=args.on_miss, regions=regions,
                 workers=args.workers)
    spec.generate(prompts, max_new_tokens=8, pad_token_id=0)
    total = time.perf_counter() - start
    metrics = {k: sum(v) for k, v in compilation_time_metrics.items()}  # a worker process's compile counts here too
    if args.on_miss == "background":  # the compile runs on after the first tokens: nothing of it was waited for
        metrics = {}
    events = spec.compiled_steps.events
    loaded = sum(s for _, how, s in events if how == "loaded")
    return {"total_s": total, "first_token_s": first_token[0] - start, "phases": phases_of(metrics, loaded, total),
            "events": [(str(k), how, s) for k, how, s in events], "metrics": metrics}


def spec_workers(args) -> int:
    """How many graphs compile at once in the measured process (``spec.compile``'s ``workers``)."""
    from dflash_compile.runtime.compile_workers import default_workers

    return args.workers or default_workers()


def run_worker(args, cache_dir: Path, on_miss: str = "compile") -> dict:
    cmd = [sys.executable, __file__, "--worker", "--target", args.target, "--draft", args.draft, "--backend",
           args.backend, "--batch", str(args.batch), "--max-seq-len", str(args.max_seq_len), "--cache-dir",
           str(cache_dir), "--on-miss", on_miss, "--speculation", args.speculation, "--regions", args.regions] + (
               ["--workers", str(args.workers)] if args.workers else [])
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None)
    p.add_argument("--draft", default=None)
    p.add_argument("--backend", default="dflash")
    p.add_argument("--pair", choices=("default", "tiny"), default="default",
                   help="without --target/--draft: the default (chat) pair or the tiny code pair")
    p.add_argument("--batch", type=int, default=1, help="max_batch_size: every batch bucket up to it is readied")
    p.add_argument("--speculation", default="auto", help='"auto" (the default path) or "fixed"')
    p.add_argument("--regions", choices=("auto", "on", "off"), default="auto",
                   help="the target's decoder layers as nested compile regions (auto: the wrapper's default)")
    p.add_argument("--scenarios", default="cold,warm,copied,background",
                   help="comma-separated subset of cold, warm, copied, background")
    p.add_argument("--tag", default="", help="suffix of the result files")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--workers", type=int, default=None,
                   help="graphs compiled at once in forked processes (spec.compile's workers; default: the library's)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--on-miss", default="compile", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.target is None:
        from dflash_compile.assets import default_pair_paths, tiny_pair_paths

        args.target, args.draft = (str(x) for x in (tiny_pair_paths() if args.pair == "tiny" else default_pair_paths()))
    if args.worker:
        print(json.dumps(worker(args)))
        return

    wanted = set(args.scenarios.split(","))
    names = {"cold": "cold", "warm": "warm", "copied": "copied", "background": "cold, background"}
    runs: dict[str, list[dict]] = {names[k]: [] for k in names if k in wanted}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            cache = Path(tmp) / f"cache{r}"
            if wanted & {"cold", "warm", "copied"}:
                cold = run_worker(args, cache)
                if "cold" in wanted:
                    runs["cold"].append(cold)
            if "warm" in wanted:
                runs["warm"].append(run_worker(args, cache))
            if "copied" in wanted:
                copied = Path(tmp) / f"copied{r}"
                shutil.copytree(cache, copied, ignore=shutil.ignore_patterns("inductor"))
                runs["copied"].append(run_worker(args, copied))
            if "background" in wanted:
                runs["cold, background"].append(run_worker(args, Path(tmp) / f"background{r}", "background"))
            print(f"round {r + 1}/{args.repeats}: " + ", ".join(
                f"{k} {v[-1]['total_s']:.1f} s" for k, v in runs.items()), flush=True)

    summary = {}
    for scenario, rs in runs.items():
        phases = {ph: statistics.median(r["phases"][ph] for r in rs) for ph in rs[0]["phases"]}
        summary[scenario] = {"total_s": statistics.median(r["total_s"] for r in rs), "phases_s": phases,
                             "totals_s": [r["total_s"] for r in rs],
                             "first_token_s": statistics.median(r["first_token_s"] for r in rs),
                             "first_tokens_s": [r["first_token_s"] for r in rs]}
    import torch
    import transformers

    result = {"backend": args.backend, "batch": args.batch, "max_seq_len": args.max_seq_len, "threads": args.threads,
              "target": Path(args.target).name, "speculation": args.speculation, "regions": args.regions,
              "repeats": args.repeats, "torch": torch.__version__, "transformers": transformers.__version__,
              "scenarios": summary, "runs": runs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"bench_compile{args.tag}.json").write_text(json.dumps(result, indent=1))
    first = next(iter(summary))
    graphs = [(k, how, round(sec, 1)) for k, how, sec in runs[first][0]["events"]]
    lines = [
        f"# Compile: `spec.compile()` to the first tokens ({Path(args.target).name}, backend `{args.backend}`, "
        f"batch sizes 1 to {args.batch}, speculation `{args.speculation}`, regions `{args.regions}`, "
        f"max_seq_len {args.max_seq_len}, {args.threads} thread(s), median of {args.repeats} fresh processes)",
        "",
        "Command: `python benchmarks/bench_compile.py " + " ".join(sys.argv[1:]) + "`",
        "",
        "| phase (s) | " + " | ".join(summary) + " |",
        "|---|" + "---|" * len(summary),
    ]
    for ph in summary[first]["phases_s"]:
        lines.append(f"| {ph} | " + " | ".join(f"{summary[s]['phases_s'][ph]:.2f}" for s in summary) + " |")
    lines.append("| **compile() to first tokens** | " + " | ".join(
        f"**{summary[s]['total_s']:.2f}**" for s in summary) + " |")
    lines.append("| compile() to the first token | " + " | ".join(
        f"{summary[s]['first_token_s']:.2f}" for s in summary) + " |")
    lines += ["", "Each run: " + "; ".join(f"{s} " + ", ".join(f"{t:.1f}" for t in summary[s]["totals_s"])
                                          for s in summary) + " s; to the first token: " + "; ".join(
                  f"{s} " + ", ".join(f"{t:.2f}" for t in summary[s]["first_tokens_s"]) for s in summary) + " s.",
              "", "\"First tokens\": every prompt's 8 new tokens; \"the first token\": the first new token handed to "
              "a caller (the prefill's, after every graph of the batch sizes is ready).",
              "", "The phases are summed over every process that compiled a graph. With one compile process they do "
              "not overlap and \"other\" is the wall time they do not cover (the prefill and the first step, writing "
              "the saved graph); with several (`workers`, here "
              f"{spec_workers(args)}) graphs compile at once and the phases add up to more than the wall time.", "",
              f"Graphs ({first}, first run): " + "; ".join(f"{k}: {how} {sec} s" for k, how, sec in graphs)]
    (out / f"bench_compile{args.tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
