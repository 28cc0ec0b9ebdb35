"""Inductor's C++ build options for the CPU step: the compile time and the step time they give.

    python benchmarks/bench_cpu_options.py [--batches 1 8] [--context 500] [--repeats 7]

The shipped pair, one CPU thread. Compiles the step of each batch size twice, each into an empty compile cache:
with the C++ wrapper built as one translation unit with a precompiled header (Inductor's defaults with
``cpp_wrapper``), and as the ``dflash`` backend builds it (``backends.CPU_INDUCTOR_OPTIONS``: wrapper and kernels
as two units compiled in parallel, no precompiled header). Prints each compile's seconds and the median step time
over ``--repeats`` rounds of 20 calls, the two interleaved.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from _harness import load_pair
from dflash_compile import DFlashSpecWrapper
from dflash_compile.runtime.compiled_steps import CompiledSteps
from dflash_compile.runtime.generation import resolve_generation_args

VARIANTS = {
    "one unit, precompiled header": {"cpp_wrapper_build_separate": False, "cpp_cache_precompile_headers": True},
    "dflash (two units, no header)": {},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--context", type=int, default=500)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    target, draft = load_pair()
    spec = DFlashSpecWrapper(target, draft, speculation="fixed", max_batch_size=max(args.batches),
                             max_seq_len=2048)
    steps = {name: CompiledSteps(spec, "dflash", cache_dir=tempfile.mkdtemp(), options=options)
             for name, options in VARIANTS.items()}
    g = torch.Generator().manual_seed(0)
    for batch in args.batches:
        spec.scheduler = type(spec.scheduler)(spec)
        spec.compiled_steps = next(iter(steps.values()))  # compiled: pools at capacity
        prompts = [torch.randint(10, 1000, (args.context,), generator=g).tolist() for _ in range(batch)]
        gen = resolve_generation_args(target, args.context, {"max_new_tokens": 8})
        bucket, inputs = spec.scheduler.prefill_batch(prompts, gen)
        keys = {}
        for name, s in steps.items():
            keys[name] = s.key(bucket, inputs[2].shape[1], False, spec.verify_len)
            how, seconds = s.prepare(keys[name], inputs, {})
            print(f"batch {batch}, {name}: {how} in {seconds:.1f} s", flush=True)
        times = {name: [] for name in steps}
        with torch.no_grad():
            for name, s in steps.items():
                s.run(keys[name], inputs, {})
            for _ in range(args.repeats):
                for name, s in steps.items():
                    start = time.perf_counter()
                    for _ in range(20):
                        s.run(keys[name], inputs, {})
                    times[name].append((time.perf_counter() - start) / 20 * 1e3)
        print(f"batch {batch}, step ms: " + ", ".join(f"{n} {statistics.median(t):.3f}" for n, t in times.items()),
              flush=True)


if __name__ == "__main__":
    main()
