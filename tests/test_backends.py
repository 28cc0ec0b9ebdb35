"""The backends: entry points, any-graph behaviour, the Neuron fallback message, and the step's op census."""

import subprocess
import sys
import textwrap
from collections import Counter

import expecttest
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


def test_dynamic_graph_is_compiled_unchanged():
    def f(x):
        return x.sin() * 2

    torch._dynamo.reset()
    g = torch.compile(f, backend="dflash", dynamic=True)
    for n in (3, 5):
        x = torch.randn(n)
        torch.testing.assert_close(g(x), f(x))


class TestStepCensus(expecttest.TestCase):
    def test_qwen3_step_after_passes(self):
        target = tiny_target("qwen3", num_hidden_layers=2)
        draft = DFlashDraftModel.from_target(target, num_layers=2, block_size=4, target_layer_ids=[0, 1], seed=0)
        spec = DFlashSpecWrapper(target, draft, max_batch_size=2, batch_buckets=(2,), max_seq_len=32, page_size=8)
        graphs = []

        def capture(gm, example_inputs):
            graphs.append(dflash_passes(gm, example_inputs))
            return graphs[-1]  # run the passed pre-dispatch graph as is

        torch._dynamo.reset()
        spec.compile(backend=capture, fullgraph=True)
        ref = DFlashSpecWrapper(target, draft, max_batch_size=2, batch_buckets=(2,), max_seq_len=32, page_size=8)
        prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
        assert torch.equal(spec.generate(prompts, max_new_tokens=8, pad_token_id=VOCAB - 2),
                           ref.generate(prompts, max_new_tokens=8, pad_token_id=VOCAB - 2))
        assert len(graphs) == 1
        census = Counter(str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function")
        dflash_ops = {k: v for k, v in sorted(census.items()) if k.startswith("dflash.")}
        self.assertExpectedInline(str(dflash_ops), """{'dflash.block_attention.default': 4, 'dflash.fused_kv_proj.default': 1, 'dflash.paged_kv_write.default': 3}""")
        for gone in ("aten.scaled_dot_product_attention.default", "aten.index_put_.default", "aten.index.Tensor"):
            assert gone not in census, gone
        self.assertExpectedInline("\n".join(f"{k}: {v}" for k, v in sorted(census.items())), """\
<built-in function getitem>: 1
aten.__and__.Tensor: 2
aten.add.Tensor: 42
aten.alias.default: 1
aten.arange.default: 4
aten.argmax.default: 2
aten.cat.default: 15
aten.clamp.default: 3
aten.cos.default: 3
aten.cumprod.default: 1
aten.embedding.default: 2
aten.eq.Tensor: 1
aten.expand.default: 3
aten.flatten.using_ints: 2
aten.floor_divide.default: 2
aten.full_like.default: 1
aten.gather.default: 3
aten.le.Tensor: 2
aten.linear.default: 32
aten.lt.Scalar: 1
aten.mean.dim: 19
aten.mul.Tensor: 69
aten.neg.default: 8
aten.new_full.default: 1
aten.new_zeros.default: 2
aten.permute.default: 1
aten.pow.Tensor_Scalar: 19
aten.remainder.Scalar: 2
aten.reshape.default: 12
aten.rsqrt.default: 19
aten.select.int: 13
aten.silu.default: 4
aten.sin.default: 3
aten.slice.Tensor: 19
aten.stack.default: 4
aten.sum.dim_IntList: 1
aten.to.device: 1
aten.to.dtype: 38
aten.transpose.int: 18
aten.unsqueeze.default: 23
aten.view.default: 14
aten.where.ScalarOther: 6
aten.where.self: 1
dflash.block_attention.default: 4
dflash.fused_kv_proj.default: 1
dflash.paged_kv_write.default: 3""")
