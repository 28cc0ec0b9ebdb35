"""``dflash_cpu::row_linear`` (the CPU lowering of fp32 linears) against its reference, ``F.linear``, and the lowering
that puts it in CPU step graphs."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from dflash_compile.lowerings.cpu import row_linear

pytestmark = pytest.mark.skipif(not row_linear.load(), reason="the row_linear CPU kernel cannot be built here (no "
                                "C++ compiler or ninja; the log line says which)")


def _op(x, w, b=None):
    with torch.no_grad():
        return torch.ops.dflash_cpu.row_linear(x, w, b)


def _check_close(x, w, b=None):
    """The op's error against fp64 stays within a few times MKL's own (another summation order, same precision)."""
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    ours = (_op(x, w, b).double() - ref).abs().max().item()
    mkl = (F.linear(x, w, b).double() - ref).abs().max().item()
    assert ours <= 4 * mkl + 1e-5 * ref.abs().max().item(), (tuple(x.shape), tuple(w.shape), ours, mkl)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17, 32, 33, 40])
@pytest.mark.parametrize("n, k", [(48, 64), (37, 20), (100, 577), (576, 1536)])
def test_equals_linear_for_every_row_count_and_ragged_sizes(rows, n, k):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x, w, b = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    _check_close(x, w)
    _check_close(x, w, b)
    assert _op(x, w, b).shape == (rows, n)


def test_leading_dims_are_rows_and_results_do_not_depend_on_the_other_rows_or_threads():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 4, 96, generator=g), torch.randn(130, 96, generator=g)
    out = _op(x, w)
    assert out.shape == (2, 4, 130)
    _check_close(x, w)
    # a row's value is the same whichever rows share the call (in the op's range) and whatever the thread count
    assert torch.equal(out[1, 2:4], _op(x[1, 2:4], w))
    assert torch.equal(out[1, 3:4], _op(x[1, 3:4], w))  # one row alone (plain decoding at batch 1) too
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(_op(x, w), out)
    finally:
        torch.set_num_threads(threads)


def test_the_kernels_run_on_the_threads_torch_is_given():
    """The library is built with OpenMP: its at::parallel_for (a header template compiled into it) splits a call over
    the calling thread's torch.get_num_threads(). Built without it, every kernel ran on one thread at any count
    (so two threads were no faster than one)."""
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert torch.ops.dflash_cpu.parallel_workers(16) == n
        assert torch.ops.dflash_cpu.parallel_workers(1) == 1  # one task: one thread
    finally:
        torch.set_num_threads(threads)


def _dequantised(kind: str, n: int, k: int, seed: int) -> torch.Tensor:
    """An [n, k] fp32 weight as transformers loads a GGUF file of that quantisation: quantised by the gguf package,
    then dequantised."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    qtype = getattr(gguf.GGMLQuantizationType, kind)
    w = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32) * 0.05
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).reshape(n, k).copy())


@pytest.mark.parametrize("n", [70, 86])  # the last group of panels whole or not, with 8 lanes and with 16
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_a_weight_dequantised_from_block_codes_is_read_as_codes_with_the_fp32_forms_results(kind, n):
    """Such a weight is packed as int8 codes with a scale and offset per block (1.25 bytes a value) for calls of up
    to 4 rows, and the fp32 form for more; the codes are turned back into the same fp32 values, so every row's
    result is bit for bit what the fp32 form gives, whatever the row count."""
    w = _dequantised(kind, n, 96, seed=len(kind) + n)
    plain = w.clone()
    plain[0, 5] = torch.nextafter(plain[0, 5], torch.tensor(1.0))  # one value off the codes: the fp32 form only
    g = torch.Generator().manual_seed(7)
    x, b = torch.randn(9, 96, generator=g), torch.randn(n, generator=g)
    whole = _op(x, w, b)  # 9 rows: the fp32 form
    assert torch.ops.dflash_cpu.row_linear_packed_form(w) == "fp32"
    for rows in (1, 2, 3, 4):
        ours = _op(x[:rows], w, b)
        assert torch.equal(ours, whole[:rows]), rows
        assert torch.equal(ours[:, 1:], _op(x[:rows], plain, b)[:, 1:]), rows  # rows 1.. of both weights are equal
        _check_close(x[:rows], w, b)
    assert torch.ops.dflash_cpu.row_linear_packed_form(w) == "codes fp32"
    assert torch.ops.dflash_cpu.row_linear_packed_form(plain) == "fp32"


