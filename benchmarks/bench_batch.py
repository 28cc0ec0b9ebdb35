"""Tokens/s against batch size: does speculation ever cost? HF greedy, HF's compile path, and ours at fixed K = 7,
fixed K = 1 and ``speculation="auto"``, on three workloads, greedy.

    python benchmarks/bench_batch.py [--batch-sizes 1,2,4,8,16] [--threads 1,2] [--max-new 64] [--repeats 3] \\
        [--workloads humaneval,prose,mix] [--methods hf_greedy,...] [--cache-dir build/dflash-cache] [--out ...]

Workloads (every prompt cut to at most ``--max-prompt`` tokens):

- ``humaneval``: HumanEval prompts (what the shipped drafter was trained for: Python).
- ``prose``: paragraphs of English from the interpreter's own documentation topics (``pydoc_data.topics``; not in
  the training corpus, whose size limit leaves that file out): text the drafter was not trained for, so its
  acceptance is low (reported).
- ``mix``: the two interleaved in one queue, so one batch holds both kinds of request.

Batch size ``b``: a queue of ``max(2 b, 8)`` requests. Ours: ``b`` client threads share one wrapper (its continuous
batch; ``max_batch_size`` 16 for every ``b``, so one set of graphs serves them all), each submitting its next
request when the previous one is done, so at most ``b`` rows run at once. HF: the queue in left-padded groups of
``b`` (HF's ``generate`` has no continuous batching). Our wrappers are compiled (``dflash``) and precompiled into
``--cache-dir`` before anything is timed. Per (threads, workload, b), every method gets one untimed warm-up pass
(which also lets ``auto`` calibrate its step costs), then ``--repeats`` rounds each running every method once in
turn; each figure is the median over the rounds. Every output is checked token for token against
``target.generate`` greedy at batch 1.

Reported with the figures, to explain them: each workload's acceptance length (K = 7 and auto), the K auto chose
(share of steps per K), its K switches per 100 steps, the step graphs it may use, and its measured step costs per
(batch bucket, K). ``--dtype bf16`` (or ``both``) adds bfloat16 rows where the CPU has AMX tiles (elsewhere bf16
matmuls are slower than fp32, and the row says so): identity is then checked against HF's own bf16 greedy.

Writes ``bench_batch.{json,md,png}`` under ``--out``.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).resolve().parents[1] / "build" / "inductor-cache"))

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, CompileConfig  # noqa: E402

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper  # noqa: E402
from dflash_compile.runtime import openmp  # noqa: E402
from pairs import resolve_pair  # noqa: E402  (benchmarks/pairs.py)

METHODS = ("hf_greedy", "hf_compiled", "dflash_k7", "dflash_k1", "dflash_auto")
PEERS = ("hf_greedy", "hf_compiled")
OURS = ("dflash_k7", "dflash_k1", "dflash_auto", "dflash_k0")  # k0: plain decoding (bench_vllm.py)


# ---------------------------------------------------------------------------------------------- workloads
def prose_paragraphs(n: int) -> list[str]:
    """``n`` paragraphs of English prose from ``pydoc_data.topics`` (topics in sorted order; paragraphs of 200-700
    characters, mostly letters and spaces, no indented code)."""
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics):
        for para in re.split(r"\n\s*\n", topics[name]):
            text = " ".join(para.split())
            letters = sum(c.isalpha() or c == " " for c in text)
            if 200 <= len(text) <= 700 and not para.startswith(" ") and letters > 0.9 * len(text):
                out.append(text)
                if len(out) == n:
                    return out
    raise RuntimeError(f"pydoc_data.topics has only {len(out)} prose paragraphs, {n} wanted")


def workloads(names: list[str], n: int) -> dict[str, list[str]]:
    from dflash_compile.training.loops import humaneval_prompts

    code, prose = humaneval_prompts(0, n - 1), prose_paragraphs(n)
    every = {"humaneval": code, "prose": prose,
             "mix": [p for pair in zip(code[: (n + 1) // 2], prose[: (n + 1) // 2]) for p in pair][:n]}
    return {w: every[w] for w in names}


# ---------------------------------------------------------------------------------------------- methods
def _new_tokens(row: list[int], eos: int) -> list[int]:
    end = next((i + 1 for i, t in enumerate(row) if t == eos), len(row))
    return row[:end]


class Bench:
    def __init__(self, args, target, draft, tok, dtype, batch_sizes):
        self.args, self.target, self.draft, self.tok, self.dtype = args, target, draft, tok, dtype
        self.eos, self.pad = tok.eos_token_id, tok.pad_token_id
        self.gen = dict(do_sample=False, max_new_tokens=args.max_new, eos_token_id=self.eos, pad_token_id=self.pad)
        self.cache_len = -(-(args.max_prompt + args.max_new) // 128) * 128
        cc = CompileConfig(fullgraph=True)
        cc._compile_all_devices = True  # else HF's generate compiles only on cuda/xpu/neuron/tpu
        self.compile_config = cc
        self.specs = {}
        self.clocks = {}
        policies = {"dflash_k7": dict(num_speculative_tokens=7), "dflash_k1": dict(num_speculative_tokens=1),
                    "dflash_auto": dict(speculation="auto"), "dflash_k0": dict(num_speculative_tokens=0)}
        for m in OURS:
            if m in args.methods:
                spec = DFlashSpecWrapper(target, draft, **policies[m], max_batch_size=16,
                                         max_seq_len=self.cache_len)
                spec.compile(backend="dflash", cache_dir=args.cache_dir)
                t0 = time.perf_counter()
                # every bucket up to the largest batch: a draining queue steps at the smaller ones
                report = spec.precompile([b for b in spec.batch_buckets if b <= max(batch_sizes)], progress=False)
                print(f"{m} ({dtype}): {len(report)} step graphs ready in {time.perf_counter() - t0:.1f} s "
                      f"({Counter(h for h, _ in report.values())})", flush=True)
                self.specs[m] = spec

    def clock(self, method: str) -> dict:
        """The phase clock of ``method``'s wrapper (``_harness.time_phases``), made at its first call."""
        if method not in self.clocks:
            from _harness import time_phases

            self.clocks[method] = time_phases(self.specs[method])
        return self.clocks[method]

    def ids(self, texts: list[str]) -> list[list[int]]:
        return [self.tok(t)["input_ids"][-self.args.max_prompt:] for t in texts]

    def run_hf(self, prompts: list[list[int]], b: int, compiled: bool) -> tuple[list[list[int]], dict]:
        extra = dict(cache_implementation="static", max_cache_len=self.cache_len,
                     compile_config=self.compile_config) if compiled else {}
        out = []
        for i in range(0, len(prompts), b):
            group = prompts[i:i + b]
            width = max(map(len, group))
            ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            seqs = self.target.generate(input_ids=ids, attention_mask=mask, **self.gen, **extra)
            out += [_new_tokens(r, self.eos) for r in seqs[:, width:].tolist()]
        return out, {}

    def run_ours(self, method: str, prompts: list[list[int]], b: int) -> tuple[list[list[int]], dict]:
        spec = self.specs[method]
        results: list = [None] * len(prompts)
        cursor = iter(range(len(prompts)))
        lock = threading.Lock()
        errors = []

        def client():
            try:
                while True:
                    with lock:
                        i = next(cursor, None)
                    if i is None:
                        return
                    results[i] = spec.submit(prompts[i], max_new_tokens=self.args.max_new, eos_token_id=self.eos,
                                             pad_token_id=self.pad).result()
            except BaseException as e:  # reported in the caller's thread
                errors.append(e)

        clients = [threading.Thread(target=client) for _ in range(b)]
        openmp.release_idle_team()  # this thread ran HF's method: its OpenMP team would be a second one (openmp.py)
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        if errors:
            raise errors[0]
        ks = [k for r in results for k in r.stats.step_ks]
        drafts = sum(r.stats.num_drafts for r in results)
        per_pos = [0] * max((len(r.stats.num_accepted_tokens_per_pos) for r in results), default=0)
        for r in results:
            for i, a in enumerate(r.stats.num_accepted_tokens_per_pos):
                per_pos[i] += a
        info = {"steps": len(ks), "k_share": {k: n / len(ks) for k, n in sorted(Counter(ks).items())},
                "acceptance_length": 1 + sum(r.stats.num_accepted_tokens for r in results) / drafts if drafts else 1.0,
                "per_position": [a / drafts for a in per_pos] if drafts else [],
                "switches_per_100_steps": 100 * _switches(results) / max(1, len(ks))}
        return [r.tokens for r in results], info

    def run(self, method: str, prompts: list[list[int]], b: int):
        t0 = time.perf_counter()
        if method in PEERS:
            rows, info = self.run_hf(prompts, b, method == "hf_compiled")
        else:
            rows, info = self.run_ours(method, prompts, b)
        return time.perf_counter() - t0, rows, info


