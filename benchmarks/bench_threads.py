"""The compiled step at one thread and at the default thread count, side by side in one process.

    python benchmarks/bench_threads.py [--pair chat|tiny] [--cases 1:0 1:7 8:0] [--threads 1 2] [--rounds 7]
        [--calls 10] [--on main worker released] [--name NAME]

A CPU step graph is guarded on the intra-op thread count, so each count gets a wrapper of its own (compiled or
loaded from ``build/bench-threads-cache``), over the same pair. A case ``B:K`` is a wrapper with one batch bucket
``B`` and ``speculation="fixed"`` at ``K``, its step inputs made by its own admission of ``B`` random 200-token
prompts (``bench_step.step_inputs``). A round times ``--calls`` step calls at each thread count in turn (after one
untimed call), so every count meets the same machine; the figure is the median over ``--rounds`` rounds, ms per
step. The default ``--threads`` is 1 and torch's default count here (all cores).

``--on`` says which Python thread calls the step, each a row of its own: ``main`` (the process's main thread),
``worker`` (one long-lived other thread while the main thread keeps its idle OpenMP team: how ``generate`` and the
server stepped before ``runtime/openmp.py``) and ``released`` (the worker, after the main thread released its team,
as the scheduler's callers now do).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def case_times(target, draft, batch: int, k: int, threads: list[int], rounds: int, calls: int,
               on: str = "main") -> dict[int, list]:
    from bench_step import step_inputs
    from dflash_compile import DFlashSpecWrapper
    from dflash_compile.runtime import openmp

    wrappers = {}
    for n in threads:
        torch.set_num_threads(n)
        spec = DFlashSpecWrapper(target, draft, speculation="fixed", num_speculative_tokens=k, max_batch_size=batch,
                                 batch_buckets=(batch,))
        spec.compile(backend="dflash", cache_dir=REPO / "build" / "bench-threads-cache")
        inputs = step_inputs(spec, batch, 200)
        for _ in range(3):  # compiles or loads the graph
            spec.step(*inputs, propose=k > 0)
        wrappers[n] = (spec, inputs)

    def timed(n: int) -> float:
        torch.set_num_threads(n)
        spec, inputs = wrappers[n]
        with torch.no_grad():
            spec.step(*inputs, propose=k > 0)
            t0 = time.perf_counter()
            for _ in range(calls):
                spec.step(*inputs, propose=k > 0)
        return (time.perf_counter() - t0) / calls * 1e3

    def on_worker(n: int) -> float:
        if on == "released":
            openmp.release_idle_team()
        return worker.submit(timed, n).result()

    times = {n: [] for n in threads}
    with ThreadPoolExecutor(max_workers=1) as worker:  # one thread for every call, as the scheduler's
        for _ in range(rounds):
            for n in threads:
                times[n].append(timed(n) if on == "main" else on_worker(n))
    return times


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", choices=("chat", "tiny"), default="chat")
    p.add_argument("--cases", nargs="+", default=["1:0", "1:7", "8:0"])
    p.add_argument("--threads", type=int, nargs="+", default=None)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--on", nargs="+", choices=("main", "worker", "released"), default=["main"],
                   help="the thread that calls the step: the main one, another one while the main one keeps its "
                   "OpenMP team, another one after it released it (a row each)")
    p.add_argument("--name", default=None)
    args = p.parse_args(argv)
    threads = args.threads or sorted({1, torch.get_num_threads()})
    from transformers import AutoModelForCausalLM

    from dflash_compile import DFlashDraftModel
    from dflash_compile.assets import chat_pair_paths, tiny_pair_paths

    t, d = tiny_pair_paths() if args.pair == "tiny" else chat_pair_paths()
    target = AutoModelForCausalLM.from_pretrained(t, dtype=torch.float32).eval()
    draft = DFlashDraftModel.from_pretrained(d, dtype=torch.float32)
    rows = []
    for case in args.cases:
        batch, k = (int(x) for x in case.split(":"))
        for on in args.on:
            times = case_times(target, draft, batch, k, threads, args.rounds, args.calls, on)
            med = {n: statistics.median(v) for n, v in times.items()}
            rows.append({"batch": batch, "k": k, "on": on, "ms": med, "runs": times})
            print(f"batch {batch} K {k} on the {on} thread: " + ", ".join(
                f"{n} thread(s) {m:.2f} ms" for n, m in med.items()), flush=True)
    name = args.name or f"bench_threads-{args.pair}"
    out = REPO / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"args": vars(args), "threads": threads, "rows": rows}, indent=1))
    head = "| batch | K | called on | " + " | ".join(f"{n} thread(s), ms" for n in threads) + " | " + " | ".join(
        f"{n} / {threads[0]}" for n in threads[1:]) + " |"
    lines = [f"`python benchmarks/bench_threads.py --pair {args.pair} --cases {' '.join(args.cases)} --rounds "
             f"{args.rounds} --calls {args.calls} --on {' '.join(args.on)}`: the compiled step, ms, median of "
             f"{args.rounds} interleaved rounds", "", head, "|" + "---|" * (3 + 2 * len(threads) - 1)]
    for r in rows:
        m = r["ms"]
        lines.append(f"| {r['batch']} | {r['k']} | {r['on']} thread | " + " | ".join(f"{m[n]:.2f}" for n in threads)
                     + " | " + " | ".join(f"{m[n] / m[threads[0]]:.2f}x" for n in threads[1:]) + " |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
