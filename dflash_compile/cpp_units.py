"""One C++ build per graph for Inductor's CPU kernels under its Python wrapper.

Under Inductor's Python wrapper (the region graphs' wrapper: ``backends.REGION_CPU_INDUCTOR_OPTIONS``) every fused
CPU kernel of a graph is its own translation unit, built into its own shared object
(``async_compile.cpp_pybinding``). Each build parses Inductor's kernel prelude (``cpp_prefix.h``: ATen's vector
types; from a precompiled header, ~0.6 s on this project's 2-core CPU even for an empty kernel, ~1 s for a small
one), so a graph of 19 small kernels costs ~19 s of builds, most of it the same prelude again. Inside
:func:`one_unit_per_graph`, the kernels a generated module defines are collected instead and built together, once,
as one translation unit with a Python binding per kernel: each kernel's code in a namespace of its own
(``dflash_k<i>``), its ``#include`` lines hoisted, ``extern "C"`` dropped. The kernels' code is Inductor's, unchanged,
so the same kernels run; only the number of compiler runs changes.

Applies to what Inductor generates while the context is active, on this thread (a ``contextvars`` switch): the
DFlash backends' compiles (``backends._inductor``) and the loading of their saved graphs
(``CompiledSteps._load``), where the module runs its ``cpp_pybinding`` calls again and finds the built unit in
Inductor's cache under the same key, or directly through the record ``units_recorded_in`` keeps in the compile
cache's folder. A kernel whose code or argument types this module does not recognise keeps Inductor's own path; a
unit that fails to build is said once and its kernels are built one by one. Nothing changes for other
``torch.compile`` users of the process.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import logging
import re
import threading
from pathlib import Path

import torch
from torch._dynamo.aot_compile import atomic_write_binary
from torch._dynamo.utils import counters
from torch._inductor.async_compile import AsyncCompile
from torch._inductor.codecache import CppPythonBindingsCodeCache
from torch._inductor.runtime.cache_dir_utils import cache_dir
from torch._inductor.utils import clear_on_fresh_cache

log = logging.getLogger(__name__)
_said: set[str] = set()
_ACTIVE = contextvars.ContextVar("dflash_one_cpp_unit_per_graph", default=False)
_INDEX = contextvars.ContextVar("dflash_cpp_unit_index", default=None)
_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include\b[^\n]*$", re.M)
_ENTRY = re.compile(r'extern\s+"C"\s+(?:__declspec\(dllexport\)\s+)?void\s+kernel\s*\(')
#: scalar argument types the binding converts (the types Inductor's CPU kernels take besides pointers)
_SCALARS = {"int64_t": "PyLong_AsLongLong", "uintptr_t": "PyLong_AsVoidPtr", "float": "PyFloat_AsDouble",
            "double": "PyFloat_AsDouble"}


@contextlib.contextmanager
def one_unit_per_graph(enabled: bool = True):
    """While active on this thread, Inductor's CPU kernels of each generated Python-wrapper module build as one unit."""
    if enabled:
        install()
    token = _ACTIVE.set(enabled)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def units_recorded_in(index):
    """Units built on this thread meanwhile are recorded in directory ``index`` (their Inductor cache key and binary),
    and a unit found there is imported from its binary directly, without Inductor's check of its precompiled
    prelude (the preprocessor run over the prelude: ~0.25 s of every warm start). None: no record."""
    token = _INDEX.set(index)
    try:
        yield
    finally:
        _INDEX.reset(token)


def _scalar(argtype: str) -> str:
    return argtype.replace("const ", "").strip()


def batchable(argtypes, source: str) -> bool:
    """Whether a kernel's code and argument types are ones this module builds in a unit (else Inductor's path)."""
    if len(_ENTRY.findall(source)) != 1 or source.count('extern "C"') != 1:
        return False
    if "#define" in source or "#pragma once" in source:  # a macro would leak into the next kernel's code
        return False
    return all(t.strip().endswith("*") or _scalar(t) in _SCALARS for t in argtypes)


def _argument(argtype: str, n: int) -> str:
    t = _scalar(argtype)
    if t.endswith("*"):
        return f"static_cast<{t}>(dflash_tensor_data(PyTuple_GET_ITEM(args, {n})))"
    return f"dflash_scalar<{t}>(args, {n}, {_SCALARS[t]})"


