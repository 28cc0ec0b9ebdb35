"""Tensor constants in a step graph (backends.fold_scalar_constants): torch's saved form of a compiled graph is called
without them, so 0-dim ones are made by ``aten.full`` and a graph keeping any other is never saved. The cross-process
case (a sampled step graph, which writes ``False`` into a mask, saved and loaded) is in test_deferred_imports.py."""

import expecttest
import torch
from torch._dynamo.utils import counters
from torch.fx.experimental.proxy_tensor import make_fx

from dflash_compile.backends import _inductor, fold_scalar_constants, tensor_constants


def _masked(x):
    m = x > 0
    m[:, 0] = False  # a Python scalar written into a tensor: the retrace keeps it as a 0-dim constant
    return torch.where(m, x, 0.0).sum(1)


def test_a_written_scalar_is_made_by_full_and_the_graph_computes_the_same():
    x = torch.randn(3, 4)
    gm = make_fx(_masked, pre_dispatch=True)(x)
    assert tensor_constants(gm) == ["_tensor_constant0"]
    counters.clear()
    assert fold_scalar_constants(gm) == 1 and counters["dflash"]["scalar_constants_folded"] == 1
    assert tensor_constants(gm) == [] and not hasattr(gm, "_tensor_constant0")
    expecttest.TestCase().assertExpectedInline(gm.code.strip(), """\
def forward(self, x_1):
    gt = torch.ops.aten.gt.Scalar(x_1, 0)
    full_default = torch.ops.aten.full.default([], False, dtype = torch.bool, device = device(type='cpu'))
    lift_fresh_copy = torch.ops.aten.lift_fresh_copy.default(full_default);  full_default = None
    select = torch.ops.aten.select.int(gt, 1, 0)
    fill_ = torch.ops.aten.fill_.Tensor(select, lift_fresh_copy);  select = lift_fresh_copy = fill_ = None
    where = torch.ops.aten.where.ScalarOther(gt, x_1, 0.0);  gt = x_1 = None
    sum_1 = torch.ops.aten.sum.dim_IntList(where, [1]);  where = None
    return sum_1""")
    torch.testing.assert_close(gm(x), _masked(x))
    compiled = _inductor(gm, [x], None)
    assert counters["dflash"]["graphs_with_tensor_constants"] == 0  # nothing keeps it from being saved
    out = compiled(x.clone())
    torch.testing.assert_close(out[0] if isinstance(out, (list, tuple)) else out, _masked(x))


def test_a_graph_keeping_a_tensor_constant_is_compiled_for_this_process_only(caplog):
    table = torch.arange(4.0)

    def lookup(x):
        return x * torch.tensor([1.0, 2.0, 3.0, 4.0]) + table.sum()

    x = torch.randn(3, 4)
    gm = make_fx(lookup, pre_dispatch=True)(x)
    assert len(tensor_constants(gm)) == 2  # the literal and the closure's table, neither 0-dim
    counters.clear()
    compiled = _inductor(gm, [x], None)
    assert counters["dflash"]["graphs_with_tensor_constants"] == 1  # a plain callable: CompiledSteps keeps it in memory
    assert "not saved to the compile cache" in caplog.text
    out = compiled(x.clone())
    torch.testing.assert_close(out[0] if isinstance(out, (list, tuple)) else out, lookup(x))
