"""Shared timing and reporting for the op benchmarks (``bench_<op>.py``)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).resolve().parents[1] / "build" / "inductor-cache"))

import torch  # noqa: E402


def median_ms(fn, repeats: int, device: str) -> tuple[float, float]:
    """(median of ``repeats`` timed calls, the first call — the compile for compiled functions), in ms."""

    def once():
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    first = once()
    return statistics.median(once() for _ in range(repeats)), first


def time_phases(spec) -> dict:
    """Wrap a compiled wrapper's step calls (``compiled_steps.run``) and admissions (``scheduler._admit``: the
    prefill and the drafter's first block) with timers. Returns the clock they add to, ``{"step": seconds,
    "steps": calls, "prefill": seconds}``; the caller resets it (``clock.update(step=0.0, steps=0, prefill=0.0)``)."""
    clock = {"step": 0.0, "steps": 0, "prefill": 0.0}

    def timed(name, fn):
        def call(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                clock[name] += time.perf_counter() - t0
                clock["steps"] += name == "step"
        return call

    spec.compiled_steps.run = timed("step", spec.compiled_steps.run)
    spec.scheduler._admit = timed("prefill", spec.scheduler._admit)
    return clock


def devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def machine() -> str:
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}{gpu}"


def markdown(title: str, rows: list[dict], extra: tuple[str, ...] = ()) -> str:
    """One table row per result: eager vs Inductor (and Triton on CUDA), with speed-ups and compile time."""
    head = ["device", "dtype", "B", *extra, "eager (ms)", "inductor (ms)", "triton (ms)", "inductor speed-up",
            "triton speed-up", "inductor compile (s)"]
    lines = [title, "", "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in rows:
        t = r.get("triton_ms")
        cells = [r["device"], r["dtype"], r["B"], *(r[k] for k in extra), f"{r['eager_ms']:.3f}",
                 f"{r['inductor_ms']:.3f}", f"{t:.3f}" if t else "n/a", f"{r['eager_ms'] / r['inductor_ms']:.2f}x",
                 f"{r['eager_ms'] / t:.2f}x" if t else "n/a", f"{r['inductor_compile_s']:.1f}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines) + "\n"


def report(name: str, args, rows: list[dict], title: str, extra: tuple[str, ...] = ()) -> None:
    """Write ``<out>/<name>.json`` and ``.md`` and print the table."""
    results = {"machine": machine(), "args": vars(args), "rows": rows}
    table = markdown(f"Machine: {results['machine']}. {title}", rows, extra)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / f"{name}.md").write_text(table)
    print(table)


def parser(doc: str) -> argparse.ArgumentParser:
    """The arguments every op benchmark takes; each adds its own shape arguments."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--hkv", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--out", default="benchmarks/results")
    return p


def run(name: str, bench, args, title: str, extra: tuple[str, ...] = ()) -> None:
    """``bench(device, args) -> rows`` on every device here, then :func:`report`."""
    torch.set_num_threads(args.threads)
    report(name, args, [row for device in devices() for row in bench(device, args)], title, extra)


def load_pair(target_dir=None, draft_dir=None):
    """``(target, drafter)`` in fp32, the target in eval mode: the shipped default pair unless directories are given."""
    from transformers import AutoModelForCausalLM

    from dflash_compile import DFlashDraftModel

    if target_dir is None:
        from dflash_compile.assets import default_pair_paths

        target_dir, draft_dir = default_pair_paths()
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    return target, DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32)
