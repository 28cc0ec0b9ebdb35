"""Compiled step graphs: one per step key, compiled once, saved, and loaded by every later process.

``spec.compile(backend=...)`` gives the wrapper a ``CompiledSteps``. The host loop asks it for the step of a key
(batch bucket, verify length, greedy or sampled, and for static-context backends the context pages). A key it
has not met is loaded from the compile cache, or else traced once with dynamo's ahead-of-time capture
(``torch.compile(...).forward.aot_compile``: one full graph, handed to the backend) and saved there. What is saved
is torch's own artefact (``AOTCompiledFunction``: the guards, the bytecode that calls the graph, and the
backend's compiled code — for Inductor-based backends the bundled AOTAutograd/Inductor output, kernels
included), so a second process skips dynamo, the DFlash passes, AOTAutograd and Inductor alike.

One graph serves every context length on backends that compile dynamic shapes (``dflash``, ``inductor``): the
block tables' page dimension is marked dynamic, from 2 pages to the capacity, and attention walks exactly the
pages a step hands it. ``dflash_neuron`` compiles static graphs (NEFFs are static): there the context bucket is
part of the key.

The cache. A directory (``cache_dir=``; else ``$DFLASH_COMPILE_CACHE_DIR``; else ``$XDG_CACHE_HOME/dflash_compile`` or
``~/.cache/dflash_compile``) with one folder per fingerprint — torch, transformers and Python versions, this package's
source, the backend and its options, torch's compiler settings (``compiler_settings``), both models' configs and
parameter shapes and dtypes, the wrapper's pool geometry, the device (CPU: the architecture, ATen's CPU capability, the
CPU's feature flags and the intra-op thread count; CUDA: the GPU's name and capability) — and one file per key, plus
``inductor/``: Inductor's own cache while it compiles or loads a step (the C++/Triton binaries a saved graph loads), so
that a copy of the directory carries them (``$DFLASH_INDUCTOR_CACHE_DIR``: one Inductor cache for every compile
cache). The weights' values are not in the fingerprint: the graphs read the parameters at every call, so a pair with
other weights of the same shapes reuses them. Each file carries its key and a SHA-256 of the payload; an entry that is
corrupted, truncated, for another key or rejected by its own guards is ignored with one warning line and compiled
again (and rewritten). Only backends given by name are cached on disk; a backend callable is compiled in memory.

A key with no graph yet does what ``on_miss`` says: compile it now (default), run the eager step, compile it on a
background thread while the eager step serves, or raise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import hashlib
import io
import json
import logging
import os
import pickle
import platform
import re
import sys
import threading
import time
from pathlib import Path

import torch

from . import vec_isa
from .compile_workers import check_workers, compile_in_workers, default_workers, parallel_workers
from .regions import compile_regions
from .step_keys import StepKey, StepKeys, size_oblivious

log = logging.getLogger(__name__)

CACHE_DIR_ENV = "DFLASH_COMPILE_CACHE_DIR"
INDUCTOR_DIR_ENV = "DFLASH_INDUCTOR_CACHE_DIR"
ON_MISS = ("compile", "eager", "background", "error")
STATIC_CONTEXT_BACKENDS = ("dflash_neuron",)
OWN_BACKENDS = ("dflash", "dflash_neuron")  # this package's (entry points in pyproject.toml)
_MAGIC = b"DFLASHSTEP1\n"
_TRACING = threading.Lock()  # dynamo traces one graph at a time, process-wide


def default_cache_dir() -> Path:
    """``$DFLASH_COMPILE_CACHE_DIR``, else ``$XDG_CACHE_HOME/dflash_compile``, else ``~/.cache/dflash_compile``."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dflash_compile"


def inductor_cache_dir(cache_dir: Path) -> Path:
    """Inductor's own cache for the graphs of compile cache ``cache_dir`` (generated code, the C++/Triton binaries a
    saved graph loads, AOTAutograd's and Inductor's graph caches): ``cache_dir/inductor``, so that a copy of the
    compile cache carries its binaries; or ``$DFLASH_INDUCTOR_CACHE_DIR``, one Inductor cache for every compile
    cache of the process (a graph compiled for one cache is then not code-generated or built again for another:
    Inductor's caches are keyed by the graph, its inputs and the compiler's settings)."""
    shared = os.environ.get(INDUCTOR_DIR_ENV)
    return Path(shared) if shared else cache_dir / "inductor"


def package_sources() -> list[Path]:
    """Every source file of the package, Python and the C++ kernels (and their headers), in a fixed order."""
    root = Path(__file__).parents[1]
    return sorted([*root.rglob("*.py"), *root.rglob("*.cpp"), *root.rglob("*.h")])


