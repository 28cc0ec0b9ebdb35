"""``torch.ops.dflash_cpu.row_linear``: fp32 CPU linears with few rows, at the rate the weights stream from memory;
and the library of the project's C++ CPU kernels it lives in.

The library (``row_linear.cpp`` and ``block_attention.cpp``, the paged attention the CPU lowering of
``dflash::block_attention`` calls for fp32) is built once per machine on first use, with the host compiler for the
host CPU, through ``torch.utils.cpp_extension`` (ninja), into a cache folder of its own (``build_dir``); later
processes load the built library in milliseconds. ``load()`` returns whether its ops are registered; when it cannot
be built (no compiler, a build error) it says why once in the log and returns False, and the CPU lowerings then keep
``aten.linear`` (``backends.row_linears``) and the ATen form of the attention (``block_attention.py``).

The op computes ``F.linear(x, weight, bias)``. For fp32 CPU inputs with ``MIN_ROWS`` to ``MAX_ROWS`` rows (``x``'s
leading dimensions flattened) it streams a packed copy of the weight once and multiplies each loaded vector by every
input row, in fp32 with another summation order than MKL's (equal to rounding, not bit for bit; a row's result does
not depend on the thread count or on the other rows); anything else goes to ``at::linear`` itself. A weight whose
values are exactly block-quantised ones (a model loaded from a GGUF file of type Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1) is
read by calls of up to 4 rows from a second copy, int8 codes with a scale and offset per block of 32 (the same fp32
values rebuilt in registers, so the same results, from a third of the bytes); ``DFLASH_ROW_LINEAR_CODES=0`` turns
that off. Memory: the packed copy of each weight it has multiplied, as large as the weight, and the codes copy
(0.31x) of such a weight, kept while the weight lives and made again when the weight changes in place
(``packed_weights()`` reports them, ``torch.ops.dflash_cpu.row_linear_packed_form(w)`` says which a weight has).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import torch

from .host import cpu_flags_digest

log = logging.getLogger(__name__)

#: The row counts the kernel of its own runs (outside them, ``at::linear``). On this project's CPU, every linear of
#: SmolLM2-135M streamed from memory once (538 MB), ``benchmarks/bench_row_linear.py``'s op table, ms, MKL / kernel:
#: one thread, 1 row 37.5 / 23.8, 8 rows 81.2 / 38.3, 16 rows 107.8 / 61.5, 32 rows 175 / 117, 64 rows 303 / 207, 128
#: rows 498 / 411; two threads, 1 row 37.2 / 16.5, 8 rows 77.8 / 23.9, 64 rows 192 / 122, 128 rows 276 / 223. More
#: than 128 rows (not measured here: a prefill, which runs eagerly) stay MKL's. A row's result is the same at every
#: row count from 1 to 128 (batch 1 or 8, a verified block or one token), not bit for bit HF's own.
MIN_ROWS, MAX_ROWS = 1, 128
SOURCES = tuple(Path(__file__).with_name(name) for name in ("row_linear.cpp", "block_attention.cpp"))
HEADERS = (Path(__file__).with_name("simd.h"),)  # included by the sources: part of the library's name
_lock = threading.Lock()
_state: dict = {}


def build_dir() -> Path:
    """Where the library is built: ``$DFLASH_EXTENSIONS_DIR``, else ``$XDG_CACHE_HOME/dflash_compile/extensions``
    (``~/.cache`` without it), one folder per source, torch version and CPU (the build targets the host CPU). Not
    the compile cache, which tests and users move per run: the library does not depend on any model."""
    if os.environ.get("DFLASH_EXTENSIONS_DIR"):
        return Path(os.environ["DFLASH_EXTENSIONS_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash_compile" / "extensions"


def _cflags() -> list[str]:
    # DFLASH_ROW_LINEAR_CFLAGS adds compiler flags (the tests build the AVX2 form on an AVX-512 machine with
    # "-mno-avx512f", in a process of its own)
    # -fopenmp: at::parallel_for is a header template whose `omp parallel` is compiled into this library; without
    # the flag it ran every call on one thread whatever torch.set_num_threads said
    return ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", f"-DDFLASH_ROW_LINEAR_MIN_ROWS={MIN_ROWS}",
            f"-DDFLASH_ROW_LINEAR_MAX_ROWS={MAX_ROWS}", *os.environ.get("DFLASH_ROW_LINEAR_CFLAGS", "").split()]


def library_name() -> str:
    sources = b"".join(src.read_bytes() for src in SOURCES + HEADERS)
    digest = hashlib.sha256(sources + torch.__version__.encode() + cpu_flags_digest().encode()
                            + " ".join(_cflags()).encode()).hexdigest()[:12]
    return f"dflash_row_linear_{digest}"


def load() -> bool:
    """Register ``torch.ops.dflash_cpu.row_linear`` (building it first if this machine has not): True when it is
    registered, False (said once) when it cannot be built."""
    with _lock:
        if "ok" in _state:
            return _state["ok"]
        if hasattr(torch.ops, "dflash_cpu") and all(hasattr(torch.ops.dflash_cpu, op)
                                                    for op in ("row_linear", "block_attention")):
            _state["ok"] = True
            return True
        try:
            from torch.utils import cpp_extension

            name = library_name()
            directory = build_dir() / name
            directory.mkdir(parents=True, exist_ok=True)
            if not any(directory.glob("*.so")):
                log.warning("dflash: building the CPU kernels for this machine (once, ~20 s) in %s", directory)
            if (directory / "lock").exists():  # torch's build lock: it waits while the file exists, without a word
                log.warning("dflash: %s exists: another process is building the CPU kernels, or a build was killed "
                            "(then remove that file); waiting for it", directory / "lock")
            cpp_extension.load(name=name, sources=[str(src) for src in SOURCES], build_directory=str(directory),
                               extra_cflags=_cflags(), extra_ldflags=["-fopenmp"],
                               is_python_module=False, verbose=bool(os.environ.get("DFLASH_VERBOSE_BUILD")))
            _state["ok"] = True
        except Exception as e:  # no compiler or ninja, a build error: the lowerings keep their ATen forms
            log.warning("dflash: the CPU kernels could not be built (%s: %s); CPU step graphs keep aten.linear and "
                        "the ATen form of block_attention", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            _state["ok"] = False
        return _state["ok"]


def packed_weights() -> tuple[int, int]:
    """The packed weight copies the kernel holds now: ``(copies, bytes)``; a copy whose weight is gone counts until
    the next call that packs a weight drops it ((0, 0) when the kernel is not loaded)."""
    if not load():
        return 0, 0
    n, nbytes = torch.ops.dflash_cpu.row_linear_packed_weights()
    return int(n), int(nbytes)


def prepack(*modules: torch.nn.Module) -> threading.Thread | None:
    """Pack, on a helper thread, the weight of every ``nn.Linear`` in ``modules`` that the op takes (fp32, CPU,
    contiguous), in both forms (the codes form when the weight has one), as its first calls would: the graphs of a step call the op with the parameters themselves, so
    the copies are found there, and a warm start's first step does not pack every weight itself (SmolLM2-135M's
    538 MB: ~0.45 s of the first step). The op runs without the GIL and packs on the helper thread alone, so this
    overlaps the loading of the saved graphs (Python). A weight the step packs first is not packed twice (the op's
    cache is locked); a weight changed afterwards is packed again by its next call. None when the kernel is off or
    not built, or no weight qualifies; else the started (daemon) thread."""
    weights = {id(m.weight): m.weight for module in modules for m in module.modules()
               if isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"}
    if not weights or not enabled() or not load():  # (no CPU fp32 weight: the library is not even built)
        return None

    def work():
        with torch.no_grad():
            for weight in weights.values():
                torch.ops.dflash_cpu.row_linear_prepack(weight)

    thread = threading.Thread(target=work, name="dflash-prepack", daemon=True)
    thread.start()
    return thread


def enabled() -> bool:
    """False when ``DFLASH_ROW_LINEAR=0`` switches the kernel off (the CPU lowering then keeps ``aten.linear``)."""
    return os.environ.get("DFLASH_ROW_LINEAR", "1") != "0"


def attention_enabled() -> bool:
    """False when ``DFLASH_CPU_ATTENTION=0`` switches the C++ paged attention off (the CPU lowering of
    ``block_attention`` then keeps its ATen form)."""
    return os.environ.get("DFLASH_CPU_ATTENTION", "1") != "0"


def state() -> str:
    """What CPU step graphs call for fp32 linears and attention here: the library's name (it names the sources,
    torch and CPU it was built for) and which of its ops are off, or why neither is called (part of the compile
    cache's fingerprint)."""
    if not load():
        return "unavailable"
    off = [name for name, on in (("row_linear", enabled()), ("attention", attention_enabled())) if not on]
    return library_name() + "".join(f" {name} off" for name in off)


__all__ = ["MIN_ROWS", "MAX_ROWS", "SOURCES", "load", "enabled", "attention_enabled", "state", "packed_weights",
           "prepack", "build_dir", "library_name"]