def _switches(results) -> int:
    """K changes between a request's consecutive steps (the batch's K, seen from each of its rows), summed."""
    return sum(sum(a != b for a, b in zip(r.stats.step_ks, r.stats.step_ks[1:])) for r in results)


def has_amx() -> bool:
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------- main loop
@torch.no_grad()
def run(args) -> dict:
    target_dir, draft_dir = resolve_pair(args.target, args.draft, args.pair_revision)
    tok = AutoTokenizer.from_pretrained(target_dir)
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",")})
    threads = sorted({int(t) for t in args.threads.split(",")})
    n_max = max(max(2 * b, 8) for b in batch_sizes)
    texts = workloads(names, n_max)
    dtypes = {"fp32": ["fp32"], "bf16": ["bf16"], "both": ["fp32", "bf16"]}[args.dtype]
    results = {"machine": f"{platform.machine()}, torch {torch.__version__}, transformers {transformers.__version__}",
               "args": vars(args), "amx": has_amx(), "rows": [], "auto": {}, "notes": []}
    for dtype_name in dtypes:
        if dtype_name == "bf16" and not has_amx():
            results["notes"].append("bf16 not timed: this CPU has no AMX tiles (no amx_bf16 in /proc/cpuinfo), where "
                                    "bf16 matmuls are slower than fp32")
            results["bf16_identity"] = bf16_identity(args, target_dir, draft_dir, tok, texts, batch_sizes)
            continue
        dtype = torch.float32 if dtype_name == "fp32" else torch.bfloat16
        target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype, attn_implementation="sdpa").eval()
        draft = DFlashDraftModel.from_pretrained(draft_dir, dtype=dtype)
        bench = Bench(args, target, draft, tok, dtype_name, batch_sizes)
        prompts = {w: bench.ids(t) for w, t in texts.items()}
        reference = {}  # target.generate greedy, batch 1, per prompt (in this dtype)
        for w, ps in prompts.items():
            for p in ps:
                if tuple(p) not in reference:
                    seq = target.generate(torch.tensor([p]), **bench.gen)
                    reference[tuple(p)] = _new_tokens(seq[0, len(p):].tolist(), bench.eos)
        for t in threads:
            torch.set_num_threads(t)
            for w in names:
                for b in batch_sizes:
                    queue = prompts[w][: max(2 * b, 8)]
                    refs = [reference[tuple(p)] for p in queue]
                    cell = {m: {"seconds": [], "identical": None, "info": {}} for m in args.methods}
                    for rnd in range(args.repeats + 1):  # round 0: the untimed warm-up
                        for m in args.methods:
                            seconds, rows, info = bench.run(m, queue, b)
                            if rnd == 0:
                                cell[m]["identical"] = sum(r == ref for r, ref in zip(rows, refs))
                                cell[m]["tokens"] = sum(map(len, rows))
                            else:
                                cell[m]["seconds"].append(seconds)
                                cell[m]["info"] = info
                    for m, c in cell.items():
                        s = statistics.median(c["seconds"])
                        row = {"dtype": dtype_name, "threads": t, "workload": w, "batch": b, "method": m,
                               "requests": len(queue), "tokens": c["tokens"], "seconds": s,
                               "tok_s": c["tokens"] / s, "runs": c["seconds"],
                               "identical": f"{c['identical']}/{len(queue)}", **c["info"]}
                        results["rows"].append(row)
                    line = ", ".join(f"{m} {c['tokens'] / statistics.median(c['seconds']):.0f}" for m, c in cell.items())
                    print(f"{dtype_name} threads {t} {w} batch {b}: tok/s {line}", flush=True)
            if "dflash_auto" in bench.specs:
                policy = bench.specs["dflash_auto"].policy
                results["auto"][f"{dtype_name}, {t} thread(s)"] = {
                    "graphs": [list(g) for g in bench.specs["dflash_auto"].step_graphs()],
                    "graph_count_per_bucket": len(bench.specs["dflash_auto"].step_graphs()),
                    "costs": policy.costs.table()}
                policy.costs.cells.clear()  # the next thread count measures its own
    return results