@functools.cache
def _package_source_hash() -> str:
    """SHA-256 of this package's sources (``package_sources``): any change to the step, the passes or the lowerings
    changes it."""
    root = Path(__file__).parents[1]
    h = hashlib.sha256()
    for path in package_sources():
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _device_tag(device: torch.device) -> str:
    from ..lowerings.cpu.host import cpu_flags_digest

    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}:{torch.cuda.get_device_capability(device)}"
    if device.type == "cpu":  # the instruction sets the compiled C++ may use: the CPU's feature flags
        return f"cpu:{platform.machine()}:{torch.backends.cpu.get_cpu_capability()}:{cpu_flags_digest()}"
    return device.type


def _config_json(config) -> str:
    """A config's values, without where it was loaded from (the same model in another directory, or on another
    machine, is the same model)."""
    values = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    values.pop("_name_or_path", None)
    return json.dumps(values, sort_keys=True, default=repr)


def _module_signature(module: torch.nn.Module) -> list:
    """Every parameter and buffer: name, shape, dtype, strides, device. The fingerprint holds it, and a key's first
    call checks it again (``_parameters_changed``) in place of dynamo's tensor guards on parameters
    (``step_guards``)."""
    return [(name, tuple(p.shape), str(p.dtype), tuple(p.stride()), str(p.device))
            for name, p in module.state_dict(keep_vars=True).items()]


def step_guards(entries, parameters: bool = False) -> list[bool]:
    """The guards a saved step keeps: torch's portable ones (tensor metadata, global state such as grad mode, the
    dynamic-shape ranges), less (``parameters=False``) the tensor guards on the models' parameters, a few hundred of
    them (most of the 653 tensor guards of SmolLM2's two graphs), whose building was most of a graph's load (loading
    SmolLM2's two saved graphs 1.18 -> 0.43 s without them, ``bench_compile``): the fingerprint names the
    folder after every parameter's shape, dtype, strides and device, and ``run`` checks them before a key's first
    call in a process. Steps without a folder (a backend callable) and tensor-parallel steps (their parameters are
    DTensors) keep them (``parameters=True``)."""
    keep = torch.compiler.keep_portable_guards_unsafe(entries)
    return [k and (parameters or not (e.guard_type == "TENSOR_MATCH" and isinstance(e.value, torch.nn.Parameter)))
            for k, e in zip(keep, entries)]


def fingerprint(spec, backend: str, mode, options: dict, regions: bool = False) -> dict:
    """Everything a saved step graph depends on, as a JSON-able dict (its hash names the cache folder)."""
    import transformers

    p = next(spec.target.parameters())
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": list(sys.version_info[:2]),
        "dflash_compile": _package_source_hash(),
        "backend": backend,
        "mode": mode,
        "options": {k: repr(v) for k, v in sorted(options.items())},
        "compiler_settings": compiler_settings(),
        "regions": regions,
        "device": _device_tag(p.device),
        # a CPU graph is guarded on the intra-op thread count (torch's global state): one folder per count, so a
        # process at another count neither loads nor overwrites it
        "threads": torch.get_num_threads() if p.device.type == "cpu" else None,
        "dtype": str(p.dtype),
        "target": [type(spec.target).__name__, _config_json(spec.target.config),
                   getattr(spec.target.config, "_attn_implementation", None), _module_signature(spec.target)],
        "draft": [_config_json(spec.draft.config), repr(spec.draft.dflash_config), _module_signature(spec.draft)],
        "geometry": [spec.max_batch_size, spec.max_seq_len, spec.page_size],
        # each rank of a tensor-parallel target compiles its own graph (its shards, its collectives)
        "tensor_parallel": [spec.tp.rank, spec.tp.world] if spec.tp is not None else None,
        # CPU graphs call the row_linear kernel (built for this CPU) unless it is switched off or cannot be built
        "row_linear": (_row_linear_state() if p.device.type == "cpu" and backend in OWN_BACKENDS
                       else None),
    }


#: dynamo settings the step's compile sets itself (``_compile``, ``_InProcessStep``), or reads only to set its
#: recompile limit: a user's value never reaches the graph
_SET_BY_THE_STEP = frozenset({"dynamo.automatic_dynamic_shapes", "dynamo.recompile_limit",
                              "dynamo.accumulated_recompile_limit", "inductor.cpp.vec_isa_ok"})
_A_PATH = re.compile(r"(^|_)(dir|path|root)$")  # a setting's last name part: base_dir, debug_dir_root, output_path