_GLUE_HEAD = """
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cstdint>
#include <stdexcept>
#include <string>

// Set by _init() with the address of torch's tensor-to-data-pointer function (no PyTorch headers needed here).
static void* (*dflash_tensor_data)(PyObject*) = nullptr;

template <typename T, typename F>
static inline T dflash_scalar(PyObject* args, Py_ssize_t n, F convert) {
    auto value = convert(PyTuple_GET_ITEM(args, n));
    if (PyErr_Occurred()) [[unlikely]]
        throw std::runtime_error("argument " + std::to_string(n) + " has the wrong type");
    return (T)(value);
}

static PyObject* dflash_init(PyObject*, PyObject* address) {
    dflash_tensor_data = reinterpret_cast<void* (*)(PyObject*)>(PyLong_AsVoidPtr(address));
    if (PyErr_Occurred()) return nullptr;
    Py_RETURN_NONE;
}
"""

_GLUE_CALL = """
static PyObject* dflash_call_{i}(PyObject*, PyObject* args) {{
    try {{
        if (!PyTuple_CheckExact(args) || PyTuple_GET_SIZE(args) != {n}) [[unlikely]]
            throw std::runtime_error("kernel {i} takes a tuple of {n} arguments");
        dflash_k{i}::kernel({arguments});
        Py_RETURN_NONE;
    }} catch (std::exception const& e) {{
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    }} catch (...) {{
        PyErr_SetString(PyExc_RuntimeError, "kernel {i}: unknown C++ exception");
        return nullptr;
    }}
}}
"""


def unit_source(kernels: list[tuple[list[str], str]]) -> str:
    """One translation unit for ``kernels`` (``(argtypes, source)`` each, as ``cpp_pybinding`` gets them): their
    ``#include`` lines once, each kernel in namespace ``dflash_k<i>`` without ``extern "C"``, and a Python module
    ``dflash_kernels`` with ``k<i>`` calling kernel ``i`` and ``_init`` taking torch's data-pointer function."""
    includes, bodies = [], []
    for i, (_, source) in enumerate(kernels):
        for line in _INCLUDE.findall(source):
            if line.strip() not in includes:
                includes.append(line.strip())
        body = _INCLUDE.sub("", source).replace('extern "C"', "", 1)
        bodies.append(f"namespace dflash_k{i} {{\n{body}\n}}  // namespace dflash_k{i}\n")
    calls = [_GLUE_CALL.format(i=i, n=len(types), arguments=", ".join(_argument(t, n) for n, t in enumerate(types)))
             for i, (types, _) in enumerate(kernels)]
    methods = "".join(f'    {{"k{i}", dflash_call_{i}, METH_VARARGS, ""}},\n' for i in range(len(kernels)))
    return "\n".join(includes) + "\n" + "".join(bodies) + _GLUE_HEAD + "".join(calls) + f"""
static PyMethodDef dflash_methods[] = {{
    {{"_init", dflash_init, METH_O, ""}},
{methods}    {{nullptr, nullptr, 0, nullptr}}}};

static struct PyModuleDef dflash_module = {{PyModuleDef_HEAD_INIT, "dflash_kernels", nullptr, -1, dflash_methods}};

PyMODINIT_FUNC PyInit_dflash_kernels(void) {{ return PyModule_Create(&dflash_module); }}
"""


@clear_on_fresh_cache
class _UnitCache(CppPythonBindingsCodeCache):
    """Inductor's C++ build-and-load cache (key: the source and the build command) for our units: built like its
    kernels (same flags, the precompiled prelude), imported as the module ``dflash_kernels``."""

    cache: dict = {}
    entry_function = "dflash_kernels"

    @staticmethod
    def cache_clear() -> None:
        _UnitCache.cache.clear()


