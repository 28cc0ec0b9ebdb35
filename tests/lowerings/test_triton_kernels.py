"""The Triton kernels of ``lowerings/triton`` against the eager references of ``lowerings/ops.py``.

Without a CUDA device the kernels run in the Triton interpreter on CPU tensors; with one they are compiled.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first ``import triton``
triton = pytest.importorskip("triton", reason="triton is not installed")

if not torch.cuda.is_available():
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(triton.language.zeros, InterpretedFunction):  # triton's own @jit helpers were compiled
        pytest.skip(
            "triton was imported (e.g. by torch._dynamo) before TRITON_INTERPRET=1 was set; run this file first, "
            "on its own, or with TRITON_INTERPRET=1 in the environment",
            allow_module_level=True,
        )

from dflash_compile.lowerings import ops  # noqa: E402
from dflash_compile.lowerings.triton import block_attention as block_attention_mod  # noqa: E402
from dflash_compile.lowerings.triton import cuda_lowerings, register_cuda_kernels  # noqa: E402
from dflash_compile.lowerings.triton.block_attention import block_attention  # noqa: E402
from dflash_compile.lowerings.triton.fused_kv_proj import fused_kv_proj  # noqa: E402
from dflash_compile.lowerings.triton.paged_kv_write import paged_kv_write  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# bf16 is checked against the fp32 reference of the same (upcast) inputs; the interpreter also truncates
# fp32 -> bf16 instead of rounding, which the bf16 tolerance covers.
DTYPES = [
    pytest.param(torch.float32, 2e-5, 2e-5, id="fp32"),
    pytest.param(torch.float16, 5e-3, 5e-3, id="fp16"),
    pytest.param(torch.bfloat16, 3e-2, 3e-2, id="bf16"),
]


def _ref_dtype(dtype):
    return torch.float32 if dtype == torch.bfloat16 else dtype


def _to_ref(x, dtype):
    floating = isinstance(x, torch.Tensor) and x.is_floating_point()
    return x.to(_ref_dtype(dtype)) if floating else x


def _assert_close(actual, expected, atol, rtol):
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)


# --------------------------------------------------------------------------------------------- block_attention
def _attention_inputs(B, Hkv, G, T, D, page_size, NB, with_block, dtype, gen):
    num_pages = B * NB + 3  # spare pages nobody owns
    num_slots = num_pages * page_size
    k_pool = torch.randn(num_slots, Hkv, D, generator=gen).to(dtype)
    v_pool = torch.randn(num_slots, Hkv, D, generator=gen).to(dtype)
    block_table = torch.randperm(num_pages, generator=gen)[: B * NB].view(B, NB)
    ctx_lens = torch.randint(0, NB * page_size + 1, (B,), generator=gen)
    ctx_lens[0] = 0  # a row without context
    if B > 2:
        ctx_lens[-1] = NB * page_size  # a full row
    base = (ctx_lens - torch.randint(0, 7, (B,), generator=gen)).clamp(min=0)  # queries may overlap the context
    q_positions = base[:, None] + torch.arange(T)
    q = torch.randn(B, Hkv * G, T, D, generator=gen).to(dtype)
    k_block = torch.randn(B, Hkv, T, D, generator=gen).to(dtype) if with_block else None
    v_block = torch.randn(B, Hkv, T, D, generator=gen).to(dtype) if with_block else None
    return dict(
        q=q, k_pool=k_pool, v_pool=v_pool, block_table=block_table, ctx_lens=ctx_lens, q_positions=q_positions,
        k_block=k_block, v_block=v_block, page_size=page_size,
    )


def _attention_reference(inputs, dtype, causal, window, scale, chunk=0):
    ref_inputs = {k: _to_ref(v, dtype) for k, v in inputs.items()}
    return ops._block_attention_reference(**ref_inputs, causal=causal, window=window, scale=scale, chunk=chunk)


def _on(inputs, device):
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


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


# ---------------------------------------------------------------------------------------------- paged_kv_write
@pytest.mark.parametrize("lead", [(), (2,), (2, 3)], ids=["lead0", "lead1", "lead2"])
@pytest.mark.parametrize("Hkv, D", [(2, 64), (1, 128), (3, 5)])
@pytest.mark.parametrize("value_dtype", [None, torch.float32], ids=["same", "from-fp32"])
@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
def test_paged_kv_write(dtype, atol, rtol, value_dtype, Hkv, D, lead):
    gen = torch.Generator().manual_seed(11)
    num_slots = 23
    pool = torch.randn(*lead, num_slots, Hkv, D, generator=gen).to(dtype)
    slots = torch.tensor([5, -1, 0, -10, 12])  # torch indexing: slots 5, 22 (the last), 0, 13, 12
    values = torch.randn(*lead, len(slots), Hkv, D, generator=gen).to(value_dtype or dtype)
    expected = pool.clone()
    ops.paged_kv_write(expected, slots, values)  # on CPU: the reference

    pool_dev = pool.to(DEVICE)
    out = paged_kv_write(pool_dev, slots.to(DEVICE), values.to(DEVICE))
    assert out is None
    # A same-dtype copy is exact; the interpreter truncates fp32 -> bf16 instead of rounding.
    exact = value_dtype is None or dtype != torch.bfloat16
    _assert_close(pool_dev, expected, 0 if exact else atol, 0 if exact else rtol)


@pytest.mark.parametrize("slots", [[-1], [-9, -1, 3, -4], [8, -9, -5]], ids=["last", "mixed", "both-ends"])
def test_paged_kv_write_negative_slots_count_from_the_end(slots):
    """A slot in [-num_slots, 0) is slot + num_slots, as in torch indexing (the step's trash slot is -1)."""
    gen = torch.Generator().manual_seed(4)
    pool = torch.randn(2, 9, 2, 64, generator=gen)
    slots = torch.tensor(slots)
    values = torch.randn(2, len(slots), 2, 64, generator=gen)
    expected = pool.clone()
    ops.paged_kv_write(expected, slots, values)
    assert torch.equal(expected[:, slots[0]], values[:, 0])  # the reference itself wraps
    pool_dev = pool.to(DEVICE)
    paged_kv_write(pool_dev, slots.to(DEVICE), values.to(DEVICE))
    _assert_close(pool_dev, expected, 0, 0)


def test_paged_kv_write_empty_and_broadcast_values():
    gen = torch.Generator().manual_seed(6)
    before = torch.randn(2, 9, 2, 64, generator=gen)
    pool = before.to(DEVICE, copy=True)
    paged_kv_write(pool, torch.empty(0, dtype=torch.long, device=DEVICE), torch.ones(2, 0, 2, 64, device=DEVICE))
    assert torch.equal(pool.cpu(), before)
    values = torch.randn(2, 2, 64, generator=gen)  # no leading dim: the same rows for every lead
    slots = torch.tensor([3, -1])
    expected = before.clone()
    ops.paged_kv_write(expected, slots, values)
    paged_kv_write(pool, slots.to(DEVICE), values.to(DEVICE))
    _assert_close(pool, expected, 0, 0)


def test_paged_kv_write_strided_pool():
    """Leading dims that flatten by strides, not by layout (a [layers, slots, ...] view of a slot-major buffer)."""
    gen = torch.Generator().manual_seed(8)
    storage = torch.randn(20, 2, 2, 8, generator=gen)
    pool = storage.to(DEVICE).transpose(0, 1)  # [2, 20, 2, 8], not contiguous
    slots = torch.tensor([4, -1, -20])
    values = torch.randn(2, 3, 2, 8, generator=gen)
    expected = storage.transpose(0, 1).clone()
    ops.paged_kv_write(expected, slots, values)
    paged_kv_write(pool, slots.to(DEVICE), values.to(DEVICE))
    _assert_close(pool, expected, 0, 0)


def test_paged_kv_write_pool_whose_leading_dims_do_not_flatten():
    pool = torch.zeros(3, 2, 5, 1, 4, device=DEVICE).transpose(0, 1)  # [2, 3, 5, 1, 4]: lead (2, 3) interleaved
    with pytest.raises(ValueError, match="do not flatten"):
        paged_kv_write(pool, torch.tensor([0], device=DEVICE), torch.ones(2, 3, 1, 1, 4, device=DEVICE))


# ----------------------------------------------------------------------------------------------- fused_kv_proj
def _rope(N, D, gen):
    angles = torch.rand(N, D // 2, generator=gen) * 10
    return torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)


@pytest.mark.parametrize("L, N, Hkv, D", [(1, 1, 2, 64), (3, 5, 1, 128), (2, 3, 4, 64)])
@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
def test_fused_kv_proj(dtype, atol, rtol, L, N, Hkv, D):
    gen = torch.Generator().manual_seed(L * 100 + N * 10 + Hkv)
    H = 48
    ctx = torch.randn(N, H, generator=gen).to(dtype)
    weight = (torch.randn(2 * L * Hkv * D, H, generator=gen) / H**0.5).to(dtype)
    k_norm_weight = (torch.rand(L, D, generator=gen) + 0.5).to(dtype)
    cos, sin = (t.to(dtype) for t in _rope(N, D, gen))
    inputs = (ctx, weight, k_norm_weight, cos, sin)
    k_ref, v_ref = ops._fused_kv_proj_reference(*(_to_ref(t, dtype) for t in inputs), 1e-6)
    k, v = fused_kv_proj(*(t.to(DEVICE) for t in inputs), 1e-6)
    assert k.shape == v.shape == (L, N, Hkv, D) and k.dtype == v.dtype == dtype
    assert k.is_contiguous() and v.is_contiguous()
    _assert_close(k, k_ref, atol, rtol)
    _assert_close(v, v_ref, atol, rtol)


def test_fused_kv_proj_fp64_is_exact():
    """The epilogue computes in fp32: fp64 runs the reference instead of being silently rounded."""
    gen = torch.Generator().manual_seed(12)
    L, N, Hkv, D, H = 2, 3, 2, 64, 48
    inputs = (
        torch.randn(N, H, generator=gen, dtype=torch.float64),
        torch.randn(2 * L * Hkv * D, H, generator=gen, dtype=torch.float64) / H**0.5,
        torch.rand(L, D, generator=gen, dtype=torch.float64) + 0.5,
        *(t.double() for t in _rope(N, D, gen)),
    )
    k_ref, v_ref = ops._fused_kv_proj_reference(*inputs, 1e-6)
    k, v = fused_kv_proj(*(t.to(DEVICE) for t in inputs), 1e-6)
    assert k.dtype == torch.float64
    torch.testing.assert_close(k.cpu(), k_ref, atol=0, rtol=0)
    torch.testing.assert_close(v.cpu(), v_ref, atol=0, rtol=0)


def test_fused_kv_proj_strided_rope_tables():
    gen = torch.Generator().manual_seed(1)
    L, N, Hkv, D, H = 2, 3, 2, 64, 32
    ctx = torch.randn(N, H, generator=gen)
    weight = torch.randn(2 * L * Hkv * D, H, generator=gen) / H**0.5
    k_norm_weight = torch.rand(L, D, generator=gen) + 0.5
    cos, sin = _rope(1, D, gen)
    cos, sin = cos.expand(N, D), sin.expand(N, D)  # stride 0 over rows
    k_ref, v_ref = ops._fused_kv_proj_reference(ctx, weight, k_norm_weight, cos, sin, 1e-5)
    k, v = fused_kv_proj(*(t.to(DEVICE) for t in (ctx, weight, k_norm_weight, cos, sin)), 1e-5)
    _assert_close(k, k_ref, 2e-5, 2e-5)
    _assert_close(v, v_ref, 0, 0)


# ------------------------------------------------------------------------------------------------ registration
def test_register_cuda_kernels_is_idempotent():
    register_cuda_kernels()
    register_cuda_kernels()
    if DEVICE != "cuda":
        return
    gen = torch.Generator().manual_seed(2)
    inputs = _attention_inputs(2, 2, 2, 3, 64, 4, 3, True, torch.float16, gen)
    args = dict(causal=False, window=0, scale=0.125)
    expected = _attention_reference(inputs, torch.float16, **args)
    _assert_close(ops.block_attention(**_on(inputs, DEVICE), **args), expected, 5e-3, 5e-3)


# ---------------------------------------------------------------------------------------------- lowering table
def test_cuda_lowerings_cover_every_op_with_the_public_functions():
    table = cuda_lowerings()
    assert table == {
        torch.ops.dflash.fused_kv_proj.default: fused_kv_proj,
        torch.ops.dflash.paged_kv_write.default: paged_kv_write,
        torch.ops.dflash.block_attention.default: block_attention,
    }


# Run in a fresh interpreter without TRITON_INTERPRET (this module runs the interpreter): fake CUDA tensors need
# no GPU, and make_fx records the wrap_triton launches. The HOPs' mutation analysis compiles each kernel to TTIR
# for the active driver's target; with no GPU there is no driver, so a stand-in names an sm_90 target (without
# it the analysis gives up and assumes every input is written: correct, but Inductor would clone the pool).
_FAKE_CUDA_PRELUDE = """
import json
import torch
import triton
from triton.backends.compiler import GPUTarget
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from dflash_compile.lowerings import ops  # noqa: F401  (defines the ops)


class _TargetOnlyDriver:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


if not torch.cuda.is_available():
    triton.runtime.driver.set_active(_TargetOnlyDriver())
"""

_FAKE_CUDA_TRACE = _FAKE_CUDA_PRELUDE + """
from dflash_compile.lowerings.triton import cuda_lowerings



# Tensor indexing (``t[0]``) of a fake CUDA tensor needs a CUDA build of torch: select() does not.
def step(ctx, weight, k_norm_weight, cos, sin, k_pool, v_pool, slots, q, block_table, ctx_lens, q_positions):
    k, v = torch.ops.dflash.fused_kv_proj(ctx, weight, k_norm_weight, cos, sin, 1e-6)  # [L, N, Hkv, D]
    torch.ops.dflash.paged_kv_write(k_pool, slots, k)
    torch.ops.dflash.paged_kv_write(v_pool, slots, v)
    k_block, v_block = (x.select(0, 0).transpose(0, 1).unsqueeze(0) for x in (k, v))  # layer 0: [1, Hkv, N, D]
    out = torch.ops.dflash.block_attention(
        q, k_pool.select(0, 0), v_pool.select(0, 0), block_table, ctx_lens, q_positions, k_block, v_block,
        4, True, 0, 0.125,
    )
    return out, k_pool.sum()  # reads the pools after the writes


L, N, Hkv, D, H, G, S = 2, 3, 2, 64, 32, 2, 40
with FakeTensorMode():
    c = lambda *shape, dtype=torch.float16: torch.empty(*shape, device="cuda", dtype=dtype)
    args = (
        c(N, H), c(2 * L * Hkv * D, H), c(L, D), c(N, D), c(N, D), c(L, S, Hkv, D), c(L, S, Hkv, D),
        c(N, dtype=torch.long), c(1, Hkv * G, N, D), c(1, 5, dtype=torch.long), c(1, dtype=torch.long),
        c(1, N, dtype=torch.long),
    )
ops_gm = make_fx(step, pre_dispatch=True, tracing_mode="fake")(*args)
lowered = make_fx(ops_gm, decomposition_table=cuda_lowerings(), pre_dispatch=True, tracing_mode="fake")(*args)
functional = make_fx(torch.func.functionalize(lowered, remove="mutations_and_views"), tracing_mode="fake")(*args)
targets = lambda gm: [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
print(json.dumps(dict(
    ops=targets(ops_gm),
    lowered=targets(lowered),
    clones=[n.kwargs["tensors_to_clone"] for n in functional.graph.nodes if "tensors_to_clone" in n.kwargs],
)))
"""


def test_cuda_lowerings_trace_with_fake_cuda_tensors():
    """make_fx with the table turns every dflash op into Triton HOPs without a GPU; each writes only its outputs."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _FAKE_CUDA_TRACE], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "assuming every input is mutated" not in proc.stderr, proc.stderr[-3000:]
    graphs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sum(t.startswith("dflash.") for t in graphs["ops"]) == 4
    assert not [t for t in graphs["lowered"] if "dflash" in t]
    assert graphs["lowered"].count("triton_kernel_wrapper_mutation") == 4
    # fused_kv_proj writes K and V, paged_kv_write only the pool (twice), block_attention only its output
    assert graphs["clones"] == [["k_ptr", "v_ptr"], ["pool_ptr"], ["pool_ptr"], ["out_ptr"]]


_FAKE_CUDA_SPLIT_TRACE = _FAKE_CUDA_PRELUDE + """
from dflash_compile.lowerings.triton import block_attention as ba
B, Hkv, G, T, D, ps, NB = 1, 2, 2, 16, 128, 16, 256  # 4 programs, 4096 context positions: split
plan = ba.plan(B, Hkv * G, Hkv, T, D, torch.float16, NB * ps)
with FakeTensorMode():
    c = lambda *shape, dtype=torch.float16: torch.empty(*shape, device="cuda", dtype=dtype)
    args = (c(B, Hkv * G, T, D), c(NB * ps, Hkv, D), c(NB * ps, Hkv, D), c(B, NB, dtype=torch.long),
            c(B, dtype=torch.long), c(B, T, dtype=torch.long), c(B, Hkv, T, D), c(B, Hkv, T, D))
f = lambda *a: ba.block_attention(*a, ps, False, 0, D**-0.5)
gm = make_fx(f, pre_dispatch=True, tracing_mode="fake")(*args)
targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
print(json.dumps(dict(splits=plan.num_splits, targets=targets)))
"""


def test_block_attention_split_traces_with_fake_cuda_tensors():
    """The split path (attention kernel + combine kernel, fp32 workspace) traces into two Triton HOPs."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _FAKE_CUDA_SPLIT_TRACE], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["splits"] > 1
    assert report["targets"].count("triton_kernel_wrapper_mutation") == 2, report["targets"]


def _lowering_cases():
    gen = torch.Generator().manual_seed(12)
    dtype = torch.float16
    L, N, Hkv, D, H = 2, 3, 2, 64, 48
    ctx = torch.randn(N, H, generator=gen).to(dtype)
    weight = (torch.randn(2 * L * Hkv * D, H, generator=gen) / H**0.5).to(dtype)
    k_norm_weight = (torch.rand(L, D, generator=gen) + 0.5).to(dtype)
    cos, sin = (t.to(dtype) for t in _rope(N, D, gen))
    attention = _attention_inputs(3, 2, 2, 5, 64, 4, 6, True, dtype, gen)
    pool = torch.randn(2, 23, Hkv, D, generator=gen).to(dtype)
    slots = torch.tensor([5, -1, 0, -10, 12])
    values = torch.randn(2, len(slots), Hkv, D, generator=gen).to(dtype)
    return {
        "fused_kv_proj": (
            lambda *a: torch.ops.dflash.fused_kv_proj(*a, 1e-6), [ctx, weight, k_norm_weight, cos, sin]
        ),
        "paged_kv_write": (_write_then_read, [pool, slots, values]),
        "block_attention": (
            lambda *a: torch.ops.dflash.block_attention(*a, 4, True, 3, 0.125),
            [attention[k] for k in ("q", "k_pool", "v_pool", "block_table", "ctx_lens", "q_positions")]
            + [attention["k_block"], attention["v_block"]],
        ),
    }


def _write_then_read(pool, slots, values):
    torch.ops.dflash.paged_kv_write(pool, slots, values)
    return pool.float().sum(-1)  # [*lead, num_slots, Hkv]: must see the writes


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device: Inductor compiles the traced Triton kernels for it (the fake-CUDA trace test "
    "covers the tracing without one)",
)
@pytest.mark.parametrize("op", ["fused_kv_proj", "paged_kv_write", "block_attention"])
def test_cuda_lowering_compiles_with_inductor(op):
    """dynamo graph -> the table (make_fx) -> Inductor, as the backend does: Triton HOPs, no dflash op, same values."""
    from torch._inductor.compile_fx import compile_fx
    from torch.fx.experimental.proxy_tensor import make_fx

    fn, args = _lowering_cases()[op]
    expected_args = [a.float() if a.is_floating_point() else a.clone() for a in args]  # fp32 reference, on CPU
    expected = fn(*expected_args)
    lowered = []

    def backend(gm, example_inputs):
        with torch._guards.tracing(None):
            gm = make_fx(gm, decomposition_table=cuda_lowerings(), pre_dispatch=True, tracing_mode="fake")(
                *example_inputs
            )
        lowered.append(gm)
        return compile_fx(gm, example_inputs)

    cuda_args = [a.to("cuda") for a in args]
    actual = torch.compile(fn, backend=backend, fullgraph=True)(*cuda_args)
    targets = [str(n.target) for gm in lowered for n in gm.graph.nodes if n.op == "call_function"]
    assert "triton_kernel_wrapper_mutation" in targets
    assert not [t for t in targets if "dflash" in t]
    as_tuple = lambda x: x if isinstance(x, tuple) else (x,)  # noqa: E731
    for a, e in zip(as_tuple(actual), as_tuple(expected), strict=True):
        _assert_close(a, e, 5e-3, 5e-3)
    if op == "paged_kv_write":
        _assert_close(cuda_args[0], expected_args[0], 0, 0)  # the pool itself was written