def test_codes_can_be_switched_off_and_follow_the_weight(monkeypatch):
    w = _dequantised("Q4_1", 40, 64, seed=1)
    x = torch.randn(2, 64)
    monkeypatch.setenv("DFLASH_ROW_LINEAR_CODES", "0")
    off = _op(x, w)
    assert torch.ops.dflash_cpu.row_linear_packed_form(w) == "fp32"
    monkeypatch.delenv("DFLASH_ROW_LINEAR_CODES")
    w2 = w.clone()
    assert torch.equal(_op(x, w2), off) and torch.ops.dflash_cpu.row_linear_packed_form(w2) == "codes"
    with torch.no_grad():
        w2[3, 0] = 0.123456789  # in place: repacked, and that value fits no block code
    _check_close(x, w2)
    assert torch.ops.dflash_cpu.row_linear_packed_form(w2) == "fp32"


def test_outside_its_range_it_is_at_linear_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 32, generator=g)
    many = torch.randn(row_linear.MAX_ROWS + 1, 32, generator=g)
    assert torch.equal(_op(many, w), F.linear(many, w))
    x = torch.randn(4, 32, generator=g)
    assert torch.equal(_op(x.double(), w.double()), F.linear(x.double(), w.double()))
    assert torch.equal(_op(x, w.t().contiguous().t()), F.linear(x, w.t().contiguous().t()))  # a strided weight


def test_packed_copies_follow_the_weight_in_place_and_go_with_it():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(4, 64, generator=g), torch.randn(80, 64, generator=g)
    gc.collect()
    keep = torch.randn(8, 64, generator=g)
    _op(x, keep)  # packing drops the copies of weights gone before it: every copy held now has a live weight
    before = row_linear.packed_weights()[0]
    first = _op(x, w)
    assert row_linear.packed_weights()[0] == before + 1
    with torch.no_grad():
        w.mul_(-2.0)  # in place: the version counter moves, the packed copy is made again
    torch.testing.assert_close(_op(x, w), -2 * first)
    w2 = torch.empty_like(w).copy_(w)
    del w
    gc.collect()
    torch.testing.assert_close(_op(x, w2), -2 * first)  # a new tensor (maybe at the freed address)
    del w2
    gc.collect()
    _op(x, torch.randn(8, 64))  # the next call that packs drops the copies of weights that are gone: it holds
    assert row_linear.packed_weights()[0] <= before + 1  # its own (its weight gone too), not w's or w2's


def test_prepack_packs_the_linears_the_op_takes_on_a_helper_thread_and_the_op_finds_them():
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(), torch.nn.Linear(48, 40),
                                torch.nn.Linear(40, 24).to(torch.bfloat16))  # bf16: not the op's
    gc.collect()
    keep = torch.randn(8, 8)
    _op(torch.randn(2, 8), keep)  # drops the copies of weights gone before: every copy held now has a live weight
    before = row_linear.packed_weights()[0]
    thread = row_linear.prepack(model)
    assert thread.name == "dflash-prepack"
    thread.join()
    assert row_linear.packed_weights()[0] == before + 2  # the two fp32 weights, not the bf16 one
    x = torch.randn(3, 64)
    with torch.no_grad():
        out = _op(x, model[0].weight, model[0].bias)
    assert row_linear.packed_weights()[0] == before + 2  # the op found the copy made ahead
    assert torch.equal(out, _op(x, model[0].weight.clone(), model[0].bias))  # the same values as a copy it packs
    torch.testing.assert_close(out, F.linear(x, model[0].weight, model[0].bias))
    assert row_linear.prepack(torch.nn.Sequential(torch.nn.ReLU())) is None  # nothing to pack: no thread


def test_a_weight_and_a_slice_of_it_at_the_same_address_keep_their_own_copies():
    g = torch.Generator().manual_seed(5)
    x, fused = torch.randn(4, 32, generator=g), torch.randn(96, 32, generator=g)
    first = fused[:40]  # same address, other shape (a fused projection and its first part)
    for _ in range(2):
        torch.testing.assert_close(_op(x, fused), F.linear(x, fused))
        torch.testing.assert_close(_op(x, first), F.linear(x, first))


