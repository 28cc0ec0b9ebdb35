import os

import pytest
import torch

from dflash_compile.paged.layout import AttentionLayout, StateLayout
from dflash_compile.paged.pools import PagedKVCache
from dflash_compile.primitives.slots import TRASH_SLOT, ZERO_SLOT, _paged_slots, read_slots, write_slots

KV = AttentionLayout((2, 8), (2, 8), torch.float32)


def _cache(**kw):
    args = dict(max_batch_size=2, max_seq_len=10, page_size=4, target_layout=[KV] * 3, draft_shape=(2, 2, 8),
                dtype=torch.float32, device="cpu")
    return PagedKVCache(**{**args, **kw})


def test_paged_slots_formula():
    table = torch.tensor([[5, 2, 7], [0, 1, 3]])
    pos = torch.tensor([[0, 3, 4, 9], [1, 5, 8, 11]])
    expected = torch.tensor([[20, 23, 8, 29], [1, 5, 12, 15]])
    assert torch.equal(_paged_slots(table, pos, 4), expected)


def test_write_and_read_slots_mask():
    table = torch.tensor([[5, 2, -1]])
    w = write_slots(table, torch.tensor([[3, 4, 11]]), torch.tensor([[True, False, True]]), 4)
    assert w.tolist() == [[23, TRASH_SLOT, _paged_slots(table, torch.tensor([[11]]), 4).item()]]
    r, key_pos = read_slots(table, torch.tensor([6]), 4)
    assert key_pos.tolist() == list(range(12))
    assert r.tolist() == [[20, 21, 22, 23, 8, 9] + [ZERO_SLOT] * 6]


def test_pool_layout_and_extra_slots():
    c = _cache()
    assert c.blocks_per_seq == 3 and c.num_blocks == 6
    assert [p.shape for p in c.target_pools] == [(2, 6 * 4 + 2, 2, 8)] * 3  # one tensor per target layer
    assert c.draft_pool.shape == (2, 2, 26, 2, 8)
    assert not c.has_states and c.state_slot(3) == 0


def test_pools_follow_each_layers_layout():
    mla = AttentionLayout((1, 16), (1, 8), torch.float32)  # K and V of different widths: a pool each
    gdn = StateLayout((("conv0", (64, 4), torch.float32), ("recurrent0", (4, 8, 8), torch.float32)), "mixer")
    both = StateLayout((("conv0", (32, 4), torch.float32),), "mixer", attention=mla)  # states and K/V in one layer
    c = _cache(target_layout=[KV, mla, gdn, both, None], max_batch_size=3)  # None: a layer that caches nothing
    kv, (k, v), states, hybrid, nothing = c.target_pools
    assert kv.shape == (2, 3 * 3 * 4 + 2, 2, 8)
    assert (k.shape, v.shape) == ((38, 1, 16), (38, 1, 8))
    assert {n: t.shape for n, t in states.items()} == {"conv0": (5, 64, 4), "recurrent0": (5, 4, 8, 8)}  # 3 + 2
    assert hybrid["conv0"].shape == (5, 32, 4) and [p.shape for p in hybrid["attention"]] == [(38, 1, 16), (38, 1, 8)]
    assert nothing is None
    assert c.has_states
    assert [c.state_slot(r) for r in (10, 11, 10)] == [0, 1, 0]  # one slot per request, stable
    c.free(10)
    assert c.state_slot(12) == 0  # reused
    c.state_slot(13)
    with pytest.raises(RuntimeError, match="out of slots"):
        c.state_slot(14)
    hybrid["attention"][0][5] = 7.0
    c.grow(c.num_blocks + 2)  # a layer's K/V pool grows inside its state pools too; state pools keep their slots
    kv, (k, v), states, hybrid, nothing = c.target_pools
    assert k.shape[0] == v.shape[0] == kv.shape[1] == hybrid["attention"][0].shape[0] == 38 + 2 * 4
    assert bool((hybrid["attention"][0][5] == 7.0).all()) and hybrid["conv0"].shape == (5, 32, 4) and nothing is None


def test_allocate_grow_free():
    c = _cache()
    c.ensure(7, 5)
    assert c.blocks(7) == [0, 1]
    c.ensure(7, 5)
    assert c.blocks(7) == [0, 1]
    c.ensure(9, 100)  # capped at max_seq_len = 10 -> 3 blocks
    assert c.blocks(9) == [2, 3, 4]
    assert c.block_table([9, None, 7]).tolist() == [[2, 3, 4], [-1, -1, -1], [0, 1, -1]]
    c.free(7)
    c.ensure(11, 8)
    assert sorted(c.blocks(11)) == [0, 1]
    assert set(c.slots_of(11).tolist()) == set(range(8))


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident set size from /proc")
def test_large_cpu_pools_take_memory_only_where_written():
    from dflash_compile.paged.pools import MAPPED_BYTES, zeroed

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = resident()
    pool = zeroed((2, 1 << 16, 4, 256), torch.float32, "cpu")  # 512 MB
    assert pool.shape == (2, 1 << 16, 4, 256) and pool.dtype == torch.float32 and pool.is_contiguous()
    assert resident() - before < 64 << 20  # torch.zeros would have written all 512 MB
    pool[1, 12345] = 3.0
    assert pool.sum().item() == 3.0 * 4 * 256 and pool[0].abs().max().item() == 0.0  # zeros but what was written
    small = zeroed((4, 8), torch.bfloat16, "cpu")
    assert small.numel() * 2 < MAPPED_BYTES and torch.equal(small, torch.zeros(4, 8, dtype=torch.bfloat16))
