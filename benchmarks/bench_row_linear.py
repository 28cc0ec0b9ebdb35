"""The CPU lowering's ``row_linear`` kernel against MKL's fp32 linear, and the compiled step with it and without it.

    python benchmarks/bench_row_linear.py [--rows 1 2 3 4 8 9 16] [--ks 0 1 3 7] [--repeats 7] [--no-step]

1. The op alone: every linear of SmolLM2-135M-Instruct's 30 layers and its vocabulary projection, each with
   weights of its own (538 MB: streamed from memory, as in a step), random values, one call of each per pass; the
   median over ``--repeats`` passes of ``dflash_cpu.row_linear`` and of ``F.linear``, interleaved, per row count.
   A third column: the op on the same weights made GGUF-valued (quantised as the real file is, Q4_1 layers and a
   Q8_0 head, and dequantised to fp32 as transformers loads it), which it reads as block codes up to 4 rows.
   Against two floors: reading the fp32 weights once at the rate of a 512 MB tensor's sum here, and the pass's
   multiply-adds at the best fp32 rate this core reaches at all (MKL's square products of 1024 and 2048, its most
   favourable shapes): no fp32 kernel does a pass in less than the larger of the two.
2. The default pair's compiled step (SmolLM2 and its drafter, batch 1, a 128-token prompt): compiled with the
   kernel and with ``DFLASH_ROW_LINEAR=0`` (``aten.linear`` kept), each K timed through the same graphs (K = 0: the
   plain step, no proposal), the two wrappers interleaved; ms per step, median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # q k v o gate up down


def _as_gguf(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """The same weights as the GGUF file of SmolLM2-135M-Instruct holds such values, as transformers loads them:
    each layer's linears quantised to Q4_1 and the vocabulary projection to Q8_0 by the gguf package, then
    dequantised to fp32 (row_linear reads such weights as block codes for up to 4 rows)."""
    import gguf

    out = []
    for w in weights:
        kind = gguf.GGMLQuantizationType.Q8_0 if w.shape[0] == 49152 else gguf.GGMLQuantizationType.Q4_1
        q = gguf.quants.quantize(w.numpy(), kind)
        out.append(torch.from_numpy(gguf.quants.dequantize(q, kind).reshape(w.shape).copy()))
    return out


def best_gemm_gflops(repeats: int) -> float:
    """The best fp32 rate of this core (GFLOP/s): MKL's square products of 1024 and 2048, best of ``repeats``."""
    best = 0.0
    for n in (1024, 2048):
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            best = max(best, 2 * n**3 / (time.perf_counter() - t0) / 1e9)
    return best


def read_gbps(repeats: int, nbytes: int = 512 << 20) -> float:
    """This machine's memory read rate (GB/s) for a stream like a pass's: the sum of a 512 MB fp32 tensor (a read
    and a vector add per 8 values), best of ``repeats``."""
    src = torch.ones(nbytes // 4)
    src.sum()
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        src.sum()
        best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def op_table(rows: list[int], repeats: int) -> list[dict]:
    from dflash_compile.lowerings.cpu import row_linear

    assert row_linear.load(), "the row_linear kernel could not be built here"
    op = torch.ops.dflash_cpu.row_linear
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g) for _ in range(30) for n, k in SHAPES]
    weights.append(torch.randn(49152, 576, generator=g))
    coded = _as_gguf(weights)
    params = sum(w.numel() for w in weights)
    gflops, gbps = best_gemm_gflops(repeats), read_gbps(repeats)
    print(f"this core: {gflops:.1f} GFLOP/s fp32 at best (MKL, square 1024/2048 products), memory read {gbps:.1f} GB/s "
          "(sum of 512 MB)", flush=True)
    out = []
    for m in rows:
        xs = {k: torch.randn(m, k, generator=g) for k in (576, 1536)}

        def one_pass(fn):
            t0 = time.perf_counter()
            for w in weights:
                fn(xs[w.shape[1]], w)
            return time.perf_counter() - t0

        def coded_pass():
            t0 = time.perf_counter()
            for w in coded:
                op(xs[w.shape[1]], w)
            return time.perf_counter() - t0

        times = {"mkl": [], "row_linear": [], "row_linear_gguf": []}
        one_pass(torch.nn.functional.linear), one_pass(op), coded_pass()  # warm-up (and packing)
        for _ in range(repeats):
            times["mkl"].append(one_pass(torch.nn.functional.linear))
            times["row_linear"].append(one_pass(op))
            times["row_linear_gguf"].append(coded_pass())
        err = max((op(xs[w.shape[1]], w) - torch.nn.functional.linear(xs[w.shape[1]], w)).abs().max().item()
                  for w in weights[:7] + weights[-1:])
        r = {"rows": m, **{k: statistics.median(v) * 1e3 for k, v in times.items()}, "max_abs_diff": err}
        r["speedup"] = r["mkl"] / r["row_linear"]
        r["gguf_forms"] = sorted({torch.ops.dflash_cpu.row_linear_packed_form(w) for w in coded})
        r["best_gflops"], r["read_gbps"] = gflops, gbps
        r["compute_floor"] = 2 * m * params / gflops / 1e6  # ms: the multiply-adds at the core's best rate
        r["stream_floor"] = 4 * params / gbps / 1e6  # ms: the fp32 weights read once
        print(f"rows {m:2d}: MKL {r['mkl']:.1f} ms, row_linear {r['row_linear']:.1f} ms ({r['speedup']:.2f}x), "
              f"GGUF-valued weights {r['row_linear_gguf']:.1f} ms ({r['gguf_forms']}), max |diff| {err:.1e}; "
              f"floors: read {r['stream_floor']:.1f} ms, multiply-adds {r['compute_floor']:.1f} ms", flush=True)
        out.append(r)
    return out