def bf16_identity(args, target_dir, draft_dir, tok, texts, batch_sizes) -> list[dict]:
    """Without AMX, bf16 is not worth timing, but whether its greedy output equals HF's own bf16 greedy still is:
    a compiled K = 7 wrapper (its verify scores K + 1 tokens in one forward where HF scores one) on every workload's
    queue at the smallest and the largest batch size, against ``target.generate`` bf16 at batch 1. Per prompt:
    identical or not, and where not, the first new token that differs."""
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    draft = DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.bfloat16)
    margs = argparse.Namespace(**{**vars(args), "methods": ("dflash_k7",)})
    bench = Bench(margs, target, draft, tok, "bf16", batch_sizes)
    out = []
    for w, t in texts.items():
        prompts = bench.ids(t)
        refs = [_new_tokens(target.generate(torch.tensor([p]), **bench.gen)[0, len(p):].tolist(), bench.eos)
                for p in prompts]
        for b in sorted({min(batch_sizes), max(batch_sizes)}):
            queue = prompts[: max(2 * b, 8)]
            _, rows, _ = bench.run("dflash_k7", queue, b)
            first = [next((i for i, (x, y) in enumerate(zip(r, ref)) if x != y), min(len(r), len(ref)))
                     for r, ref in zip(rows, refs) if r != ref]
            out.append({"workload": w, "batch": b, "requests": len(queue),
                        "identical": sum(r == ref for r, ref in zip(rows, refs)), "first_difference_at": first})
            print(f"bf16 identity {w} batch {b}: {out[-1]}", flush=True)
    return out


