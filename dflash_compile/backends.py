"""The dynamo backends ``dflash`` and ``dflash_neuron``.

Both retrace the captured graph to pre-dispatch ATen, run the DFlash passes (which swap the step's hot
patterns for ``torch.ops.dflash.*``) and hand the result on:

- ``dflash``: lowers each op to its device implementation traced into the graph (``lower``: plain ATen on CPU,
  which Inductor compiles into C++; the Triton kernels through ``wrap_triton`` on CUDA), then Inductor. The
  compiled step calls no Python-implemented op.
- ``dflash_neuron``: to the Neuron SDK's own dynamo backend with the NKI kernels registered, when the SDK is
  importable. Without it: the same as ``dflash`` (passes, CPU/Triton lowerings, Inductor), said once in the
  log.

Registered through the ``torch_dynamo_backends`` entry-point group, so ``torch.compile(fn, backend="dflash")``
works without importing this package first. Graphs with dynamic shapes (the step's context length) are retraced in
dynamo's own symbolic sizes, so the passes and lowerings keep them symbolic (``_retrace``).
"""

from __future__ import annotations

import importlib.util
import logging
import unittest.mock

import torch
from torch._dynamo.utils import dynamo_timed
from torch._inductor import config as inductor_config
from torch.fx.experimental.proxy_tensor import make_fx

log = logging.getLogger(__name__)

#: Inductor settings for the step. No freezing: dynamo hands module parameters to the backend as graph inputs, so
#: freezing would fold only the graph's own constants (``benchmarks/bench_freezing.py``: the default pair's step
#: 7.461 ms with it, 7.505 without, batch 1, context 300, one thread), and its output cannot be saved by torch's
#: ahead-of-time capture (``compiled_step.py``).
INDUCTOR_OPTIONS = {"freezing": False}
#: Added for CPU graphs: a C++ wrapper around the kernels (the Python one cost ~0.8 ms per call of the default
#: pair's step), built as two translation units (the wrapper at -O1, the kernels at -O3) compiled in parallel, with
#: no precompiled header (building one costs more than it saves for the step's one or two units): the shipped pair's
#: cold compile 38.5 -> 22.0 s at batch 1 and 34.3 -> 28.9 s at batch 8, the step 6.905 -> 6.893 ms and 32.10 ->
#: 32.31 ms (one thread, context 500; ``benchmarks/bench_cpu_options.py``). Not on CUDA, where it is unmeasured
#: here and CUDA graphs are the way to hide launch overhead.
CPU_INDUCTOR_OPTIONS = {"cpp_wrapper": True, "cpp_wrapper_build_separate": True, "cpp_cache_precompile_headers": False}
_said: set[str] = set()


def _say_once(key: str, msg: str, *args) -> None:
    if key not in _said:
        _said.add(key)
        log.warning(msg, *args)


def _is_dynamic(gm: torch.fx.GraphModule, example_inputs) -> bool:
    for x in example_inputs:
        if isinstance(x, torch.SymInt):
            return True
        if isinstance(x, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in x.shape):
            return True
    for node in gm.graph.find_nodes(op="placeholder"):
        ev = node.meta.get("example_value")
        if isinstance(ev, torch.SymInt) or (
            isinstance(ev, torch.Tensor) and any(not isinstance(d, int) for d in ev.shape)
        ):
            return True
    return False


def _retrace(gm: torch.fx.GraphModule, example_inputs, decomposition_table=None) -> torch.fx.GraphModule:
    """``gm`` retraced to pre-dispatch ATen (with ``decomposition_table`` applied). A static graph is traced outside
    dynamo's tracing context (make_fx would otherwise fakify its inputs in dynamo's shape env with fresh,
    source-less symbols); a dynamic one in dynamo's own fake mode, so its sizes stay dynamo's symbols (the
    ranges and guards dynamo recorded for them)."""
    if _is_dynamic(gm, example_inputs):
        # Dynamo hands the backend real tensors and keeps their symbolic sizes in the tracing context: fakify them
        # there, as AOTAutograd does, so the retraced graph's sizes are dynamo's symbols.
        context = torch._guards.TracingContext.get()
        fake_mode = context.fake_mode

        def fakify(x):
            if not isinstance(x, torch.Tensor) or isinstance(x, torch._subclasses.FakeTensor):
                return x
            symbolic = context.tensor_to_context.get(x)
            return fake_mode.from_tensor(x, symbolic_context=symbolic, source=symbolic and symbolic.tensor_source,
                                         trace=False)

        fakes = [fakify(x) for x in example_inputs]
        # The graph's own constants (get_attr) are real tensors: the mode fakifies them as it meets them.
        with fake_mode, torch._guards.tracing(None), unittest.mock.patch.object(fake_mode, "allow_non_fake_inputs",
                                                                                True):
            return make_fx(gm, decomposition_table=decomposition_table, pre_dispatch=True)(*fakes)
    with torch._guards.tracing(None):
        return make_fx(gm, decomposition_table=decomposition_table, pre_dispatch=True,
                       tracing_mode="fake")(*example_inputs)


