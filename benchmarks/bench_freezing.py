"""Inductor's ``freezing`` for the DFlash step: the step time with it and without it.

    python benchmarks/bench_freezing.py [--batch 1] [--context 300] [--repeats 7]

The shipped pair, one CPU thread. The step is compiled twice through dynamo's ordinary path (freezing cannot be
saved by the ahead-of-time capture the wrapper uses), with the ``dflash`` backend and ``freezing`` on and off, and
the median over ``--repeats`` rounds of the mean of 30 calls is printed, the two interleaved. Dynamo hands the
parameters to the backend as graph inputs, so freezing can only fold the graph's own constants.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from _harness import load_pair
from dflash_compile import DFlashSpecWrapper
from dflash_compile.backends import dflash_backend
from dflash_compile.runtime.generation import resolve_generation_args


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    target, draft = load_pair()
    spec = DFlashSpecWrapper(target, draft, speculation="fixed", max_seq_len=1024, max_batch_size=args.batch)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 4000, (args.context,), generator=g).tolist() for _ in range(args.batch)]
    _, inputs = spec.scheduler.prefill_batch(prompts, resolve_generation_args(target, args.context, {"max_new_tokens": 8}))
    fns = {}
    with torch.no_grad():
        for name, freezing in (("freezing", True), ("no freezing", False)):
            def backend(gm, example_inputs, freezing=freezing):
                return dflash_backend(gm, example_inputs, {"freezing": freezing})

            fns[name] = torch.compile(spec.dflash_step.forward, backend=backend, fullgraph=True, dynamic=False)
            start = time.perf_counter()
            fns[name](*inputs)
            print(f"{name}: compiled in {time.perf_counter() - start:.1f} s", flush=True)
        times = {name: [] for name in fns}
        for _ in range(args.repeats):
            for name, fn in fns.items():
                start = time.perf_counter()
                for _ in range(30):
                    fn(*inputs)
                times[name].append((time.perf_counter() - start) / 30 * 1e3)
    print(f"batch {args.batch}, context {args.context}, ms per step: "
          + ", ".join(f"{n} {statistics.median(t):.3f}" for n, t in times.items()))


if __name__ == "__main__":
    main()
