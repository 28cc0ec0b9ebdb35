"""The Triton ``paged_kv_write`` and ``fused_kv_proj`` kernels against the eager references of ``lowerings/ops.py``."""

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
