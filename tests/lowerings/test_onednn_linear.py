"""The oneDNN fp32 linear (data generation's speed-up) against nn.Linear, and its patch undone on every path."""

import pytest
import torch
from torch import nn

from dflash_compile.lowerings.cpu.onednn_linear import onednn_available, onednn_linears

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("rows", [1, 7, 32, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_nn_linear(rows, bias):
    torch.manual_seed(rows)
    model = nn.Sequential(nn.Linear(96, 200, bias=bias), nn.SiLU(), nn.Linear(200, 33, bias=bias))
    x = torch.randn(2, rows, 96)
    ref = model(x)
    with onednn_linears(model):
        got = model(x)
        assert "forward" in vars(model[0])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert "forward" not in vars(model[0]) and torch.equal(model(x), ref)


def test_undone_when_the_block_raises():
    model = nn.Linear(8, 8)
    with pytest.raises(RuntimeError, match="boom"):
        with onednn_linears(model):
            raise RuntimeError("boom")
    assert "forward" not in vars(model)
