"""The host CPU as compiled code sees it: what code built here for this machine depends on."""

from __future__ import annotations

import functools
import hashlib
import platform


@functools.cache
def cpu_flags_digest() -> str:
    """A digest of the CPU's feature flags (the instruction sets code built with ``-march=native`` may use): the
    compile cache's device tag and the row_linear library's name carry it, so neither is reused on another CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1] for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = platform.processor()
    return hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:16]
