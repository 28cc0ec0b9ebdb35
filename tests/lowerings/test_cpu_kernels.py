"""The CPU kernels against the oracles in ``lowerings/ops.py``."""

import itertools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dflash_compile.lowerings.cpu import row_linear
from dflash_compile.lowerings.cpu.block_attention import aten_block_attention, block_attention
from dflash_compile.lowerings.ops import _block_attention_reference

CASES = list(itertools.product([1, 5], [4, 16], [1, 2, 4], [False, True], [(0, 0), (3, 0), (0, 8), (3, 8)],
                               [False, True]))


def _kernel(*args):
    return torch.ops.dflash_cpu.block_attention(*args)


# The CPU lowering (the C++ kernel for fp32, the ATen form for other dtypes) and each form alone
IMPLS = {"lowering": block_attention, "aten": aten_block_attention, "kernel": _kernel}
needs_kernel = pytest.mark.skipif(not row_linear.load(), reason="the CPU kernels cannot be built here (no compiler)")


def _case(T, page, gqa, with_block, dtype, D=16, pool_lead=False):
    g = torch.Generator().manual_seed(T * 100 + page + gqa)
    B, Hkv, NB = 3, 2, 4
    slots = NB * B * page + 2
    if pool_lead:  # the target's per-layer [2, slots, Hkv, D] pool: K and V are views of it (as the pass hands them)
        pool = torch.randn(2, slots, Hkv, D, generator=g, dtype=dtype)
        k_pool, v_pool = pool[0], pool[1]
    else:
        k_pool = torch.randn(slots, Hkv, D, generator=g, dtype=dtype)
        v_pool = torch.randn(slots, Hkv, D, generator=g, dtype=dtype)
    table = torch.randperm(NB * B, generator=g)[: B * NB].view(B, NB)
    ctx_lens = torch.tensor([0, 2 * page + 1, NB * page - 1])
    table[1, 3] = -1  # unallocated beyond row 1's length
    q_pos = ctx_lens[:, None] + torch.arange(T)
    q = torch.randn(B, Hkv * gqa, T, D, generator=g, dtype=dtype)
    # block K/V as the drafter hands them: [B, T, Hkv, D] transposed to [B, Hkv, T, D] (not contiguous)
    kb = torch.randn(B, T, Hkv, D, generator=g, dtype=dtype).transpose(1, 2) if with_block else None
    vb = torch.randn(B, T, Hkv, D, generator=g, dtype=dtype).transpose(1, 2) if with_block else None
    return q, k_pool, v_pool, table, ctx_lens, q_pos, kb, vb


@pytest.mark.parametrize("T,page,gqa,causal,window_chunk,with_block", CASES)
@pytest.mark.parametrize("impl,dtype,atol", [("lowering", torch.float32, 1e-5), ("lowering", torch.float64, 1e-10),
                                             ("aten", torch.float32, 1e-5),
                                             pytest.param("kernel", torch.float32, 1e-5, marks=needs_kernel)])
def test_block_attention_matches_reference(T, page, gqa, causal, window_chunk, with_block, impl, dtype, atol):
    window, chunk = window_chunk
    D = 16 if impl != "kernel" else (16 + 3 if gqa == 2 else 16)  # the kernel also on a D its vectors do not divide
    q, k_pool, v_pool, table, ctx_lens, q_pos, kb, vb = _case(T, page, gqa, with_block, dtype, D=D,
                                                              pool_lead=causal)
    args = (q, k_pool, v_pool, table, ctx_lens, q_pos, kb, vb, page, causal, window, D**-0.5, chunk)
    out = IMPLS[impl](*args)
    torch.testing.assert_close(out, _block_attention_reference(*args), atol=atol, rtol=atol)
    assert out.is_contiguous()
    assert with_block or not out[0].any()  # row 0 (no context, no block) sees nothing: zeros


@needs_kernel
@pytest.mark.parametrize("T,gqa,D", [(9, 3, 8), (16, 4, 24), (7, 3, 64), (3, 1, 40)])
def test_the_kernel_on_many_queries_per_kv_head(T, gqa, D):
    """Query counts past one register tile (27 and 64 queries per KV head: several groups of query vectors and of
    query rows), head dims of whole vectors, of a vector past two, of neither: against the reference."""
    for causal, with_block in ((True, False), (False, True)):
        q, k_pool, v_pool, table, ctx_lens, q_pos, kb, vb = _case(T, 4, gqa, with_block, torch.float32, D=D)
        args = (q, k_pool, v_pool, table, ctx_lens, q_pos, kb, vb, 4, causal, 0, D**-0.5, 0)
        torch.testing.assert_close(_kernel(*args), _block_attention_reference(*args), atol=1e-5, rtol=1e-5)


