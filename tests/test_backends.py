"""The backends: entry points, any-graph behaviour, the Neuron fallback message, what the passes leave in a step."""

import subprocess
import sys
import textwrap
from collections import Counter

import expecttest
import pytest
import torch

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper
from dflash_compile.backends import dflash_passes
from tiny_models import VOCAB, tiny_target


def _fresh_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=600)


def test_entry_points_in_a_fresh_interpreter():
    # No import of dflash_compile: torch finds the backends through the torch_dynamo_backends entry points.
    r = _fresh_python("""
        import sys, torch
        def f(x, y):
            return torch.nn.functional.gelu(x @ y).sum(-1) + 1
        x, y = torch.randn(4, 8), torch.randn(8, 3)
        for name in ("dflash", "dflash_neuron"):
            torch._dynamo.reset()
            out = torch.compile(f, backend=name, fullgraph=True)(x, y)
            torch.testing.assert_close(out, f(x, y))
        print("ok", "dflash_compile" in sys.modules)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["ok", "True"]  # imported by torch, lazily, not by us
    # Without the Neuron SDK the fallback is said, once.
    assert r.stderr.count("Neuron SDK (torch_neuronx, nki) is not installed") == 1, r.stderr


def test_dynamic_graph_is_compiled_unchanged(monkeypatch):
    """A graph with a symbolic size and nothing the passes match reaches Inductor as its own ATen, the size still
    dynamo's symbol, and one graph serves every size."""
    import dflash_compile.backends as backends

    handed = []

    def spy(gm, example_inputs, options):
        handed.append((gm, example_inputs))
        return real(gm, example_inputs, options)

    real = backends._inductor
    monkeypatch.setattr(backends, "_inductor", spy)

    def f(x):
        return x.sin() * 2

    torch._dynamo.reset()
    g = torch.compile(f, backend="dflash", dynamic=True)
    for n in (3, 5, 8):
        x = torch.randn(n)
        torch.testing.assert_close(g(x), f(x))
    assert len(handed) == 1  # one graph for every size
    gm, example_inputs = handed[0]
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops == [torch.ops.aten.sin.default, torch.ops.aten.mul.Tensor]
    sizes = [x for x in example_inputs if isinstance(x, torch.SymInt)]
    sizes += [d for x in example_inputs if isinstance(x, torch.Tensor) for d in x.shape if isinstance(d, torch.SymInt)]
    assert sizes, f"no symbolic size among the compiled graph's inputs: {example_inputs}"


def test_step_after_passes_keeps_only_dflash_ops_for_the_hot_patterns():
    # What the passes must leave in the qwen3 step (not a frozen census of every ATen op, which any harmless refactor
    # or torch upgrade changes): one fused drafter K/V projection, one pool write per target layer plus the
    # drafter's, one attention per target layer and per drafter layer; no SDPA, no index_put_ into a pool and no
    # dense gather of pool rows (aten.index) left over.
    n_target, n_draft = 2, 2
    target = tiny_target("qwen3", num_hidden_layers=n_target)
    draft = DFlashDraftModel.from_target(target, num_layers=n_draft, block_size=4, target_layer_ids=[0, 1], seed=0)
    spec = DFlashSpecWrapper(target, draft, 3, max_batch_size=2, batch_buckets=(2,), max_seq_len=32, page_size=8)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(dflash_passes(gm, example_inputs))
        return graphs[-1]  # run the passed pre-dispatch graph as is

    torch._dynamo.reset()
    spec.compile(backend=capture, fullgraph=True, regions=False)  # the layers inline (regions: the test below)
    ref = DFlashSpecWrapper(target, draft, 3, max_batch_size=2, batch_buckets=(2,), max_seq_len=32, page_size=8)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    assert torch.equal(spec.generate(prompts, max_new_tokens=8, pad_token_id=VOCAB - 2),
                       ref.generate(prompts, max_new_tokens=8, pad_token_id=VOCAB - 2))
    assert len(graphs) == 1
    census = Counter(str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function")
    assert {k: v for k, v in census.items() if k.startswith("dflash.")} == {
        "dflash.fused_kv_proj.default": 1,
        "dflash.paged_kv_write.default": n_target + 1,
        "dflash.block_attention.default": n_target + n_draft,
    }
    gone = ("scaled_dot_product", "index_put", "aten.index.", "_unsafe_index")
    left = sorted(k for k in census if any(g in k for g in gone))
    assert not left, left


def test_repeated_layers_compile_as_one_region_each_with_the_passes_inside():
    # With regions (the default for deep targets) the step graph calls one subgraph from every target layer and one
    # from every drafter layer; the passes run inside them (the target's pool write, once for all its layers; each
    # region's attention) and on the step around them (the drafter's fused projection and pool write). Dynamo
    # traces the first layer of each class alone and stamps the others out of it (each layer hands its region its
    # own pool, not the whole cache, so torch's subgraph reuse applies).
    from torch._dynamo.utils import compilation_time_metrics, counters

    from dflash_compile.models.draft_model import DFlashDecoderLayer
    from dflash_compile.passes import graph_modules

    n_target, n_draft = 4, 3
    target = tiny_target("qwen3", num_hidden_layers=n_target)
    draft = DFlashDraftModel.from_target(target, num_layers=n_draft, block_size=4, target_layer_ids=[0, 3], seed=0)
    kw = dict(max_batch_size=2, batch_buckets=(2,), max_seq_len=32, page_size=8)
    spec = DFlashSpecWrapper(target, draft, 3, **kw)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(dflash_passes(gm, example_inputs))
        return graphs[-1]

    torch._dynamo.reset()
    counters.clear()
    compilation_time_metrics.clear()
    spec.compile(backend=capture, fullgraph=True, regions=True)  # (by default only stacks of 16 layers and more)
    layer = type(target.model.layers[0])
    assert spec.compiled_steps.keys.region_types == [layer, DFlashDecoderLayer]
    ref = DFlashSpecWrapper(target, draft, 3, **kw)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    assert torch.equal(spec.generate(prompts, max_new_tokens=8, pad_token_id=VOCAB - 2),
                       ref.generate(prompts, max_new_tokens=8, pad_token_id=VOCAB - 2))
    for kind, method in ((layer, "forward"), (DFlashDecoderLayer, "paged_forward")):  # the marks are gone
        assert method not in vars(kind) or not hasattr(vars(kind)[method], "__marked_compile_region_fn__")
    assert len(graphs) == 1
    traced = len(compilation_time_metrics["invoke_subgraph_trace"])
    stamped = len(compilation_time_metrics["invoke_subgraph_reuse_stamp_out"])
    assert (traced, stamped) == (2, n_target - 1 + n_draft - 1)
    top, *subs = graph_modules(graphs[0])
    calls = top.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph)
    per_subgraph = Counter(n.args[0].target for n in calls)
    assert len(subs) == 2 and sorted(per_subgraph.values()) == [n_draft, n_target]
    assert counters["dflash"]["region_calls"] == n_target + n_draft and counters["dflash"]["region_subgraphs"] == 2
    assert counters["dflash"]["paged_kv_write"] == 2  # one inside the target's region (every layer's), the drafter's

    def dflash_ops(gm):
        return Counter(str(n.target) for n in gm.graph.nodes if str(n.target).startswith("dflash."))

    by_calls = {getattr(top, name): n for name, n in per_subgraph.items()}
    target_sub, draft_sub = sorted(subs, key=lambda m: by_calls[m] != n_target)
    assert dflash_ops(target_sub) == {"dflash.paged_kv_write.default": 1, "dflash.block_attention.default": 1}
    assert dflash_ops(draft_sub) == {"dflash.block_attention.default": 1}
    assert dflash_ops(top) == {"dflash.fused_kv_proj.default": 1, "dflash.paged_kv_write.default": 1}
    assert counters["dflash"]["block_attention"] == 2  # one a region, however many layers call it
    # each mask enters its region as an input: the pass reads it where the step made it, and the region reads the
    # block table, lengths and positions instead (no SDPA, no gather of pool rows, no mask inside)
    gone = ("scaled_dot_product", "index_put", "aten.index.")
    assert not any(g in str(n.target) for g in gone for m in (top, *subs) for n in m.graph.nodes)
    for sub in subs:
        assert len({len(n.args) for n in calls if getattr(top, n.args[0].target) is sub}) == 1


def test_graphs_with_regions_run_without_inductors_size_asserts():
    """A CPU graph that calls nested compile regions keeps Inductor's Python wrapper; its ``assert_size_stride``
    calls on every input and extern output (~25 a decoder layer) are off (dynamo's guards check the inputs; the
    kernels' fake implementations are checked by ``tests/lowerings/test_fake_impls.py``), and ``options`` turns
    them back on. The results are the eager function's either way."""
    from torch._inductor.utils import run_and_get_code

    @torch.compiler.nested_compile_region
    def layer(x, w):
        return torch.relu(x @ w) + x

    def f(x, ws):
        for w in ws:
            x = layer(x, w)
        return x.sum(-1)

    x, ws = torch.randn(4, 16), [torch.randn(16, 16) for _ in range(3)]
    asserts = {}
    for options in (None, {"size_asserts": True}):
        torch._dynamo.reset()
        with torch._inductor.config.patch(fx_graph_cache=False):
            out, code = run_and_get_code(torch.compile(f, backend="dflash", options=options), x, ws)
        torch.testing.assert_close(out, f(x, ws))
        assert len(code) == 1 and "invoke_subgraph" in code[0]
        asserts[bool(options)] = code[0].count("assert_size_stride(")
    assert asserts[False] == 0 and asserts[True] >= 3


def test_tensor_subclass_inputs_compile_over_their_plain_parts():
    """A graph whose inputs are tensor subclasses (a tensor-parallel target's DTensor parameters; here torch's
    ``TwoTensor``, whose ops apply to both of its parts) is retraced over the parts: the graph holds only plain
    tensors, ops on the subclass traced through its own dispatch, and the compiled function, called with the
    subclass, computes what eager does."""
    import torch.nn.functional as F
    from torch._dynamo.utils import counters
    from torch.testing._internal.two_tensor import TwoTensor

    from dflash_compile import backends

    def f(x, w, idx):
        y = F.linear(x, w)
        e = F.embedding(idx, w)
        return y.a + y.b, (e.a * e.b).sum(-1)

    w = TwoTensor(torch.randn(3, 4), torch.randn(3, 4))
    x, idx = torch.randn(2, 4), torch.tensor([0, 2])
    sub = backends.Subclasses.of([x, w, idx])
    assert sub.paths == [[()], [("a",), ("b",)], [()]]
    fn, flat = sub.graph(torch.fx.symbolic_trace(f), [x, w, idx])
    with backends._subclass_ops_traced_through():
        plain = backends._retrace(fn, flat)
    expecttest.TestCase().assertExpectedInline(plain.code.strip(), """\
def forward(self, arg0_1, arg1_1, arg2_1, arg3_1):
    t = torch.ops.aten.t.default(arg1_1)
    t_1 = torch.ops.aten.t.default(arg2_1)
    mm = torch.ops.aten.mm.default(arg0_1, t);  t = None
    mm_1 = torch.ops.aten.mm.default(arg0_1, t_1);  arg0_1 = t_1 = None
    embedding = torch.ops.aten.embedding.default(arg1_1, arg3_1);  arg1_1 = None
    embedding_1 = torch.ops.aten.embedding.default(arg2_1, arg3_1);  arg2_1 = arg3_1 = None
    add = torch.ops.aten.add.Tensor(mm, mm_1);  mm = mm_1 = None
    mul = torch.ops.aten.mul.Tensor(embedding, embedding_1);  embedding = embedding_1 = None
    sum_1 = torch.ops.aten.sum.dim_IntList(mul, [-1]);  mul = None
    return (add, sum_1)""")
    counters.clear()
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="dflash", fullgraph=True)
    for got, want in zip(compiled(x, w, idx), f(x, w, idx)):
        torch.testing.assert_close(got, want)
    assert counters["dflash"]["subclass_graphs"] == 1 and counters["dflash"]["collectives"] == 0