def compiler_settings() -> str:
    """A digest of the settings torch's compiler makes a graph under, however they were set (in code, or through
    ``TORCHINDUCTOR_*``/``TORCHDYNAMO_*`` variables: ``TORCHINDUCTOR_SIZE_ASSERTS=0`` is another folder): the
    portable form of dynamo's, AOTAutograd's and Inductor's configs (what Inductor's own cache keys on), without
    paths (they follow the working directory) and the dynamo settings the step's compile sets itself."""
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    items = []
    for name, module in (("dynamo", dynamo_config), ("functorch", functorch_config), ("inductor", inductor_config)):
        for k, v in module.save_config_portable().items():
            if f"{name}.{k}" not in _SET_BY_THE_STEP and not _A_PATH.search(k.rsplit(".", 1)[-1]):
                items.append((f"{name}.{k}", _stable_repr(v)))
    return hashlib.sha256(repr(sorted(items)).encode()).hexdigest()[:16]


def _stable_repr(value) -> str:
    """``repr`` with sets and dicts in sorted order (a set's own order changes from one process to the next)."""
    if isinstance(value, (set, frozenset)):
        return repr(sorted(map(_stable_repr, value)))
    if isinstance(value, dict):
        return repr(sorted((_stable_repr(k), _stable_repr(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return repr([_stable_repr(v) for v in value])
    return repr(value)


def _row_linear_state() -> str:
    from ..lowerings.cpu import row_linear

    return row_linear.state()


class _InMemory(torch._dynamo.aot_compile_types.SerializableCallable):
    """A backend's compiled graph that torch cannot serialize (a plain callable): usable, never saved."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    @classmethod
    def serialize_compile_artifacts(cls, fn) -> bytes:
        raise _NotSaveable("the backend's compiled graph is a plain callable torch cannot serialize")

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes):
        raise _NotSaveable("not a saved graph")


class _NotSaveable(RuntimeError):
    pass


def _serializable(backend):
    """``backend`` with its result marked for the AOT capture: torch's serializable artefact where the backend
    gives one (every AOTAutograd/Inductor-based backend), an in-memory one otherwise."""

    def wrapped(gm, example_inputs):
        compiled = backend(gm, example_inputs)
        if isinstance(compiled, torch._dynamo.aot_compile_types.SerializableCallable) or (
                getattr(compiled, "serialize", None) is not None):
            return compiled
        return _InMemory(compiled)

    return wrapped


class _InProcessStep:
    """A key compiled through dynamo's ordinary path (its own cache and guards), for steps the ahead-of-time capture
    could not package: traced again at its first call in this process, kept in memory only. Same calling
    convention as ``AOTCompiledFunction``."""

    def __init__(self, steps: "CompiledSteps", key: StepKey, backend):
        self._fn = torch.compile(steps.spec.dflash_step.forward, backend=backend, fullgraph=True, dynamic=False)
        self._steps, self._key = steps, key

    def guard_check(self, *args, **kwargs) -> bool:
        return True  # dynamo checks its own guards at every call

    def disable_guard_check(self) -> None:
        pass

    def __call__(self, *args, **kwargs):
        args, kwargs = self._steps.keys.marked(self._key, args, kwargs)  # the sizes the capture left open, again
        cfg = torch._dynamo.config  # every wrapper shares forward's code object, hence one dynamo cache for all keys
        limit = max(cfg.recompile_limit, cfg.accumulated_recompile_limit)
        regions = compile_regions(self._steps.keys.region_types, self._steps.spec.target)
        with _TRACING, regions, size_oblivious(), cfg.patch(automatic_dynamic_shapes=False, recompile_limit=limit):
            return self._fn(*args, **kwargs)


def _detached():
    return None


def _backend_callable(backend, mode, options):
    if not isinstance(backend, str):
        return backend
    if backend == "inductor":
        return torch._TorchCompileInductorWrapper(mode, options or None, False)
    if mode is not None or options:
        return torch._TorchCompileWrapper(backend, mode, options or None, False)
    return torch._dynamo.lookup_backend(backend)


#: Python's first-generation collection threshold while a step compiles (the default is 700 allocations): tracing and
#: code generation allocate millions of short-lived objects, and collecting every 700 of them cost 2.5 s of a 44 s
#: compile of SmolLM2's two batch-1 graphs (2,388 collections; 0.7 s with this threshold: 13).
COMPILE_GC_THRESHOLD = 100_000
_gc_lock = threading.Lock()
_gc_saved: list = []  # [thresholds before the first compile in progress, compiles in progress]


@contextlib.contextmanager
def fewer_collections():
    """Raise Python's first-generation collection threshold while a compile runs; the process's own thresholds are
    restored when the last compile in progress ends."""
    with _gc_lock:
        if not _gc_saved:
            _gc_saved[:] = [gc.get_threshold(), 0]
            old = _gc_saved[0]
            gc.set_threshold(max(old[0], COMPILE_GC_THRESHOLD), *old[1:])
        _gc_saved[1] += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_saved[1] -= 1
            if _gc_saved[1] == 0:
                gc.set_threshold(*_gc_saved[0])
                _gc_saved.clear()


class CompiledSteps:
    """The compiled step of one ``DFlashSpecWrapper``, per ``StepKey`` (see the module docstring)."""

    def __init__(self, spec, backend="dflash", *, cache_dir=None, on_miss: str = "compile", mode=None,
                 options: dict | None = None, dynamic_context: bool | None = None, regions: bool | None = None,
                 workers: int | None = None):
        if on_miss not in ON_MISS:
            raise ValueError(f"on_miss={on_miss!r}: expected one of {ON_MISS}")
        if isinstance(backend, str) and backend not in OWN_BACKENDS:
            # an unknown name fails here, before any request; ours are known without the lookup, whose first call
            # imports every backend module torch ships (0.8 s of a warm start under cProfile)
            torch._dynamo.lookup_backend(backend)
        self.spec = spec
        self.backend, self.mode, self.options = backend, mode, dict(options or {})
        self.on_miss = on_miss
        self.workers = default_workers() if workers is None else check_workers(workers)  # compile_workers.py
        self.dynamic_context = (backend not in STATIC_CONTEXT_BACKENDS) if dynamic_context is None else dynamic_context
        self.keys = StepKeys(spec, self.dynamic_context, regions)
        self.cache_dir = None if not isinstance(backend, str) else Path(cache_dir) if cache_dir else default_cache_dir()
        # Inductor's own cache (the compiled C++/Triton binaries a saved graph loads), in force while a step compiles
        # or loads: by default inside the compile cache, so that copying the compile cache carries them
        self.inductor_dir = None if self.cache_dir is None else inductor_cache_dir(self.cache_dir)
        self._fns: dict[StepKey, object] = {}
        self._prepacking = None  # the helper thread packing the CPU kernel's weight copies (``_prepack``)
        self._checked: set[StepKey] = set()
        self._device = None  # (device, dtype) of the models the graphs were made for
        self._folder: tuple | None = None  # ((device, dtype, threads), folder, fingerprint)
        self._said: set[str] = set()
        self.events: list[tuple[StepKey, str, float]] = []  # (key, "compiled" | "loaded" | "eager", seconds)
        self.listeners: list = []  # called as fn(key, how, seconds) with every event (the scheduler's timing)
        self._background: dict[StepKey, threading.Thread | None] = {}  # keys compiling (None: that failed)
        # held while a missing graph is loaded or compiled: callers asking for the same key at once (clients
        # readying their batch, the scheduler's step) wait for the one that makes it instead of making it again
        self._obtaining = threading.RLock()

    def __reduce__(self):
        # Dynamo pickles the wrapper's state with a saved graph's guards; the compiled graphs this object holds (and
        # their guard managers) must not go with it.
        return (_detached, ())

    @staticmethod
    def tracing() -> threading.Lock:
        """The process-wide lock held while a graph is traced, compiled or loaded."""
        return _TRACING

    @staticmethod
    def renew_tracing() -> None:
        """In a forked child (``compile_workers``): a new tracing lock, the parent's forking thread held the old."""
        global _TRACING
        _TRACING = threading.Lock()

    def compiled_keys(self) -> list[StepKey]:
        return sorted(self._fns, key=StepKey.sort_key)

    # ------------------------------------------------------------------ running a step
    def step(self, args: tuple, kwargs: dict, propose: bool):
        """One step (``DFlashStep.forward``'s arguments) through the graph of its key."""
        block, block_tables = args[0], args[2]
        key = self.keys.key(block.shape[0], block_tables.shape[1], len(args) > 6, block.shape[1], propose)
        if key.verify_len is None and block.shape[1] < 2:
            raise ValueError(f"{key}: a proposing step runs with a block of at least 2 tokens here (StepKeys.block_len); "
                             f"got {block.shape[1]}")
        return self.run(key, args, kwargs)

    def precompile(self, batch_sizes, sampling, progress: bool = True) -> dict:
        """``DFlashSpecWrapper.precompile``: every (batch bucket, sampling mode, context bucket where graphs are
        static, ``(K, proposes)`` variant) graph made ready, with a progress bar: ``{str(key): (how, seconds)}``."""
        spec = self.spec
        bad = [b for b in (batch_sizes or []) if not isinstance(b, int) or not 1 <= b <= spec.max_batch_size]
        if bad:
            raise ValueError(f"batch_sizes {bad} are outside [1, max_batch_size={spec.max_batch_size}]")
        buckets = sorted({spec.batch_bucket(b) for b in batch_sizes}) if batch_sizes else list(spec.batch_buckets)
        return self._prepare_all(self.keys.keys_for(buckets, sampling), progress)

    def ready(self, rows: int, sampling) -> None:
        """Before a batch of up to ``rows`` rows runs (a ``generate`` call, a server starting): the graphs of every
        batch bucket it may fall to as rows finish, up to ``rows``' bucket, made ready as ``on_miss`` says — loaded
        or compiled now, with a progress bar (``"compile"``), or started on background threads while the eager step
        serves (``"background"``); ``"eager"`` and ``"error"`` leave a miss to the step. So no step compiles
        after start-up."""
        spec = self.spec
        # as every step does first: graphs made for another device or dtype go, and graphs started now are not
        # dropped by the first step's check (which found them made before any step and cleared them)
        self._check_device()
        top = spec.batch_bucket(max(1, min(rows, spec.max_batch_size)))
        missing = [k for k in self.keys.keys_for([b for b in spec.batch_buckets if b <= top], sampling)
                   if k not in self._fns and k not in self._background]
        if not missing or self.on_miss in ("eager", "error"):
            return
        self._prepack()
        if self.on_miss == "compile":
            self._prepare_all(missing, progress=True)
            return
        with self._obtaining:
            for key in missing:
                if key not in self._fns and key not in self._background and self._load(key) is None:
                    self._compile_in_background(key)

    def _prepack(self) -> None:
        """Before graphs are loaded or compiled for CPU fp32 models: the ``row_linear`` kernel's packed weight copies
        made on a helper thread meanwhile (``row_linear.prepack``), once per wrapper."""
        if self._prepacking is not None or self.backend not in OWN_BACKENDS:
            return
        from ..lowerings.cpu import row_linear

        self._prepacking = row_linear.prepack(self.spec.target, self.spec.draft) or False

    def _prepare_all(self, keys: list[StepKey], progress: bool) -> dict:
        """Make ``keys`` ready with a progress bar: the ones neither in memory nor in the cache compiled by forked
        workers where that is safe (``compile_workers``), the rest (and any a worker failed) here."""
        from tqdm.auto import tqdm

        report = {}
        with tqdm(total=len(keys), desc="dflash precompile", unit="graph", disable=not progress) as bar:
            def done(key, how, seconds):
                report[str(key)] = (how, round(seconds, 2))
                bar.update()
                bar.write(f"{key}: {how} in {seconds:.1f} s")

            with self._obtaining:
                self._check_device()
                missing = [k for k in keys if k not in self._fns and k not in self._background and not (
                    self.folder() is not None and (self.folder() / k.filename).exists())]
                workers = parallel_workers(self, missing)
                if workers > 1:
                    bar.set_postfix_str(f"{len(missing)} graphs in {workers} processes")
                    self._prepack()  # on its helper thread while the children compile

                    def landed(key, seconds):  # a child saved the graph (else None): load it now
                        if seconds is not None and self._load(key, record=False) is not None:
                            self._record(key, "compiled", seconds)
                            done(key, "compiled", seconds)

                    compile_in_workers(self, sorted(missing, key=StepKey.compile_order), workers, landed)
            self._prepack()
            for key in keys:
                if str(key) in report:
                    continue
                bar.set_postfix_str(str(key))
                args, kwargs = self.keys.example(key)
                done(key, *self.prepare(key, args, kwargs))
        return report

    def run(self, key: StepKey, args: tuple, kwargs: dict):
        """The step of ``key`` on ``args``/``kwargs`` (``forward``'s), loaded or compiled on a miss (``on_miss``)."""
        self._check_device()
        fn = self._fns.get(key)
        if fn is None:
            with self._obtaining:
                fn = self._fns.get(key)
                fn = self._load(key) if fn is None else fn
                if fn is None and self.on_miss == "compile":
                    fn = self._compile(key, args, kwargs)
                # checked with the graph's absence under the lock a background compile finishes under: one that
                # ended since this step found no graph has stored it, so it is not started again
                if fn is None and self.on_miss == "background" and key not in self._background:
                    self._compile_in_background(key)
            if fn is None:
                if self.on_miss in ("eager", "background"):
                    start = time.perf_counter()
                    out = self.spec.dflash_step(*args, **kwargs)
                    self._record(key, "eager", time.perf_counter() - start)
                    return out
                raise RuntimeError(f"no compiled step for {key} (on_miss='error'): precompile it first, with "
                                   f"spec.precompile(...)")
        if key not in self._checked:  # a loaded entry answers to its own guards once; then the key fixes the shapes
            if self._parameters_changed():  # what the guards left out (step_guards): the graphs are for others
                log.warning("dflash: the models' parameters changed shape, dtype, strides or device since the step "
                            "graphs in use were made; %s goes to the graphs of the new parameters", key)
                self._fns.clear()
                self._checked.clear()
                self._folder = None
                return self.run(key, args, kwargs)
            if not fn.guard_check(*args, **kwargs):
                debug = fn._artifacts.guard_manager.check_verbose(fn.prepare_f_locals(*args, **kwargs))
                reason = "; ".join(getattr(debug, "verbose_code_parts", None) or [str(debug)]).replace("\n", " ")
                self._warn(key, f"its guards reject this wrapper's inputs ({reason[:300]})")
                self._fns.pop(key, None)
                fn = self._compile(key, args, kwargs)
                if not fn.guard_check(*args, **kwargs):
                    raise RuntimeError(f"the step just compiled for {key} rejects its own inputs")
            fn.disable_guard_check()
            self._checked.add(key)
        return fn(*args, **kwargs)

    def _parameters_changed(self) -> bool:
        """Whether a parameter of the pair differs in shape, dtype, strides or device from when this wrapper's folder
        (and so its graphs) was settled; False without a folder (a backend callable keeps dynamo's guards)."""
        if self._folder is None:
            return False
        fp = self._folder[2]
        return (fp["target"][3] != _module_signature(self.spec.target)
                or fp["draft"][2] != _module_signature(self.spec.draft))

    def _record(self, key: StepKey, how: str, seconds: float) -> None:
        self.events.append((key, how, seconds))
        for fn in self.listeners:
            fn(key, how, seconds)

    def _check_device(self) -> None:
        p = next(self.spec.target.parameters())
        if self._device != (p.device, p.dtype):  # the models moved (or first call): graphs of another dtype go
            self._fns.clear()
            self._checked.clear()
            self._device = (p.device, p.dtype)

    def _compile_in_background(self, key: StepKey) -> None:
        """Compile ``key`` on a daemon thread from inputs of its shapes; the step runs eagerly until it is ready.
        Dynamo traces on fake tensors (it reads the pools' shapes, never their contents), so the eager steps the
        host loop runs meanwhile are untouched."""
        args, kwargs = self.keys.example(key)

        def work():
            try:
                self._compile(key, args, kwargs)  # stores the graph
                with self._obtaining:  # no step sees the key neither compiling nor compiled
                    self._background.pop(key, None)
            except Exception as e:  # the key keeps running eagerly; the failure is said, never raised mid-request
                self._background[key] = None
                log.warning("dflash: compiling %s in the background failed (%s: %s); it runs eagerly", key,
                            type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")

        thread = threading.Thread(target=work, name=f"dflash-compile-{key.filename}", daemon=True)
        self._background[key] = thread
        thread.start()

    def wait(self) -> None:
        """Wait for every background compile in progress (and the weight packing)."""
        if self._prepacking:
            self._prepacking.join()
        for thread in list(self._background.values()):
            if thread is not None:
                thread.join()

    def prepare(self, key: StepKey, args: tuple, kwargs: dict) -> tuple[str, float]:
        """Make ``key``'s graph ready without running it: ``("loaded" | "compiled" | "ready", seconds)``."""
        self._check_device()
        thread = self._background.get(key)
        if thread is not None:  # being compiled in the background: wait for it
            thread.join()
        with self._obtaining:
            if key in self._fns:
                return "ready", 0.0
            if self._load(key) is None:
                self._compile(key, args, kwargs)
            _, how, seconds = next(e for e in reversed(self.events) if e[0] == key)
        return how, seconds

    # ------------------------------------------------------------------ compile, save, load
    def _compile(self, key: StepKey, args: tuple, kwargs: dict):
        args, kwargs = self.keys.marked(key, args, kwargs)
        start = time.perf_counter()
        backend = _serializable(_backend_callable(self.backend, self.mode, self.options))
        regions = compile_regions(self.keys.region_types, self.spec.target)
        if self.vec_isa_record() is not None:
            vec_isa.probe()  # once per machine (a forked worker finds its parent's record)
        with _TRACING, self._inductor_cache(), torch.no_grad(), regions, fewer_collections(), self._units_index(), \
                torch._dynamo.config.patch(automatic_dynamic_shapes=False), size_oblivious(), vec_isa.trusted():
            compiled = torch.compile(self.spec.dflash_step, backend=backend, fullgraph=True, dynamic=False, options={
                "guard_filter_fn": functools.partial(
                    step_guards, parameters=self.spec.tp is not None or self.cache_dir is None)})
            try:
                fn = compiled.forward.aot_compile((tuple(args), dict(kwargs)))
            except (torch._dynamo.exc.PackageError, TypeError, AttributeError, pickle.PicklingError) as e:
                # Dynamo traced the step but could not package it for saving (an object in its guard state that
                # does not pickle): compile the key the ordinary way, kept in this process only.
                self._say_once("unpackaged", "dflash: %s cannot be saved (%s: %s); its graphs stay in memory",
                               key, type(e).__name__, str(e).splitlines()[0][:200])
                fn = _InProcessStep(self, key, backend)
        self._fns[key] = fn
        self._checked.discard(key)
        self._record(key, "compiled", time.perf_counter() - start)
        if not isinstance(fn, _InProcessStep):
            self._save(key, fn)
        return fn

    def _units_index(self):
        """Where this folder's one-unit C++ builds are recorded (``cpp_units.units_recorded_in``): the folder's
        fingerprint holds what the builds depend on besides their source (torch, the CPU, the options)."""
        from ..cpp_units import units_recorded_in

        folder = self.folder()
        return units_recorded_in(None if folder is None else folder / "cpp_units")

    def _inductor_cache(self):
        if self.inductor_dir is None:
            return contextlib.nullcontext()
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

        return temporary_cache_dir(str(self.inductor_dir))

    def folder(self) -> Path | None:
        """This wrapper's folder in the cache (None for a backend callable)."""
        if self.cache_dir is None:
            return None
        p = next(self.spec.target.parameters())
        # what the fingerprint reads from the process, not the wrapper: a graph compiled after
        # torch.set_num_threads(n) is saved under (and loaded from) the folder of n threads
        state = (p.device, p.dtype, torch.get_num_threads())
        if self._folder is None or self._folder[0] != state:
            fp = fingerprint(self.spec, self.backend, self.mode, self.options, self.keys.regions)
            digest = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:24]
            self._folder = (state, self.cache_dir / digest, fp)
        return self._folder[1]

    def check_record(self) -> Path | None:
        """Where a passed paged-forward check of the target is recorded in this wrapper's folder (``CacheManager``),
        or None (no cache)."""
        folder = self.folder()
        return None if folder is None else folder / "paged_forward_checked.json"

    def vec_isa_record(self) -> Path | None:
        """Where the vector ISA Inductor built this folder's CPU kernels for is recorded (None: no cache, or not a CPU
        Inductor backend). A process that loads the folder's graphs skips Inductor's probe of that ISA (a test
        program compiled, then loaded in a child Python: ~0.3-0.5 s of a warm start): the compile that wrote the
        folder passed it on a CPU with the same feature flags and the same torch (the fingerprint)."""
        folder = self.folder()
        cpu = next(self.spec.target.parameters()).device.type == "cpu"
        if folder is None or not cpu or self.backend not in ("dflash", "inductor"):
            return None
        return folder / "vec_isa.json"

    def _header(self, key: StepKey) -> bytes:
        return json.dumps({"key": dataclasses.asdict(key), "folder": self.folder().name}, sort_keys=True).encode()

    def _save(self, key: StepKey, fn) -> None:
        folder = self.folder()
        if folder is None:
            return
        from torch._dynamo.aot_compile import AOTCompiledFunction, atomic_write_binary

        try:
            payload = AOTCompiledFunction.serialize(fn, external_data={"step": self.spec.dflash_step}).serialized_data
        except _NotSaveable as e:
            self._say_once("unsaveable", "dflash: the step graphs of backend %r stay in memory (%s)", self.backend, e)
            return
        except (AttributeError, TypeError, pickle.PicklingError) as e:
            # torch's own artefact would not pickle: backend "eager"'s graph module with a nested compile region
            # (its invoke_subgraph subgraph holds a WeakValueDictionary, torch 2.13)
            self._say_once("unpicklable", "dflash: the step graphs of backend %r stay in memory (%s: %s)", self.backend,
                           type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
            return
        header = self._header(key)
        blob = b"".join([_MAGIC, len(header).to_bytes(4, "little"), header, hashlib.sha256(payload).digest(), payload])
        try:
            folder.mkdir(parents=True, exist_ok=True)
            meta = folder / "fingerprint.json"
            if not meta.exists():
                atomic_write_binary(str(meta), json.dumps(self._folder[2], indent=1, sort_keys=True).encode())
            atomic_write_binary(str(folder / key.filename), blob)
            isa = self.vec_isa_record()
            if isa is not None and not isa.exists() and "torch._inductor.cpu_vec_isa" in sys.modules:
                # "" when Inductor found no ISA it can build: nothing is skipped then
                atomic_write_binary(str(isa), json.dumps({"isa": vec_isa.picked()}).encode())
        except OSError as e:
            self._say_once("unwritable", "dflash: cannot write the compile cache at %s (%s); compiled steps stay "
                           "in memory", folder, e)

    def _load(self, key: StepKey, record: bool = True):
        folder = self.folder()
        path = folder / key.filename if folder is not None else None
        if path is None or not path.exists():
            return None
        start = time.perf_counter()
        try:
            blob = path.read_bytes()
            payload = self._unwrap(key, blob)
            if self.backend in OWN_BACKENDS and next(self.spec.target.parameters()).device.type == "cpu":
                _row_linear_state()  # registers torch.ops.dflash_cpu.row_linear, which the saved graph may call
            from ..cpp_units import one_unit_per_graph
            from .deferred_imports import deferred_imports

            options = self._load_options()
            isa = self.vec_isa_record()
            if isa is not None and isa.exists() and json.loads(isa.read_text()).get("isa"):
                options["cpp.vec_isa_ok"] = True  # the probe passed when the folder was compiled
            with _TRACING, self._inductor_cache(), torch._inductor.config.patch(options), self._units_index(), \
                    one_unit_per_graph(self.backend in OWN_BACKENDS), deferred_imports():
                fn = torch.compiler.load_compiled_function(io.BytesIO(payload), external_data={"step": self.spec.dflash_step})
        except Exception as e:  # a damaged or foreign entry never stops a request: compile instead
            self._warn(key, f"{type(e).__name__}: {e}".splitlines()[0][:200], path)
            return None
        self._fns[key] = fn
        self._checked.discard(key)
        if record:
            self._record(key, "loaded", time.perf_counter() - start)
        return fn

    def _load_options(self) -> dict:
        """The Inductor config the graph was compiled under: a load looks its binaries up under the same build
        options (else Inductor compiles the saved C++ source again)."""
        if self.backend in OWN_BACKENDS:
            from ..backends import inductor_options

            device = next(self.spec.target.parameters()).device.type
            return inductor_options({device}, self.options, self.keys.regions)
        return dict(self.options) if self.backend == "inductor" else {}

    def _unwrap(self, key: StepKey, blob: bytes) -> bytes:
        if not blob.startswith(_MAGIC):
            raise ValueError("not a dflash_compile step entry")
        at = len(_MAGIC)
        n = int.from_bytes(blob[at: at + 4], "little")
        header, digest = blob[at + 4: at + 4 + n], blob[at + 4 + n: at + 36 + n]
        payload = blob[at + 36 + n:]
        if header != self._header(key):
            raise ValueError(f"the entry is for another key ({header[:120].decode(errors='replace')})")
        if hashlib.sha256(payload).digest() != digest:
            raise ValueError("checksum mismatch (corrupted or truncated)")
        return payload

    # ------------------------------------------------------------------ messages
    def _warn(self, key: StepKey, why: str, path=None) -> None:
        where = f" ({path})" if path is not None else ""
        log.warning("dflash: ignoring the compile cache entry for %s%s: %s; compiling it again", key, where, why)

    def _say_once(self, tag: str, msg: str, *args) -> None:
        if tag not in self._said:
            self._said.add(tag)
            log.warning(msg, *args)


def compiled_steps_for(spec, backend, *, cache_dir, on_miss, mode, options, fullgraph, dynamic, regions=None,
                       workers=None, **kwargs):
    """``DFlashSpecWrapper.compile``'s arguments checked, then the wrapper's ``CompiledSteps``."""
    if not fullgraph:
        raise ValueError("the DFlash step compiles as one full graph: fullgraph=False is not supported")
    if dynamic not in (None, False):
        raise ValueError("dynamic shapes are chosen per dimension by the wrapper (the context length); "
                         "leave dynamic unset")
    if kwargs:
        raise TypeError(f"compile() got unexpected arguments {sorted(kwargs)}")
    if spec.tp is not None and on_miss == "background":
        raise ValueError("on_miss='background' is not supported with a tensor-parallel target: each rank would "
                         "switch from the eager to the compiled step at its own time; use 'compile' or "
                         "precompile()")
    if regions and spec.tp is not None:
        raise ValueError("regions=True is not supported with a tensor-parallel target: its collectives run inside the "
                         "decoder layers; leave regions unset")
    return CompiledSteps(spec, backend, cache_dir=cache_dir, on_miss=on_miss, mode=mode, options=options,
                         regions=regions, workers=workers)
