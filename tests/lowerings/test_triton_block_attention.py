"""The Triton ``block_attention`` kernel against the eager reference of ``lowerings/ops.py``: shapes, dtypes,
windows, chunks, split contexts, NaN outside the visible keys, the plan and its refusals."""

import pytest
import torch

from triton_support import (  # noqa: F401
    DEVICE, DTYPES, _assert_close, _attention_inputs, _attention_reference, _on, _ref_dtype, _rope, _to_ref, triton,
)

from dflash_compile.lowerings import ops  # noqa: E402, F401
from dflash_compile.lowerings.triton import block_attention as block_attention_mod  # noqa: E402, F401
from dflash_compile.lowerings.triton import cuda_lowerings, register_cuda_kernels  # noqa: E402, F401
from dflash_compile.lowerings.triton.block_attention import block_attention  # noqa: E402, F401
from dflash_compile.lowerings.triton.fused_kv_proj import fused_kv_proj  # noqa: E402, F401
from dflash_compile.lowerings.triton.paged_kv_write import paged_kv_write  # noqa: E402, F401


# --------------------------------------------------------------------------------------------- block_attention
# (B, Hkv, G = Hq // Hkv, T, D, page_size, pages per row): context lengths up to 40, not tile multiples
ATTENTION_SHAPES = [
    pytest.param(3, 2, 1, 1, 64, 4, 6, id="B3-gqa1-T1-D64-ps4"),
    pytest.param(2, 1, 4, 3, 128, 16, 2, id="B2-gqa4-T3-D128-ps16"),
    pytest.param(3, 2, 2, 5, 64, 4, 10, id="B3-gqa2-T5-D64-ps4"),
    pytest.param(2, 1, 2, 5, 128, 16, 3, id="B2-gqa2-T5-D128-ps16"),
]


@pytest.mark.parametrize("with_block", [False, True], ids=["ctx", "ctx+block"])
@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("B, Hkv, G, T, D, page_size, NB", ATTENTION_SHAPES)
@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
def test_block_attention(dtype, atol, rtol, B, Hkv, G, T, D, page_size, NB, causal, window, with_block):
    gen = torch.Generator().manual_seed(B * 1000 + G * 100 + T * 10 + page_size)
    inputs = _attention_inputs(B, Hkv, G, T, D, page_size, NB, with_block, dtype, gen)
    args = dict(causal=causal, window=window, scale=D**-0.5)
    expected = _attention_reference(inputs, dtype, **args)
    out = block_attention(**_on(inputs, DEVICE), **args)
    assert out.dtype == dtype and out.shape == inputs["q"].shape
    _assert_close(out, expected, atol, rtol)


@pytest.mark.parametrize("window, chunk", [(0, 0), (4, 0), (0, 8), (6, 8)])
def test_block_attention_several_query_tiles(window, chunk):
    """Hq // Hkv * T rows split over several programs, each walking its own context range (chunked too)."""
    gen = torch.Generator().manual_seed(7)
    inputs = _attention_inputs(2, 2, 4, 5, 64, 4, 8, True, torch.float32, gen)
    args = dict(causal=True, window=window, scale=0.125, chunk=chunk)
    expected = _attention_reference(inputs, torch.float32, **args)
    out = block_attention_mod._launch(**_on(inputs, DEVICE), **args, block_m=16, block_n=16)
    _assert_close(out, expected, 2e-5, 2e-5)