def test_collectives_fused_with_their_waits():
    """``distributed.waited_collectives``: each functional all-reduce / all-gather and its ``wait_tensor`` become one
    ``dflash.*_waited`` op returning a new tensor (nothing can read the result before the collective completes);
    the graph computes what it did. On a one-rank gloo group, in this process."""
    import torch.distributed as dist
    from torch.fx.experimental.proxy_tensor import make_fx

    from dflash_compile.runtime.distributed import waited_collectives

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        name = dist.group.WORLD.group_name
        c10d = torch.ops._c10d_functional

        def f(x):
            s = c10d.wait_tensor(c10d.all_reduce(x * 2, "sum", name))
            g = c10d.wait_tensor(c10d.all_gather_into_tensor(s + 1, 1, name))
            return g.relu()

        gm = make_fx(f)(torch.randn(3, 4))
        x = torch.randn(3, 4)
        want = gm(x)
        assert waited_collectives(gm) == 2
        code = gm.code.strip().replace(repr(name), "GROUP")
        expecttest.TestCase().assertExpectedInline(code, """\
def forward(self, x_1):
    mul = torch.ops.aten.mul.Tensor(x_1, 2);  x_1 = None
    all_reduce_waited_default = torch.ops.dflash.all_reduce_waited.default(mul, 'sum', GROUP);  mul = None
    add = torch.ops.aten.add.Tensor(all_reduce_waited_default, 1);  all_reduce_waited_default = None
    all_gather_into_tensor_waited_default = torch.ops.dflash.all_gather_into_tensor_waited.default(add, 1, GROUP);  add = None
    relu = torch.ops.aten.relu.default(all_gather_into_tensor_waited_default);  all_gather_into_tensor_waited_default = None
    return relu""")
        torch.testing.assert_close(gm(x), want)
        from torch._inductor.compile_fx import compile_fx
        torch.testing.assert_close(compile_fx(gm, [x])(x), want)  # Inductor calls the fused ops
        reduce_scatter = make_fx(lambda x: c10d.wait_tensor(c10d.reduce_scatter_tensor(x, "sum", 1, name)))(x)
        with pytest.raises(NotImplementedError, match="reduce_scatter_tensor"):
            waited_collectives(reduce_scatter)
    finally:
        dist.destroy_process_group()