# ---------------------------------------------------------------------------------------------- report
def _ratio_table(rows, dtype, t, names, batch_sizes) -> list[str]:
    get = {(r["workload"], r["batch"], r["method"]): r for r in rows if r["dtype"] == dtype and r["threads"] == t}
    head = ["workload", "batch", *[m for m in METHODS if any(k[2] == m for k in get)], "auto / best peer",
            "auto / best fixed K", "auto: K share", "acceptance (K=7 / auto)"]
    out = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for w in names:
        for b in batch_sizes:
            cells = [w, str(b)]
            for m in head[2:-4]:
                r = get.get((w, b, m))
                cells.append(f"{r['tok_s']:.0f}" + ("" if r["identical"].split("/")[0] == r["identical"].split("/")[1]
                                                    else f" ({r['identical']} identical)") if r else "")
            auto = get.get((w, b, "dflash_auto"))
            peers = [get[(w, b, m)]["tok_s"] for m in PEERS if (w, b, m) in get]
            fixed = [get[(w, b, m)]["tok_s"] for m in ("dflash_k7", "dflash_k1") if (w, b, m) in get]
            cells.append(f"{auto['tok_s'] / max(peers):.2f}x" if auto and peers else "")
            cells.append(f"{auto['tok_s'] / max(fixed):.2f}x" if auto and fixed else "")
            cells.append(", ".join(f"K{k}: {v:.0%}" for k, v in auto["k_share"].items()) if auto else "")
            k7 = get.get((w, b, "dflash_k7"))
            cells.append(f"{k7['acceptance_length']:.2f} / {auto['acceptance_length']:.2f}" if k7 and auto else "")
            out.append("| " + " | ".join(cells) + " |")
    return out