@pytest.mark.parametrize("causal, window", [(True, 0), (False, 3), (True, 2)])
def test_block_attention_ignores_nan_in_invisible_slots(causal, window):
    """NaN in pool slots that no query may see (past ctx_len, outside the window, unowned pages) stays out."""
    gen = torch.Generator().manual_seed(3)
    B, Hkv, G, T, D, page_size, NB = 3, 2, 2, 3, 64, 4, 6
    inputs = _attention_inputs(B, Hkv, G, T, D, page_size, NB, True, torch.float32, gen)
    args = dict(causal=causal, window=window, scale=D**-0.5)
    expected = _attention_reference(inputs, torch.float32, **args)

    S = NB * page_size
    visible = ops.block_attention_mask(inputs["ctx_lens"], inputs["q_positions"], S, 0, causal, window).any(1)
    pos = torch.arange(S)
    slots = inputs["block_table"][:, pos // page_size] * page_size + pos % page_size  # [B, S]
    keep = torch.zeros(inputs["k_pool"].shape[0], dtype=torch.bool)
    keep[slots[visible]] = True
    assert (~keep).sum() > 0 and (~visible).any()
    for name in ("k_pool", "v_pool"):
        inputs[name] = inputs[name].masked_fill(~keep[:, None, None], float("nan"))

    out = block_attention(**_on(inputs, DEVICE), **args)
    assert torch.isfinite(out).all()
    _assert_close(out, expected, 2e-5, 2e-5)


def test_block_attention_without_visible_keys_is_zero():
    gen = torch.Generator().manual_seed(5)
    inputs = _attention_inputs(2, 1, 2, 3, 64, 4, 2, False, torch.float32, gen)
    inputs["ctx_lens"].zero_()
    out = block_attention(**_on(inputs, DEVICE), causal=True, window=0, scale=0.125)
    assert torch.equal(out.cpu(), torch.zeros_like(inputs["q"]))


def test_block_attention_reads_ctx_lens_through_its_stride():
    """A non-contiguous ``ctx_lens`` view (every other element of a buffer) is read by its stride."""
    gen = torch.Generator().manual_seed(9)
    inputs = _attention_inputs(3, 2, 2, 3, 64, 4, 6, True, torch.float32, gen)
    buf = torch.full((2 * 3,), 10**6, dtype=inputs["ctx_lens"].dtype)  # the skipped elements would be garbage
    buf[::2] = inputs["ctx_lens"]
    inputs["ctx_lens"] = buf[::2]
    assert inputs["ctx_lens"].stride(0) == 2
    args = dict(causal=False, window=0, scale=0.125)
    expected = _attention_reference(inputs, torch.float32, **args)
    _assert_close(block_attention(**_on(inputs, DEVICE), **args), expected, 2e-5, 2e-5)


# (B, Hkv, G, T, D, page_size, NB): GQA, T=1 and T=16 (a block), contexts up to 64 positions
SPLIT_SHAPES = [
    pytest.param(3, 2, 1, 1, 64, 4, 16, id="B3-gqa1-T1-D64-ps4"),
    pytest.param(2, 1, 4, 16, 64, 16, 4, id="B2-gqa4-T16-D64-ps16"),
    pytest.param(2, 2, 2, 5, 128, 8, 6, id="B2-gqa2-T5-D128-ps8"),
]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("with_block", [False, True], ids=["ctx", "ctx+block"])
@pytest.mark.parametrize("causal, window", [(False, 0), (True, 0), (True, 5), (False, 7)])
@pytest.mark.parametrize("B, Hkv, G, T, D, page_size, NB", SPLIT_SHAPES)
@pytest.mark.parametrize("dtype, atol, rtol", [DTYPES[0], DTYPES[1]])
def test_block_attention_split_context(dtype, atol, rtol, B, Hkv, G, T, D, page_size, NB, causal, window,
                                       with_block, num_splits):
    """Flash decoding: the context split over programs plus a combine kernel equals the reference (and no split).

    NaN fills every pool slot no query may see, so a split that reads a masked slot, or a combine that reads a
    split that saw nothing, shows up."""
    gen = torch.Generator().manual_seed(B * 100 + T * 10 + NB)
    inputs = _attention_inputs(B, Hkv, G, T, D, page_size, NB, with_block, dtype, gen)
    args = dict(causal=causal, window=window, scale=D**-0.5)
    S = NB * page_size
    visible = ops.block_attention_mask(inputs["ctx_lens"], inputs["q_positions"], S, 0, causal, window).any(1)
    pos = torch.arange(S)
    slots = inputs["block_table"][:, pos // page_size] * page_size + pos % page_size
    keep = torch.zeros(inputs["k_pool"].shape[0], dtype=torch.bool)
    keep[slots[visible]] = True
    for name in ("k_pool", "v_pool"):
        inputs[name] = inputs[name].masked_fill(~keep[:, None, None], float("nan"))
    expected = _attention_reference(inputs, dtype, **args)
    p = block_attention_mod.plan(B, Hkv * G, Hkv, T, D, dtype, S, with_block, num_splits=num_splits)
    assert (p.num_splits > 1) == (num_splits > 1), p
    out = block_attention_mod._launch(**_on(inputs, DEVICE), **args, num_splits=num_splits)
    assert torch.isfinite(out).all()
    _assert_close(out, expected, atol, rtol)


def test_block_attention_plan_splits_long_contexts_of_few_programs():
    plan = block_attention_mod.plan
    few = plan(1, 8, 2, 16, 128, torch.bfloat16, 4096)  # 1 * 2 * 2 programs, 4096 positions
    assert few.reference is None and few.num_splits > 1 and few.num_splits * few.split_span >= 4096
    assert (few.num_splits - 1) * few.split_span < 4096 and few.split_span % few.block_n == 0
    assert plan(64, 32, 8, 16, 128, torch.bfloat16, 4096).num_splits == 1  # 64 * 8 * 4 programs: enough
    assert plan(1, 8, 2, 16, 128, torch.bfloat16, 256).num_splits == 1  # a short context
    assert plan(1, 8, 2, 16, 128, torch.float16, 4096).num_warps == 8
    assert plan(1, 8, 2, 1, 64, torch.float16, 4096).num_warps == 4
    assert "split" in few.describe() and "BLOCK_M=16" in few.describe()


@pytest.mark.parametrize("dtype, D, why", [
    (torch.float64, 64, "fp64"), (torch.float16, 320, "head dim 320"), (torch.float32, 256, "exact fp32"),
])
def test_block_attention_unsupported_configs_run_the_reference(dtype, D, why):
    """fp64, head dims above 256 (shared memory) and fp32 at D=256 (spills) run the exact reference."""
    p = block_attention_mod.plan(2, 2, 1, 3, D, dtype, 8)
    assert p.reference and why in p.reference and p.describe().startswith("reference")
    gen = torch.Generator().manual_seed(2)
    inputs = _attention_inputs(2, 1, 2, 3, D, 4, 2, True, dtype, gen)
    args = dict(causal=True, window=0, scale=D**-0.5)
    expected = _attention_reference(inputs, dtype, **args)
    out = block_attention(**_on(inputs, DEVICE), **args)
    assert out.dtype == dtype
    torch.testing.assert_close(out.cpu(), expected, atol=0, rtol=0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_m=24), "block_m=24"), (dict(block_m=8), "block_m=8"), (dict(block_n=256), "block_n=256"),
    (dict(block_n=32.0), "block_n=32.0"), (dict(num_splits=0), "num_splits=0"),
    (dict(block_m=128, block_n=128), "too large"),
])
def test_block_attention_rejects_bad_tile_overrides(kwargs, match):
    gen = torch.Generator().manual_seed(1)
    inputs = _attention_inputs(2, 1, 2, 3, 256, 4, 2, True, torch.float16, gen)
    with pytest.raises(ValueError, match=match):
        block_attention_mod._launch(**inputs, causal=True, window=0, scale=0.1, **kwargs)
