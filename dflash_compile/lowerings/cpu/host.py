"""The host CPU as compiled code sees it: what code built here for this machine depends on."""

from __future__ import annotations

import functools
import hashlib
import platform


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as the OS lists them (``/proc/cpuinfo``; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line.split(":", 1)[1] for line in f if line.startswith(("flags", "Features"))),
                                  "").split())
    except OSError:
        return frozenset(platform.processor().split())


@functools.cache
def cpu_flags_digest() -> str:
    """A digest of the CPU's feature flags (the instruction sets code built with ``-march=native`` may use): the
    compile cache's device tag and the row_linear library's name carry it, so neither is reused on another CPU."""
    return hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:16]


def native_bf16() -> bool:
    """Whether the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX on x86, the BF16 extension on Arm). Without
    it torch's bf16 matrix products fall back to slow generic loops for some layouts."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16", "bf16"})
