"""One OpenMP team at a time: a thread that hands its steps to another releases its own idle team.

torch's CPU builds for Linux run their intra-op parallelism on GNU OpenMP (``libgomp``), which keeps a pool of
worker threads per thread that opened a parallel region, for the life of that thread. Once a process has more of
these workers than CPUs (the main thread's team plus the scheduler's, on a machine with as many cores as threads),
libgomp's workers spin only ~100 iterations before they sleep, so every parallel region of a step pays a futex
wake-up: a compiled step opens a few hundred regions, and at two threads on two cores SmolLM2's ``K = 0`` step
went from ~22-30 ms on the main thread to ~44 ms on the scheduler's (docs/benchmarks.md, "Threads").

``release_idle_team()`` frees the calling thread's own pool (OpenMP 5's ``omp_pause_resource_all``; libgomp pauses
the caller's pool only and makes it anew at the thread's next parallel region), so the thread that steps is the one
team in the process while the caller waits. Other OpenMP runtimes (LLVM's or Intel's ``libomp``) share one pool
between masters, and pausing it would stop the stepping thread's team too: there it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import os

_OMP_PAUSE_SOFT = 1


@functools.cache
def _pause_all():
    """libgomp's ``omp_pause_resource_all``, from the copy this process has loaded (torch's), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line}
    except OSError:  # not Linux
        return None
    for path in sorted(p for p in paths if os.path.basename(p).startswith("libgomp")):
        fn = getattr(ctypes.CDLL(path), "omp_pause_resource_all", None)
        if fn is not None:
            fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
            return fn
    return None


def release_idle_team() -> bool:
    """Free the calling thread's idle OpenMP workers (libgomp); -> whether a runtime that keeps them per thread
    took the call. Never call it inside a parallel region (libgomp refuses: False)."""
    fn = _pause_all()
    return fn is not None and fn(_OMP_PAUSE_SOFT) == 0
