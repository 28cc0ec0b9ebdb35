"""Inductor's options for the CPU step: the compile time and the step time they give, side by side.

    python benchmarks/bench_cpu_options.py [--set build|asserts|regions|draft-regions] [--pair default|tiny]
        [--batches 1 8] [--k 7]
        [--context 500] [--repeats 7]

The shipped pair (``--pair tiny``: the tiny code pair), one CPU thread, ``speculation="fixed"`` at ``--k`` (a plain step, no proposal, at 0). Compiles the
step of each batch size once per variant of the ``--set``, each into an empty compile cache, prints the seconds of
each variant's first step (its compile included; the first variant's also packs the weights) and the median step
time over ``--repeats`` rounds of 20 calls, the variants interleaved. Sets:

- ``build``: the C++ wrapper built as one translation unit with a precompiled header (Inductor's defaults with
  ``cpp_wrapper``), as two units each from a precompiled header, and the ``dflash`` backend's build
  (``backends.CPU_INDUCTOR_OPTIONS``: wrapper and kernels as two units compiled in parallel, no precompiled
  header). A precompiled header is built once per machine (and set of flags), outside the compile cache: run twice
  to time the compiles that find it built. Graphs without nested compile regions (the target's
  layers inline: ``regions=False``).
- ``asserts``: a graph with regions (Python wrapper) with Inductor's size, stride and scalar asserts on, against
  the backend's default without them (``backends.REGION_CPU_INDUCTOR_OPTIONS``).
- ``regions``: the target's decoder layers as nested compile regions (Inductor's Python wrapper, its kernels one C++
  unit: ``cpp_units.py``) against inline (the C++ wrapper), each with the backend's options.
- ``draft-regions``: with the target's layers as regions, the drafter's layers as a region too (the default
  wherever the target's are) against inline in the step graph.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from _harness import load_pair
from bench_step import step_inputs
from dflash_compile import DFlashSpecWrapper

#: each set's variants: name -> (Inductor options, regions; "target": the target's layers alone as regions)
SETS = {
    "build": {"one unit, precompiled header": ({"cpp_wrapper_build_separate": False,
                                                 "cpp_cache_precompile_headers": True}, False),
              "two units, precompiled headers": ({"cpp_cache_precompile_headers": True}, False),
              "dflash (two units, no header)": ({}, False)},
    "asserts": {"with size and scalar asserts": ({"size_asserts": True, "scalar_asserts": True}, True),
                "dflash (without them)": ({}, True)},
    "regions": {"layers as regions": ({}, True), "layers inline": ({}, False)},
    "draft-regions": {"drafter's layers as a region": ({}, True), "drafter's layers inline": ({}, "target")},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", choices=sorted(SETS), default="build")
    p.add_argument("--pair", choices=("default", "tiny"), default="default")
    p.add_argument("--reverse", action="store_true",
                   help="build the variants in the reverse order (the first wrappers built in a process have been "
                        "seen to step slower: compare both orders)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--k", type=int, default=None, help="the fixed K (default: the drafter's block size - 1)")
    p.add_argument("--context", type=int, default=500)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.pair == "tiny":
        from dflash_compile.assets import tiny_pair_paths

        target, draft = load_pair(*tiny_pair_paths())
    else:
        target, draft = load_pair()
    k = draft.block_size - 1 if args.k is None else args.k
    variants = dict(reversed(SETS[args.set].items())) if args.reverse else SETS[args.set]
    for batch in args.batches:
        specs = {}
        for name, (options, regions) in variants.items():
            spec = DFlashSpecWrapper(target, draft, k, speculation="fixed", max_batch_size=batch,
                                     batch_buckets=(batch,), max_seq_len=2048)
            spec.compile(backend="dflash", cache_dir=tempfile.mkdtemp(), options=options, regions=bool(regions))
            if regions == "target":  # the classes marked while the step is traced: the target's alone
                keys = spec.compiled_steps.keys
                keys.region_types = [k for k in keys.region_types if k not in {type(m) for m in draft.layers}]
            inputs = step_inputs(spec, batch, args.context)
            start = time.perf_counter()
            with torch.no_grad():
                spec.step(*inputs, propose=k > 0)
            print(f"batch {batch}, K {k}, {name}: first step (compile included) in {time.perf_counter() - start:.1f} s",
                  flush=True)
            specs[name] = (spec, inputs)
        times = {name: [] for name in specs}
        with torch.no_grad():
            for spec, inputs in specs.values():
                for _ in range(3):
                    spec.step(*inputs, propose=k > 0)
            for _ in range(args.repeats):
                for name, (spec, inputs) in specs.items():
                    start = time.perf_counter()
                    for _ in range(20):
                        spec.step(*inputs, propose=k > 0)
                    times[name].append((time.perf_counter() - start) / 20 * 1e3)
        print(f"batch {batch}, K {k}, step ms (median of {args.repeats} rounds of 20 calls): "
              + ", ".join(f"{n} {statistics.median(t):.3f}" for n, t in times.items()), flush=True)


if __name__ == "__main__":
    main()