@needs_kernel
def test_a_querys_result_does_not_depend_on_the_queries_beside_it():
    """Bit for bit: a causal block of T queries against each query alone (its own length), one query head against the
    group of heads sharing its KV head. Plain decoding and a verified block read the same values."""
    B, Hkv, gqa, T, D, page, NB = 2, 2, 3, 8, 64, 4, 8
    g = torch.Generator().manual_seed(0)
    k_pool, v_pool = torch.randn(2, B * NB * page, Hkv, D, generator=g)
    table = torch.randperm(B * NB, generator=g).view(B, NB)
    ctx_lens = torch.tensor([5, 13])
    q_pos = ctx_lens[:, None] + torch.arange(T)
    q = torch.randn(B, Hkv * gqa, T, D, generator=g)
    lens = ctx_lens + T  # the block's K/V in the pool, as the target's verify writes it
    block = _kernel(q, k_pool, v_pool, table, lens, q_pos, None, None, page, True, 0, D**-0.5, 0)
    for t in range(T):
        alone = _kernel(q[:, :, t:t + 1].contiguous(), k_pool, v_pool, table, ctx_lens + t + 1, q_pos[:, t:t + 1],
                        None, None, page, True, 0, D**-0.5, 0)
        assert torch.equal(alone[:, :, 0], block[:, :, t])
    one_head = q.view(B, Hkv, gqa, T, D)[:, :, 0].contiguous()  # the first query head of each KV head
    alone = _kernel(one_head, k_pool, v_pool, table, lens, q_pos, None, None, page, True, 0, D**-0.5, 0)
    assert torch.equal(alone, block.view(B, Hkv, gqa, T, D)[:, :, 0])


@needs_kernel
def test_the_generic_lane_sum_equals_the_reference_too():
    """The scores' lane sum in its generic form (what an AVX-512 or an Arm machine builds; here the AVX form runs),
    built in a process of its own: against the reference, and a block's query bit for bit the query alone."""
    code = textwrap.dedent("""
        import torch
        from dflash_compile.lowerings.cpu import row_linear
        from tests.lowerings.test_cpu_kernels import (
            _case, _kernel, test_a_querys_result_does_not_depend_on_the_queries_beside_it)
        from dflash_compile.lowerings.ops import _block_attention_reference
        assert row_linear.load()
        for T, gqa, D in ((1, 3, 64), (8, 3, 64), (3, 2, 19), (9, 1, 40)):
            for causal, with_block in ((True, False), (False, True)):
                q, k_pool, v_pool, table, ctx_lens, q_pos, kb, vb = _case(T, 4, gqa, with_block, torch.float32, D=D)
                args = (q, k_pool, v_pool, table, ctx_lens, q_pos, kb, vb, 4, causal, 0, D**-0.5, 0)
                torch.testing.assert_close(_kernel(*args), _block_attention_reference(*args), atol=1e-5, rtol=1e-5)
        test_a_querys_result_does_not_depend_on_the_queries_beside_it()
        print("ok")
    """)
    env = dict(os.environ, DFLASH_ROW_LINEAR_CFLAGS="-DDFLASH_GENERIC_SUM_LANES")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@pytest.mark.parametrize("impl", ["lowering", "aten", pytest.param("kernel", marks=needs_kernel)])
def test_nan_in_invisible_slots_does_not_leak(impl):
    B, H, D, page = 2, 2, 8, 4
    k_pool, v_pool = torch.randn(4 * page * B + 2, H, D), torch.randn(4 * page * B + 2, H, D)
    table = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    ctx_lens = torch.tensor([3, 9])
    k_pool[3:16], v_pool[3:16] = float("nan"), float("nan")  # row 0's blocks past its length
    q = torch.randn(B, H, 2, D)
    args = (q, k_pool, v_pool, table, ctx_lens, ctx_lens[:, None] + torch.arange(2), None, None, page, True, 0, 0.3)
    out = IMPLS[impl](*args)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, _block_attention_reference(*args))


@needs_kernel
def test_the_lowering_calls_the_kernel_for_fp32(monkeypatch):
    from torch.fx.experimental.proxy_tensor import make_fx

    def ops(dtype, T=2):
        q, k_pool, v_pool, table, ctx_lens, q_pos, kb, vb = _case(T, 4, 2, True, dtype, pool_lead=True)
        gm = make_fx(lambda *a: block_attention(*a, 4, True, 0, 0.25), tracing_mode="fake")(
            q, k_pool, v_pool, table, ctx_lens, q_pos, kb, vb)
        return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}

    assert "dflash_cpu.block_attention.default" in ops(torch.float32)
    assert not any(op.startswith("dflash_cpu") for op in ops(torch.float64))
    # 3 rows of 4 query heads (2 per KV head) over a block of 24: 48 queries per KV head, 288 in all
    assert "dflash_cpu.block_attention.default" in ops(torch.float32, T=24)
    monkeypatch.setenv("DFLASH_CPU_ATTENTION", "0")
    assert not any(op.startswith("dflash_cpu") for op in ops(torch.float32))
    assert row_linear.state().endswith(" attention off")


@needs_kernel
def test_the_kernel_refuses_what_it_does_not_take():
    q, k_pool, v_pool, table, ctx_lens, q_pos, _, _ = _case(1, 4, 2, False, torch.float64)
    with pytest.raises(RuntimeError, match="takes fp32 CPU tensors"):
        _kernel(q, k_pool, v_pool, table, ctx_lens, q_pos, None, None, 4, True, 0, 0.25)
    q, k_pool, v_pool, table, ctx_lens, q_pos, _, _ = _case(1, 4, 2, False, torch.float32)
    table[2, 1] = -1  # row 2 reads position 4 and up from an unallocated page: an error, not a read of slot -4
    with pytest.raises(RuntimeError, match="from page -1"):
        _kernel(q, k_pool, v_pool, table, ctx_lens, q_pos, None, None, 4, True, 0, 0.25)