def dflash_passes(gm: torch.fx.GraphModule, example_inputs) -> torch.fx.GraphModule:
    """Pre-dispatch ATen of ``gm`` with the DFlash passes applied (static or dynamic shapes)."""
    from .passes import apply_passes

    with dynamo_timed("dflash.retrace"):
        aten_gm = _retrace(gm, example_inputs)
    with dynamo_timed("dflash.passes"), torch._guards.tracing(None):
        counts = apply_passes(aten_gm)
    log.info("dflash: replacements %s", counts)
    return aten_gm


def lower(gm: torch.fx.GraphModule, example_inputs) -> torch.fx.GraphModule:
    """Retrace ``gm`` with every ``dflash`` op replaced by its implementation for the graph's device
    (``lowerings.lowering_table``); ops without one for that device stay as they are."""
    from .lowerings import lowering_table

    kinds = {x.device.type for x in example_inputs if isinstance(x, torch.Tensor)}
    table = lowering_table(next(iter(kinds))) if len(kinds) == 1 else {}
    ops = {n.target for n in gm.graph.nodes if n.op == "call_function" and str(n.target).startswith("dflash.")}
    if not ops:
        return gm
    if not table:
        _say_once(f"no-lowering-{sorted(kinds)}", "dflash: no lowering for graphs on %s; %s run as custom ops",
                  sorted(kinds), sorted(map(str, ops)))
        return gm
    with dynamo_timed("dflash.lower"):
        return _retrace(gm, example_inputs, table)


def inductor_options(device_types: set[str], options: dict | None = None) -> dict:
    """The Inductor config the DFlash backends compile a graph on ``device_types`` with (``options`` last). Loading
    a saved graph patches the same config: Inductor's cache keys its binaries on the build options."""
    device_options = CPU_INDUCTOR_OPTIONS if device_types == {"cpu"} else {}
    return {**INDUCTOR_OPTIONS, **device_options, **(options or {})}


def _inductor(gm, example_inputs, options):
    from torch._inductor.compile_fx import compile_fx

    kinds = {x.device.type for x in example_inputs if isinstance(x, torch.Tensor)}
    # compile_fx reads a graph whose placeholders carry ``val`` as an exported one and, with the C++ wrapper, drops
    # its SymInt inputs: make_fx's placeholders lose ``val`` (dynamo's own graphs carry none), so the inputs count.
    for node in gm.graph.find_nodes(op="placeholder"):
        node.meta.pop("val", None)
    with inductor_config.patch(inductor_options(kinds, options)):
        return compile_fx(gm, example_inputs)


def dflash_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None):
    """``torch.compile(..., backend="dflash")``: DFlash passes, device lowerings, then Inductor."""
    return _inductor(lower(dflash_passes(gm, example_inputs), example_inputs), example_inputs, options)


def neuron_sdk_available() -> bool:
    return importlib.util.find_spec("torch_neuronx") is not None and importlib.util.find_spec("nki") is not None


def dflash_neuron_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None):
    """``torch.compile(..., backend="dflash_neuron")``: DFlash passes, NKI kernels, the Neuron SDK's backend.

    Without the SDK: DFlash passes, reference lowerings and Inductor, said once in the log.
    """
    passed = dflash_passes(gm, example_inputs)
    graph = passed if passed is not None else gm
    if neuron_sdk_available():
        import torch_neuronx  # noqa: F401  (registers the "neuron" dynamo backend)

        from .lowerings.nki import register_neuron_kernels

        register_neuron_kernels()
        return torch._dynamo.lookup_backend("neuron")(graph, example_inputs)
    _say_once(
        "no-neuron",
        "dflash_neuron: the Neuron SDK (torch_neuronx, nki) is not installed; compiling with the DFlash passes, "
        "the CPU / Triton (CUDA) lowerings and Inductor instead of NKI kernels and the Neuron backend",
    )
    return _inductor(lower(passed, example_inputs) if passed is not None else gm, example_inputs, options)
