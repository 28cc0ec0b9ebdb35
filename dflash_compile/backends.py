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
dynamo's own symbolic sizes, so the passes and lowerings keep them symbolic (``_retrace``). Graphs whose inputs are
tensor subclasses (a tensor-parallel target's DTensor parameters) are retraced over the subclasses' plain parts
(``Subclasses``): the DTensor ops become local ATen ops and functional collectives in the graph, the passes see the
local shards, and the compiled graph is called with each input's local tensor.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import unittest.mock

import torch
from torch._dynamo.utils import counters, dynamo_timed
from torch._inductor import config as inductor_config
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

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
#: For CPU graphs that call nested compile regions (``runtime/regions.py``): torch 2.13's C++ wrapper cannot
#: call a subgraph (``NotImplementedError: codegen invoke_subgraph is not implemented for cpp wrapper``), so these keep
#: the Python wrapper, whose kernels ``cpp_units.py`` builds as one unit per graph, from the precompiled header
#: (SmolLM2-135M's step, batch 1, K 7, cold: 114 s inline with the C++ wrapper, 99 s as regions without the header,
#: 74 s with it, a kernel a build; 24 s with one build per graph; ``docs/compile.md``). Without the Python wrapper's
#: size, stride and scalar asserts (``assert_size_stride`` on every input and every extern kernel's output, ~25 a
#: layer: SmolLM2's plain step 21.15 -> 20.20 ms at batch 1 and 68.28 -> 66.31 ms at batch 8,
#: ``benchmarks/bench_cpu_options.py --set asserts``): dynamo's guards already check each input's sizes and strides,
#: and the extern kernels' fake implementations are checked against their real outputs by ``torch.library.opcheck``
#: (``tests/lowerings/test_fake_impls.py``). Alignment asserts stay; ``options`` can turn any back on.
REGION_CPU_INDUCTOR_OPTIONS = {"cpp_wrapper": False, "cpp_cache_precompile_headers": True, "size_asserts": False,
                               "scalar_asserts": False}
#: For graphs with collectives (a tensor-parallel step), torch 2.13: the C++ wrapper cannot call a collective's
#: kernel (``NotImplementedError: arg type Any is not yet supported by custom_op_wrapper``: the group argument); and
#: ``reorder_for_locality`` moved the kernel that adds the last decoder layer's MLP output into the residual stream
#: ahead of that output's in-place all-reduce, so it read this rank's partial sum (greedy tokens diverged from the
#: eager step's within 12 tokens on a tiny Qwen3 over two gloo ranks; ``tests/test_tensor_parallel.py``).
COLLECTIVE_INDUCTOR_OPTIONS = {"cpp_wrapper": False, "reorder_for_locality": False}  # see also distributed.waited_collectives
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
    for node in gm.graph.find_nodes(op="placeholder") if isinstance(gm, torch.fx.GraphModule) else ():
        ev = node.meta.get("example_value")
        if isinstance(ev, torch.SymInt) or (
            isinstance(ev, torch.Tensor) and any(not isinstance(d, int) for d in ev.shape)
        ):
            return True
    return False


def _parts(x) -> list:
    """``x``'s attribute path to each plain tensor it is made of (``[()]`` for a plain tensor)."""
    if not is_traceable_wrapper_subclass(x):
        return [()]
    names, _ = x.__tensor_flatten__()
    return [(n,) + rest for n in names if isinstance(getattr(x, n), torch.Tensor) for rest in _parts(getattr(x, n))]


def _part(x, path):
    for name in path:
        x = getattr(x, name)
    return x


def _rebuild(like, plain: dict, prefix=()):
    """``like``'s subclass rebuilt around ``plain[path]`` tensors (fake ones, while tracing); its inner objects
    that are not tensors (a DTensor's device mesh) are ``like``'s own."""
    if not is_traceable_wrapper_subclass(like):
        return plain[prefix]
    names, ctx = like.__tensor_flatten__()
    inner = {n: _rebuild(getattr(like, n), plain, prefix + (n,)) if isinstance(getattr(like, n), torch.Tensor)
             else getattr(like, n) for n in names}
    return type(like).__tensor_unflatten__(inner, ctx, like.size(), like.stride())


@contextlib.contextmanager
def _subclass_ops_traced_through():
    """While tracing to pre-dispatch ATen, an op with tensor-subclass arguments (a DTensor embedding in a
    tensor-parallel target) is traced through the subclass's own dispatch, one level down, into the ops it runs
    on the plain tensors inside (the DTensor's local shard, its collectives). Pre-dispatch tracing has no such
    path: its proxy mode refuses subclass arguments (``NotImplemented``, which it cannot return there)."""
    from torch.fx.experimental import proxy_tensor

    plain_call = proxy_tensor.proxy_call

    def proxy_call(proxy_mode, func, pre_dispatch, args, kwargs):
        if pre_dispatch and any(is_traceable_wrapper_subclass(x) for x in torch.utils._pytree.tree_leaves(
                (args, kwargs))):
            below = proxy_tensor.ProxyTorchDispatchMode(proxy_mode.tracer, proxy_mode.tracing_mode,
                                                        pre_dispatch=False)
            with below:
                return func(*args, **kwargs)
        return plain_call(proxy_mode, func, pre_dispatch, args, kwargs)

    with unittest.mock.patch.object(proxy_tensor, "proxy_call", proxy_call):
        yield


class Subclasses:
    """How a graph's tensor-subclass inputs split into plain tensors, in order (``paths[i]``: input ``i``'s attribute
    path to each part). ``flatten`` does it to a call's arguments; ``graph`` turns a graph over the subclass inputs
    into one over their parts, traced through the subclasses' own dispatch."""

    def __init__(self, paths: list[list[tuple]]):
        self.paths = paths

    @classmethod
    def of(cls, example_inputs) -> "Subclasses | None":
        """None when no input is a tensor subclass."""
        if not any(is_traceable_wrapper_subclass(x) for x in example_inputs):
            return None
        return cls([_parts(x) if isinstance(x, torch.Tensor) else [None] for x in example_inputs])

    def flatten(self, args) -> list:
        return [x if path is None else _part(x, path) for x, paths in zip(args, self.paths) for path in paths]

    def graph(self, gm, example_inputs):
        """``(fn, flat inputs)``: ``fn(*flat)`` rebuilds ``example_inputs``' subclasses around its arguments and runs
        ``gm`` (whose outputs must be plain tensors)."""
        spans, at = [], 0
        for paths in self.paths:
            spans.append((at, at + len(paths)))
            at += len(paths)

        def fn(*flat):
            args = []
            for like, paths, (a, b) in zip(example_inputs, self.paths, spans):
                args.append(flat[a] if paths == [None] or paths == [()] else
                            _rebuild(like, dict(zip(paths, flat[a:b]))))
            out = gm(*args)
            if any(is_traceable_wrapper_subclass(o) for o in torch.utils._pytree.tree_leaves(out)):
                raise NotImplementedError("dflash: a step graph that returns a tensor subclass (DTensor) is not "
                                          "supported; its outputs must be plain tensors")
            return out

        return fn, self.flatten(example_inputs)


def _over_parts(backend):
    """``backend`` for graphs with tensor-subclass inputs: it compiles the graph over their plain parts."""

    def compile(gm, example_inputs, options=None):
        subclasses = Subclasses.of(example_inputs)
        if subclasses is None:
            return backend(gm, example_inputs, options)
        fn, flat = subclasses.graph(gm, example_inputs)
        with dynamo_timed("dflash.desugar"), _subclass_ops_traced_through():
            plain = _retrace(fn, flat, dynamic=_is_dynamic(gm, example_inputs))
        counters["dflash"]["subclass_graphs"] += 1
        counters["dflash"]["collectives"] += _collectives(plain)
        compiled = backend(plain, flat, options)
        # A plain callable: the ahead-of-time capture keeps it in memory, never saved. Saved and loaded in a new
        # process, such a graph (as torch's serializable artefact of ``compile_fx``, called with the parts) failed at
        # its first call in torch 2.13 (``IndexError`` in AOTAutograd's subclass runtime wrapper).
        return lambda *args: compiled(*subclasses.flatten(args))

    compile.__name__, compile.__qualname__, compile.__doc__ = backend.__name__, backend.__qualname__, backend.__doc__
    return compile


def _retrace(gm, example_inputs, decomposition_table=None, dynamic: bool | None = None) -> torch.fx.GraphModule:
    """``gm`` retraced to pre-dispatch ATen (with ``decomposition_table`` applied). A static graph is traced outside
    dynamo's tracing context (make_fx would otherwise fakify its inputs in dynamo's shape env with fresh,
    source-less symbols); a dynamic one in dynamo's own fake mode, so its sizes stay dynamo's symbols (the
    ranges and guards dynamo recorded for them)."""
    if dynamic if dynamic is not None else _is_dynamic(gm, example_inputs):
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
        with fake_mode, _own_tracing_context(fake_mode), unittest.mock.patch.object(fake_mode, "allow_non_fake_inputs",
                                                                                     True):
            return make_fx(gm, decomposition_table=decomposition_table, pre_dispatch=True)(*fakes)
    with _own_tracing_context(None):
        return make_fx(gm, decomposition_table=decomposition_table, pre_dispatch=True,
                       tracing_mode="fake")(*example_inputs)


def _own_tracing_context(fake_mode):
    """A tracing context of the retrace's own, not dynamo's: it carries the cache through which every call of a
    nested compile region is traced into one shared subgraph (without it, one copy per call)."""
    return torch._guards.tracing(torch._guards.TracingContext(fake_mode))


def dflash_passes(gm: torch.fx.GraphModule, example_inputs) -> torch.fx.GraphModule:
    """Pre-dispatch ATen of ``gm`` with the DFlash passes applied (static or dynamic shapes)."""
    from .passes import apply_passes

    with dynamo_timed("dflash.retrace"):
        aten_gm = _retrace(gm, example_inputs)
    with dynamo_timed("dflash.passes"), torch._guards.tracing(None):
        counts = apply_passes(aten_gm)
    calls = _region_calls(aten_gm)
    if calls:  # nested compile regions: how many layers call how many distinct subgraphs
        counters["dflash"]["region_calls"] += len(calls)
        counters["dflash"]["region_subgraphs"] += len({n.args[0].target for n in calls})
    log.info("dflash: replacements %s (%d region calls)", counts, len(calls))
    return aten_gm


def lower(gm: torch.fx.GraphModule, example_inputs) -> torch.fx.GraphModule:
    """Retrace ``gm`` with every ``dflash`` op replaced by its implementation for the graph's device
    (``lowerings.lowering_table``); ops without one for that device stay as they are."""
    from .lowerings import lowering_table
    from .passes import graph_modules

    kinds = {x.device.type for x in example_inputs if isinstance(x, torch.Tensor)}
    table = lowering_table(next(iter(kinds))) if len(kinds) == 1 else {}
    ops = {n.target for m in graph_modules(gm) for n in m.graph.nodes
           if n.op == "call_function" and str(n.target).startswith("dflash.")}
    if ops and not table:
        _say_once(f"no-lowering-{sorted(kinds)}", "dflash: no lowering for graphs on %s; %s run as custom ops",
                  sorted(kinds), sorted(map(str, ops)))
    if ops and table:
        with dynamo_timed("dflash.lower"):
            gm = _retrace(gm, example_inputs, table)
    if kinds == {"cpu"}:
        row_linears(gm)
    return gm


def row_linears(gm: torch.fx.GraphModule) -> int:
    """CPU graphs: every fp32 ``aten.linear`` of ``gm`` and its subgraphs calls ``dflash_cpu.row_linear`` instead
    (the same function, with a kernel of its own for the few rows a speculative step has:
    ``lowerings/cpu/row_linear.py``); counted in ``counters["dflash_lowering"]["row_linear"]``. Left as they are
    when the kernel cannot be built here (said once) or ``DFLASH_ROW_LINEAR=0``."""
    from .lowerings.cpu import row_linear
    from .passes import graph_modules

    linear = torch.ops.aten.linear.default
    nodes = [n for m in graph_modules(gm) for n in m.graph.find_nodes(op="call_function", target=linear)
             if _fp32_cpu(n.args[0]) and _fp32_cpu(n.args[1])]
    if not nodes or not row_linear.enabled() or not row_linear.load():
        return 0
    for node in nodes:
        node.target = torch.ops.dflash_cpu.row_linear.default
    for m in graph_modules(gm):
        m.recompile()
    counters["dflash_lowering"]["row_linear"] += len(nodes)
    return len(nodes)


def _fp32_cpu(node) -> bool:
    v = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(v, torch.Tensor) and v.dtype == torch.float32 and v.device.type == "cpu"


def inductor_options(device_types: set[str], options: dict | None = None, regions: bool = False) -> dict:
    """The Inductor config the DFlash backends compile a graph on ``device_types`` with (``options`` last), for a
    graph that calls nested compile regions or not. Loading a saved graph patches the same config: Inductor's cache
    keys its binaries on the build options."""
    cpu = REGION_CPU_INDUCTOR_OPTIONS if regions else CPU_INDUCTOR_OPTIONS
    device_options = cpu if device_types == {"cpu"} else {}
    return {**INDUCTOR_OPTIONS, **device_options, **(options or {})}


def fold_scalar_constants(gm: torch.fx.GraphModule) -> int:
    """Every 0-dim tensor constant of ``gm`` and its subgraphs (the retrace makes one, a buffer, where the step writes
    a Python scalar into a tensor: ``mask[:, 0] = False`` traces to ``fill_(x, lift_fresh_copy(_tensor_constant0))``)
    made by ``aten.full`` instead. Torch compiles a graph's tensor constants into extra inputs of the compiled
    function, and the saved form of that function (``torch.compiler.load_compiled_function``, torch 2.13) is called
    without them: a step graph with a constant, saved and loaded by another process, got too few inputs (a
    ``ValueError`` from a Python wrapper, a crash from a C++ one). Returns how many were folded."""
    from torch._subclasses import FakeTensor

    folded = 0
    for sub, node, value in _attribute_tensors(gm):
        if value.dim() == 0 and not isinstance(value, FakeTensor):
            with sub.graph.inserting_before(node):
                full = sub.graph.call_function(torch.ops.aten.full.default, ([], value.item()),
                                               {"dtype": value.dtype, "device": value.device})
            full.meta.update(node.meta)
            node.replace_all_uses_with(full)
            sub.graph.erase_node(node)
            if not sub.graph.find_nodes(op="get_attr", target=node.target):  # its last reader
                delattr(sub, node.target)
            sub.recompile()
            folded += 1
    if folded:  # (counted only where something was folded: tests compare a greedy step's whole dict)
        counters["dflash"]["scalar_constants_folded"] += folded
    return folded


def _attribute_tensors(gm: torch.fx.GraphModule) -> list[tuple]:
    """``(graph module, get_attr node, tensor)`` for every tensor ``gm`` and its subgraphs read as an attribute (the
    retrace registers its constants as buffers; a dynamo graph passes the step's parameters and buffers as inputs)."""
    from .passes import graph_modules

    found = []
    for sub in graph_modules(gm):
        for node in sub.graph.find_nodes(op="get_attr"):
            value = getattr(sub, node.target, None) if "." not in node.target else None
            if isinstance(value, torch.Tensor):
                found.append((sub, node, value))
    return found


def tensor_constants(gm: torch.fx.GraphModule) -> list[str]:
    """The names of the tensors ``gm`` and its subgraphs read as attributes."""
    return [node.target for _, node, _ in _attribute_tensors(gm)]


def _inductor(gm, example_inputs, options):
    from torch._inductor.compile_fx import compile_fx

    fold_scalar_constants(gm)
    kept = tensor_constants(gm)
    kinds = {x.device.type for x in example_inputs if isinstance(x, torch.Tensor)}
    # compile_fx reads a graph whose placeholders carry ``val`` as an exported one and, with the C++ wrapper, drops
    # its SymInt inputs: make_fx's placeholders lose ``val`` (dynamo's own graphs carry none), so the inputs count.
    for node in gm.graph.find_nodes(op="placeholder"):
        node.meta.pop("val", None)
    opts = inductor_options(kinds, options, regions=bool(_region_calls(gm)))
    if _collectives(gm):  # a tensor-parallel step: Inductor's defaults that break it, unless ``options`` set them
        from .runtime.distributed import waited_collectives

        opts.update({**COLLECTIVE_INDUCTOR_OPTIONS, **(options or {})})
        counters["dflash"]["waited_collectives"] += waited_collectives(gm)  # complete before any read
    from .cpp_units import one_unit_per_graph
    from .tiling_analysis import exact_shortcut

    # one C++ build per graph (cpp_units.py); no sympy.simplify of polynomial indices in the tiling analysis
    with inductor_config.patch(opts), one_unit_per_graph(), exact_shortcut():
        compiled = compile_fx(gm, example_inputs)
    if not kept:
        return compiled
    # a constant that is not a scalar: the graph runs from memory, never saved (see fold_scalar_constants)
    counters["dflash"]["graphs_with_tensor_constants"] += 1
    _say_once(f"constants-{kept[:3]}", "dflash: a step graph reads tensor constants (%s); it is compiled for this "
              "process only, not saved to the compile cache (a saved graph is called without them)",
              ", ".join(kept[:3]))
    return lambda *args: compiled(*args)


def _region_calls(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """``gm``'s calls of nested compile regions' subgraphs."""
    return gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph)


def _collectives(gm: torch.fx.GraphModule) -> int:
    """The graph's functional collectives (a tensor-parallel step's all-reduces and all-gathers), waits excluded."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
               and n.target.namespace == "_c10d_functional" and n.target.__name__.split(".")[0] != "wait_tensor")


@_over_parts
def dflash_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None):
    """``torch.compile(..., backend="dflash")``: DFlash passes, device lowerings, then Inductor."""
    return _inductor(lower(dflash_passes(gm, example_inputs), example_inputs), example_inputs, options)


def neuron_sdk_available() -> bool:
    return importlib.util.find_spec("torch_neuronx") is not None and importlib.util.find_spec("nki") is not None


@_over_parts
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
