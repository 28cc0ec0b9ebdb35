"""Loading a saved graph without importing what its generated module names but does not call.

Every Python module Inductor generates starts with ``from torch._inductor.select_algorithm import extern_kernels``
and ``from torch._inductor.codegen.memory_planning import _align as align``; a saved graph's compile options pickle
``torch._inductor.decomposition.select_decomp_table``; its post-compile imports ``torch._inductor.graph`` to read a
test hook. In a process that has not compiled anything (a warm start: every graph comes from the compile cache)
those imports pull in Inductor's lowering table and its kernel templates (jinja sources compiled at import): 2.6 s
of a 6.9 s warm start at batch 16 under cProfile, for names a CPU step graph without extern kernels or a memory
pool never calls.

``deferred_imports()`` is the window in which ``CompiledSteps._load`` imports a saved graph: each of those modules
not imported yet is a stand-in in ``sys.modules`` (and on its package). On the loading thread its deferred names
are proxies that import the real module the first time they are used (an attribute read, a call); every other
name, and every name read on another thread, is the real module's, imported then. Leaving the window takes the
stand-ins out (a later ``import`` gets the real module), unless the real module replaced them meanwhile. A module
already imported is left as it is: in a process that compiles, nothing changes.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
import types

# module -> {name: the attributes it is known to have while the module is not imported (None: none)}
DEFERRED = {
    "torch._inductor.select_algorithm": {"extern_kernels": None},  # generated code
    "torch._inductor.codegen.memory_planning": {"_align": None},  # generated code
    "torch._inductor.decomposition": {"select_decomp_table": None},  # pickled in a saved graph's compile options
    # a loaded graph's post-compile reads this test hook, which nothing can have set before the module is imported
    "torch._inductor.graph": {"GraphLowering": {"save_output_code": None}},
}

_lock = threading.RLock()


class StandIn(types.ModuleType):
    """A module not imported yet. The thread that placed it reads the deferred names as ``Deferred`` proxies; any
    other name, and every name another thread reads (a background compile importing Inductor meanwhile gets the
    real classes and functions), imports the module and reads it there."""

    def __init__(self, name: str, deferred: dict[str, "Deferred"]):
        super().__init__(name)
        self._dflash_owner = threading.get_ident()
        self._dflash_deferred = deferred

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        proxy = self._dflash_deferred.get(name)
        if proxy is not None and threading.get_ident() == self._dflash_owner and sys.modules.get(self.__name__) is self:
            return proxy
        return getattr(real_module(self.__name__), name)


class Deferred:
    """``module.name`` until it is first used; then that object's attributes and calls. ``known`` attributes are
    answered without the import while the module is not imported (values nothing can have changed yet)."""

    __slots__ = ("_module", "_name", "_known")

    def __init__(self, module: str, name: str, known: dict | None = None):
        self._module, self._name, self._known = module, name, known or {}

    def resolve(self):
        return getattr(real_module(self._module), self._name)

    def __getattr__(self, attr):
        if attr.startswith("__") or attr in Deferred.__slots__:  # protocol lookups (copy, pickle), unset slots
            raise AttributeError(attr)
        if attr in self._known and isinstance(sys.modules.get(self._module), StandIn):
            return self._known[attr]
        return getattr(self.resolve(), attr)

    def __call__(self, *args, **kwargs):
        return self.resolve()(*args, **kwargs)

    def __repr__(self):
        return f"<deferred {self._module}.{self._name}>"


def _parent(name: str):
    package, _, child = name.rpartition(".")
    return sys.modules.get(package), child


def real_module(name: str) -> types.ModuleType:
    """The module ``name`` itself, imported now if a stand-in holds its place."""
    with _lock:
        have = sys.modules.get(name)
        if isinstance(have, StandIn):
            del sys.modules[name]
            parent, child = _parent(name)
            if parent is not None and getattr(parent, child, None) is have:
                delattr(parent, child)
        return importlib.import_module(name)


@contextlib.contextmanager
def deferred_imports():
    """Stand-ins for the modules of ``DEFERRED`` not imported yet, while the block runs (see the module's doc)."""
    placed = []
    # a compiled graph's call reads torch._inductor.debug's switches, a module torch._inductor.graph imports (cheap)
    importlib.import_module("torch._inductor.debug")
    with _lock:
        for name, names in DEFERRED.items():
            if name in sys.modules:
                continue
            importlib.import_module(name.rpartition(".")[0])  # the package (cheap) is imported for real
            stand_in = StandIn(name, {n: Deferred(name, n, known) for n, known in names.items()})
            sys.modules[name] = stand_in
            parent, child = _parent(name)
            setattr(parent, child, stand_in)
            placed.append((name, stand_in))
    try:
        yield
    finally:
        with _lock:
            for name, stand_in in placed:
                if sys.modules.get(name) is stand_in:
                    del sys.modules[name]
                parent, child = _parent(name)
                if parent is not None and getattr(parent, child, None) is stand_in:
                    delattr(parent, child)