class _Unit:
    """The kernels one generated module defined, built together at its ``async_compile.wait`` (or first call)."""

    def __init__(self, index=None):
        self.kernels: list[tuple[list[str], str]] = []
        self.module = None
        self.lock = threading.Lock()
        self.index = index  # where built units are recorded (units_recorded_in)

    def function(self, index: int):
        with self.lock:
            if self.module is None:
                self.module = self._build()
        return getattr(self.module, f"k{index}")

    def _build(self):
        source = unit_source(self.kernels)
        try:
            module = recorded = _recorded(self.index, source)
            if module is None:
                module = _UnitCache.load(source, "cpu")
        except Exception as e:  # noqa: BLE001 - any build or import failure: Inductor's own path, said once
            if "unit" not in _said:
                _said.add("unit")
                log.warning("dflash: building a graph's %d C++ kernels as one unit failed (%s: %s); building them "
                            "one by one as Inductor does", len(self.kernels), type(e).__name__,
                            str(e).splitlines()[0][:300] if str(e) else "")
            counters["dflash"]["cpp_units_failed"] += 1
            return _OneByOne(self.kernels)
        module._init(torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr)
        if recorded is None:
            _record(self.index, source, module)
        counters["dflash"]["cpp_units"] += 1  # built or loaded from Inductor's cache
        counters["dflash"]["cpp_unit_kernels"] += len(self.kernels)
        return module


def _index_entry(index, source: str) -> Path:
    return Path(index) / f"{hashlib.sha256(source.encode()).hexdigest()[:32]}.json"


def _recorded(index, source: str):
    """The unit of ``source`` imported from the binary recorded in ``index`` (relative to Inductor's cache directory
    now in effect), or None (no index, no record, no binary there, or it does not import: Inductor's path then)."""
    if index is None:
        return None
    try:
        entry = json.loads(_index_entry(index, source).read_text())
        root = Path(cache_dir()).resolve()
        binary = (root / entry["binary"]).resolve()
        if not binary.is_file() or not binary.is_relative_to(root):
            return None
        return _UnitCache._load_library(str(binary), entry["key"])
    except (OSError, ValueError, KeyError, ImportError):
        return None


def _record(index, source: str, module) -> None:
    """Record in ``index`` where the unit of ``source`` was built (best effort: a read-only cache just goes
    unrecorded)."""
    if index is None:
        return
    try:
        binary = Path(module.__file__).resolve().relative_to(Path(cache_dir()).resolve())
        path = _index_entry(index, source)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_binary(str(path), json.dumps({"key": module.key, "binary": str(binary)}).encode())
    except (OSError, ValueError, AttributeError):
        pass


class _OneByOne:
    """The kernels of a unit that failed to build, each built and bound by Inductor (``k<i>`` as the unit has)."""

    def __init__(self, kernels):
        self.kernels = kernels

    def __getattr__(self, name: str):
        if not name.startswith("k") or not name[1:].isdigit():
            raise AttributeError(name)
        argtypes, source = self.kernels[int(name[1:])]
        fn = CppPythonBindingsCodeCache.load_pybinding(argtypes, source)
        setattr(self, name, fn)
        return fn


class _Pending:
    """What ``cpp_pybinding`` returns for a collected kernel until the module's ``wait`` swaps in the function."""

    __slots__ = ("unit", "index")

    def __init__(self, unit: _Unit, index: int):
        self.unit, self.index = unit, index

    def __call__(self, *args):
        return self.unit.function(self.index)(*args)


_inductor_cpp_pybinding = AsyncCompile.cpp_pybinding
_inductor_wait = AsyncCompile.wait


def _cpp_pybinding(self, argtypes, source_code):
    if not _ACTIVE.get() or not batchable(argtypes, source_code):
        return _inductor_cpp_pybinding(self, argtypes, source_code)
    unit = self.__dict__.get("_dflash_unit")
    if unit is None:
        unit = self.__dict__["_dflash_unit"] = _Unit(_INDEX.get())
    unit.kernels.append((list(argtypes), source_code))
    return _Pending(unit, len(unit.kernels) - 1)


def _wait(self, scope):
    unit = self.__dict__.pop("_dflash_unit", None)
    if unit is not None:
        for name, value in list(scope.items()):
            if isinstance(value, _Pending) and value.unit is unit:
                scope[name] = unit.function(value.index)
    return _inductor_wait(self, scope)


def install() -> None:
    """Route ``AsyncCompile`` through this module (idempotent; inert outside :func:`one_unit_per_graph`, which calls
    it)."""
    if AsyncCompile.cpp_pybinding is not _cpp_pybinding:
        AsyncCompile.cpp_pybinding = _cpp_pybinding
        AsyncCompile.wait = _wait