def step_table(ks: list[int], repeats: int) -> list[dict]:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_step import step_inputs
    from transformers import AutoModelForCausalLM

    from dflash_compile import DFlashDraftModel, DFlashSpecWrapper
    from dflash_compile.assets import default_pair_paths

    t, d = default_pair_paths()
    target = AutoModelForCausalLM.from_pretrained(t, dtype=torch.float32).eval()
    draft = DFlashDraftModel.from_pretrained(d, dtype=torch.float32)
    specs, inputs = {}, {}
    cache = Path(tempfile.mkdtemp(prefix="bench_row_linear-"))
    saved = os.environ.get("DFLASH_ROW_LINEAR")
    for name, flag in (("row_linear", "1"), ("aten.linear", "0")):
        os.environ["DFLASH_ROW_LINEAR"] = flag
        spec = DFlashSpecWrapper(target, draft, speculation="fixed", max_batch_size=1, max_seq_len=512)
        spec.compile(backend="dflash", fullgraph=True, cache_dir=cache / name)
        block, *rest = step_inputs(spec, 1, 128)
        with torch.no_grad():
            for k in ks:  # compiles the K = 0 graph (plain decoding, no proposal) and the one graph of every K >= 1
                t0 = time.perf_counter()
                spec.step(block[:, : k + 1].contiguous(), *rest, propose=k > 0)
                print(f"{name}: K {k} first call {time.perf_counter() - t0:.1f} s", flush=True)
        from torch._dynamo.utils import counters

        print(f"{name}: linears lowered to row_linear so far: {counters['dflash_lowering']['row_linear']}", flush=True)
        specs[name], inputs[name] = spec, (block, rest)
    if saved is None:
        os.environ.pop("DFLASH_ROW_LINEAR", None)
    else:
        os.environ["DFLASH_ROW_LINEAR"] = saved
    out = []
    for k in ks:
        times = {name: [] for name in specs}
        with torch.no_grad():
            for _ in range(repeats):
                for name, spec in specs.items():
                    block, rest = inputs[name]
                    args = (block[:, : k + 1].contiguous(), *rest)
                    spec.step(*args, propose=k > 0)  # warm
                    t0 = time.perf_counter()
                    spec.step(*args, propose=k > 0)
                    times[name].append(time.perf_counter() - t0)
        r = {"K": k, **{n: statistics.median(v) * 1e3 for n, v in times.items()}}
        print(f"step K {k}: row_linear {r['row_linear']:.1f} ms, aten.linear {r['aten.linear']:.1f} ms "
              f"({r['aten.linear'] / r['row_linear']:.2f}x)", flush=True)
        out.append(r)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 9, 16])
    p.add_argument("--ks", type=int, nargs="+", default=[0, 1, 3, 7])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--no-step", action="store_true", help="the op alone, not the compiled step")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_row_linear.json"))
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    result = {"threads": torch.get_num_threads(), "op": op_table(args.rows, args.repeats)}
    if not args.no_step:
        result["step"] = step_table(args.ks, args.repeats)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    Path(args.out).with_suffix(".md").write_text(markdown(result))


def markdown(result: dict) -> str:
    lines = [f"`benchmarks/bench_row_linear.py`, {result['threads']} thread(s), fp32, median of the interleaved "
             "passes.",
             "", ("Every linear of SmolLM2-135M-Instruct (30 layers and the vocabulary projection, 538 MB, random "
                  "weights, streamed from memory), ms per pass:"), "",
             "| rows | MKL (`F.linear`) | `row_linear` | speed-up | max abs diff | `row_linear`, the same weights "
             "GGUF-valued (Q4_1 layers, Q8_0 head) | forms packed | floor: read the fp32 weights | "
             "floor: multiply-adds |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['rows']} | {r['mkl']:.1f} | {r['row_linear']:.1f} | {r['speedup']:.2f}x | "
              f"{r['max_abs_diff']:.1e} | {r['row_linear_gguf']:.1f} | {', '.join(r['gguf_forms'])} | "
              f"{r['stream_floor']:.1f} | {r['compute_floor']:.1f} |" for r in result["op"]]
    r0 = result["op"][0]
    lines += ["", f"Floors: the fp32 weights read once at {r0['read_gbps']:.1f} GB/s (the best sum of 512 MB "
              f"here), and the pass's multiply-adds at {r0['best_gflops']:.1f} GFLOP/s (MKL's best, square 1024 and "
              "2048 products): a pass takes at least the larger."]
    if "step" in result:
        lines += ["", "The default pair's compiled step, batch 1, 128-token prompt, ms per step:", "",
                  "| K | `row_linear` | `aten.linear` (`DFLASH_ROW_LINEAR=0`) | speed-up |", "|---|---|---|---|"]
        lines += [f"| {r['K']} | {r['row_linear']:.1f} | {r['aten.linear']:.1f} | "
                  f"{r['aten.linear'] / r['row_linear']:.2f}x |" for r in result["step"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