def test_a_call_autograd_would_have_to_record_is_refused():
    w = torch.randn(16, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="no derivative"):
        torch.ops.dflash_cpu.row_linear(torch.randn(4, 8), w, None)
    with torch.no_grad():  # parameters require grad; under no_grad (the compiled step) that is fine
        _check_close(torch.randn(4, 8), w.detach())
        torch.ops.dflash_cpu.row_linear(torch.randn(4, 8), w, None)


def test_the_avx2_form_equals_linear_too():
    """Built without AVX-512 (the form an AVX2-only machine builds), in a process of its own."""
    code = textwrap.dedent("""
        import torch, torch.nn.functional as F
        from dflash_compile.lowerings.cpu import row_linear
        assert row_linear.load()
        g = torch.Generator().manual_seed(3)
        for rows in (1, 2, 3, 4, 5, 9, 32):
            for n, k in ((37, 20), (100, 577), (48, 64)):
                x, w, b = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
                ref = F.linear(x.double(), w.double(), b.double())
                with torch.no_grad():
                    ours = (torch.ops.dflash_cpu.row_linear(x, w, b).double() - ref).abs().max().item()
                mkl = (F.linear(x, w, b).double() - ref).abs().max().item()
                assert ours <= 4 * mkl + 1e-5 * ref.abs().max().item(), (rows, n, k, ours, mkl)
        # a weight in block codes (a row's block is d * q, q in [-127, 127]): up to 4 rows read the codes
        d = torch.rand(48, 3, 1, generator=g).half().float()
        q = torch.randint(-127, 128, (48, 3, 32), generator=g)
        q[..., 0] = 127  # each block's largest magnitude, as a quantiser writes it
        w = (q * d).reshape(48, 96)
        x = torch.randn(8, 96, generator=g)
        with torch.no_grad():
            whole = torch.ops.dflash_cpu.row_linear(x, w, None)
            for rows in (1, 2, 3, 4):
                assert torch.equal(torch.ops.dflash_cpu.row_linear(x[:rows], w, None), whole[:rows])
        assert torch.ops.dflash_cpu.row_linear_packed_form(w) == "codes fp32"
        print("ok")
    """)
    env = dict(os.environ, DFLASH_ROW_LINEAR_CFLAGS="-mno-avx512f")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_cpu_graphs_lower_fp32_linears_to_it():
    from torch.fx.experimental.proxy_tensor import make_fx

    from dflash_compile.backends import row_linears

    def f(x, w1, w2, b2, wd):
        h = F.linear(x, w1)
        return F.linear(torch.relu(h), w2, b2), F.linear(x.double(), wd)

    g = torch.Generator().manual_seed(4)
    args = (torch.randn(3, 16, generator=g), torch.randn(24, 16, generator=g), torch.randn(8, 24, generator=g),
            torch.randn(8, generator=g), torch.randn(5, 16, dtype=torch.float64, generator=g))
    gm = make_fx(f, pre_dispatch=True, tracing_mode="fake")(*args)
    counters.clear()
    assert row_linears(gm) == 2
    assert counters["dflash_lowering"]["row_linear"] == 2
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == ["dflash_cpu.row_linear.default", "aten.relu.default", "dflash_cpu.row_linear.default",
                       "aten.to.dtype", "aten.linear.default"], targets  # the fp64 linear stays
    with torch.no_grad():
        for a, b in zip(gm(*args), f(*args)):
            torch.testing.assert_close(a, b)


def test_switched_off_the_lowering_keeps_aten_linear(monkeypatch):
    from torch.fx.experimental.proxy_tensor import make_fx

    from dflash_compile.backends import row_linears

    monkeypatch.setenv("DFLASH_ROW_LINEAR", "0")
    gm = make_fx(lambda x, w: F.linear(x, w), pre_dispatch=True, tracing_mode="fake")(torch.randn(3, 4),
                                                                                    torch.randn(5, 4))
    assert row_linears(gm) == 0
    assert row_linear.state().endswith(" row_linear off")
    assert any(n.target is torch.ops.aten.linear.default for n in gm.graph.nodes)
