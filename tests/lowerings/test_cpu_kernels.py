"""The CPU kernels against the oracles in ``lowerings/ops.py``."""

import itertools

import pytest
import torch

from dflash_compile.lowerings.cpu.block_attention import block_attention
from dflash_compile.lowerings.ops import _block_attention_reference

CASES = list(itertools.product([1, 5], [4, 16], [1, 2, 4], [False, True], [(0, 0), (3, 0), (0, 8), (3, 8)],
                               [False, True]))


@pytest.mark.parametrize("T,page,gqa,causal,window_chunk,with_block", CASES)
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_block_attention_matches_reference(T, page, gqa, causal, window_chunk, with_block, dtype, atol):
    window, chunk = window_chunk
    g = torch.Generator().manual_seed(T * 100 + page + gqa)
    B, Hkv, D, NB = 3, 2, 16, 4
    slots = NB * B * page + 2
    k_pool = torch.randn(slots, Hkv, D, generator=g, dtype=dtype)
    v_pool = torch.randn(slots, Hkv, D, generator=g, dtype=dtype)
    table = torch.randperm(NB * B, generator=g)[: B * NB].view(B, NB)
    ctx_lens = torch.tensor([0, 2 * page + 1, NB * page - 1])
    table[1, 3] = -1  # unallocated beyond row 1's length
    q_pos = ctx_lens[:, None] + torch.arange(T)
    q = torch.randn(B, Hkv * gqa, T, D, generator=g, dtype=dtype)
    kb = torch.randn(B, Hkv, T, D, generator=g, dtype=dtype) if with_block else None
    vb = torch.randn(B, Hkv, T, D, generator=g, dtype=dtype) if with_block else None
    args = (q, k_pool, v_pool, table, ctx_lens, q_pos, kb, vb, page, causal, window, D**-0.5, chunk)
    torch.testing.assert_close(block_attention(*args), _block_attention_reference(*args), atol=atol, rtol=atol)


def test_nan_in_invisible_slots_does_not_leak():
    B, H, D, page = 2, 2, 8, 4
    k_pool, v_pool = torch.randn(4 * page * B + 2, H, D), torch.randn(4 * page * B + 2, H, D)
    table = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    ctx_lens = torch.tensor([3, 9])
    k_pool[3:16], v_pool[3:16] = float("nan"), float("nan")  # row 0's blocks past its length
    q = torch.randn(B, H, 2, D)
    args = (q, k_pool, v_pool, table, ctx_lens, ctx_lens[:, None] + torch.arange(2), None, None, page, True, 0, 0.3)
    out = block_attention(*args)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, _block_attention_reference(*args))