def markdown(results) -> str:
    a = results["args"]
    rows = results["rows"]
    names = list(dict.fromkeys(r["workload"] for r in rows))
    batch_sizes = sorted({r["batch"] for r in rows})
    lines = [f"# Tokens/s against batch size ({results['machine']})", "",
             f"Command: `python benchmarks/bench_batch.py --batch-sizes {a['batch_sizes']} --threads {a['threads']} "
             f"--max-new {a['max_new']} --repeats {a['repeats']} --dtype {a['dtype']}`", "",
             f"Greedy, up to {a['max_new']} new tokens per request, prompts cut to {a['max_prompt']} tokens; a queue of "
             f"max(2 b, 8) requests per batch size b; median of {a['repeats']} interleaved rounds after one untimed "
             "warm-up pass. Ours: b client threads on one compiled wrapper (continuous batch). tok/s; a cell says how "
             "many outputs were identical to `target.generate` greedy at batch 1 when not all were.", ""]
    for note in results["notes"]:
        lines += [f"Note: {note}.", ""]
    if results.get("bf16_identity"):
        lines += ["bf16 greedy (compiled, K = 7) against HF's own bf16 greedy at batch 1, per request (untimed):", "",
                  "| workload | batch | identical | where not: index of the first new token that differs |",
                  "|---|---|---|---|"]
        lines += [f"| {r['workload']} | {r['batch']} | {r['identical']}/{r['requests']} | "
                  f"{r['first_difference_at'] or ''} |" for r in results["bf16_identity"]]
        lines.append("")
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        for t in sorted({r["threads"] for r in rows}):
            lines += [f"## {dtype}, {t} thread(s)", ""] + _ratio_table(rows, dtype, t, names, batch_sizes) + [""]
            auto = results["auto"].get(f"{dtype}, {t} thread(s)")
            sw = [r["switches_per_100_steps"] for r in rows
                  if r["dtype"] == dtype and r["threads"] == t and r["method"] == "dflash_auto"]
            if auto:
                lines += [f"auto: {auto['graph_count_per_bucket']} step graphs per batch bucket (K, proposes): "
                          f"{auto['graphs']}; K switches per 100 steps (seen per request): median "
                          f"{statistics.median(sw):.1f}, max {max(sw):.1f}.", "",
                          "auto's measured step cost (ms, median of its last timed calls) per batch bucket and K "
                          "(proposing), at the context bins it met:", "",
                          "| bucket | context bin | " + " | ".join(f"K{k}" for k in range(8)) + " | K0 + proposal |",
                          "|---" * 11 + "|"]
                by = {}
                for c in auto["costs"]:
                    by.setdefault((c["bucket"], c["context_bin"]), {})[(c["k"], c["propose"])] = c["seconds"] * 1e3
                for (bucket, ctx), d in sorted(by.items()):
                    cells = [f"{d[(k, k > 0)]:.2f}" if (k, k > 0) in d else "" for k in range(8)]
                    prop = d.get((0, True))
                    lines.append(f"| {bucket} | {2 ** (ctx - 1) + 1}-{2 ** ctx} pages | " + " | ".join(cells)
                                 + f" | {prop:.2f} |" if prop else f"| {bucket} | {2 ** (ctx - 1) + 1}-{2 ** ctx} "
                                 f"pages | " + " | ".join(cells) + " | |")
                lines.append("")
    return "\n".join(lines) + "\n"


def plot(results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["rows"] if r["dtype"] == "fp32"] or results["rows"]
    names = list(dict.fromkeys(r["workload"] for r in rows))
    threads = sorted({r["threads"] for r in rows})
    fig, axes = plt.subplots(len(threads), len(names), figsize=(4.5 * len(names), 3.6 * len(threads)), squeeze=False)
    for i, t in enumerate(threads):
        for j, w in enumerate(names):
            ax = axes[i][j]
            for m in METHODS:
                pts = sorted((r["batch"], r["tok_s"]) for r in rows if r["threads"] == t and r["workload"] == w
                             and r["method"] == m)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=m, linestyle="--" if m in PEERS else "-")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{w}, {t} thread(s)")
            ax.set_xlabel("batch size")
            ax.set_ylabel("tokens/s")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target")
    p.add_argument("--draft")
    p.add_argument("--pair-revision", help="the default pair as committed at this git revision")
    p.add_argument("--batch-sizes", default="1,2,4,8,16")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--workloads", default="humaneval,prose,mix")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", choices=("fp32", "bf16", "both"), default="both")
    p.add_argument("--cache-dir", default=str(Path(__file__).resolve().parents[1] / "build" / "dflash-cache"))
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default="bench_batch", help="output files: NAME.{json,md,png}")
    args = p.parse_args()
    args.methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; choose from {list(METHODS)}")
    results = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / f"{args.name}.md").write_text(markdown(results))
    if results["rows"]:
        plot(results, out / f"{args.name}.png")
    print(markdown(results))


if __name__ == "__main__":
    main()
