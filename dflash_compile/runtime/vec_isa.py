"""Inductor's vector-ISA probe, run once per machine instead of once per process and Inductor cache.

Before Inductor generates CPU code it picks the widest vector ISA the CPU reports and checks that the compiler
builds, and the process loads, code for it: a test program compiled into Inductor's cache, then loaded by a child
Python (``torch._inductor.cpu_vec_isa.VecISA.check_build``). Every process that compiles pays the loading child
(0.7 s on this project's 2-core AVX2 machine), and the test program's build (3.6 s) wherever the Inductor cache in
effect at the first check lacks it: the compile cache keeps Inductor's cache per folder, so a probe inside a new
folder built it again. Forked compile workers each probed, on the critical path of their graph.

What the probe establishes depends on the machine, not the folder: the CPU's feature flags, the compiler and torch.
A probe that passed is recorded once per machine, under Inductor's default cache directory (where it also keeps
the precompiled prelude, which every folder shares), keyed by those three; a process that finds the record tells
Inductor the check passed (``cpp.vec_isa_ok``, as a warm load does with the folder's own record). A probe that
found no ISA is not recorded: such a machine probes again next time, and Inductor builds scalar code, as before.
The further checks some ISAs make after theirs passed (AVX-512's BF16 and VNNI instructions, AMX) still run.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
from pathlib import Path

import torch


@functools.cache
def _machine_key() -> str:
    from torch._inductor.cpp_builder import get_compiler_version_info, get_cpp_compiler

    from ..lowerings.cpu.host import cpu_flags_digest

    compiler = get_cpp_compiler()
    parts = [torch.__version__, platform.machine(), cpu_flags_digest(), compiler, get_compiler_version_info(compiler)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def machine_record() -> Path:
    """This machine's record of a passed probe (for this torch and compiler)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return Path(default_cache_dir()) / "dflash_vec_isa" / f"{_machine_key()}.json"


def passed_here() -> bool:
    """Whether a probe passed on this machine, with this torch and compiler, in an earlier process."""
    try:
        return bool(json.loads(machine_record().read_text()).get("isa"))
    except (OSError, ValueError):
        return False


def trusted():
    """While open, Inductor takes the ISA it picks as checked when this machine's record says so (else it probes as
    it would)."""
    if not passed_here():
        return contextlib.nullcontext()
    return torch._inductor.config.patch({"cpp.vec_isa_ok": True})


def picked() -> str:
    """The ISA Inductor builds CPU kernels for here ("" for none), probing it unless already known."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    with trusted():
        isa = pick_vec_isa()
        return str(isa) if isa else ""


def probe() -> str:
    """Run the probe now unless this machine's record has it, and record a pass: before forking compile workers,
    so that they inherit the result instead of each compiling the test program. Returns the ISA ("" for none)."""
    isa = picked()
    if isa and not passed_here():
        _record(isa)
    return isa


def _record(isa: str) -> None:
    path = machine_record()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"isa": isa, "torch": torch.__version__}))
        os.replace(tmp, path)
    except OSError:  # a read-only cache: the probe simply runs again next time
        pass
