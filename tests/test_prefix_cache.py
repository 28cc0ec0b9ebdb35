"""Prefix caching (``DFlashSpecWrapper(..., prefix_caching=True)``, ``kv_cache.PagedKVCache.match/register``): full
prompt pages hashed as a chain, shared by the requests whose prompts start with them, kept after they finish and
evicted least-recently-used; greedy output identical with and without."""

import logging

import pytest
import torch

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper
from dflash_compile.paged.pools import PagedKVCache
from tiny_models import VOCAB, tiny_target

PAGE = 8
NEW = 10
PAD = VOCAB - 2


def _cache(num_blocks=6):
    return PagedKVCache(max_batch_size=2, max_seq_len=64, page_size=PAGE, target_layout=[], draft_shape=(1, 1, 4),
                        dtype=torch.float32, device="cpu", num_blocks=num_blocks, prefix_caching=True)


def test_pages_are_matched_as_a_chain_shared_and_evicted_lru():
    c = _cache()
    a = list(range(20))  # pages [0..7], [8..15], then 4 tokens
    assert c.match(a) == []
    c.ensure(1, len(a))
    c.register(1, a)
    assert c.num_cached_blocks == 2  # full pages only
    assert c.match(a) == c.blocks(1)[:2]
    assert c.match(a[:16]) == c.blocks(1)[:1]  # one token is always left to prefill
    assert c.match([99] + a[1:]) == []  # a chain: a different first page matches nothing after it
    c.ensure(2, 20, prefix=c.match(a))  # shared while both hold them
    assert c.blocks(2)[:2] == c.blocks(1)[:2] and c.blocks(2)[2] != c.blocks(1)[2]
    c.free(1)
    assert c.num_free_blocks == 6 - 3  # request 2 still holds the two shared pages and its own third
    c.free(2)
    assert c.num_free_blocks == 6 and c.num_cached_blocks == 2  # free to take, still cached
    head = c.match(a)[0]
    c.ensure(3, 40)  # five blocks: the four uncached free ones, then the least recently used cached page
    assert c.prefix_stats["evicted_blocks"] == 1 and c.num_cached_blocks == 1
    assert c.match(a) == [head]  # a chain's tail goes first: its head still serves
    c.free(3)
    assert c.num_free_blocks == 6


def _pair(target, **kw):
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4, seed=0)
    return DFlashSpecWrapper(target, draft, speculation="fixed", **{**dict(max_batch_size=2, max_seq_len=96,
                                                                           page_size=PAGE), **kw})


def _prompts(shared=37, tails=(3, 9, 1, 14), seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(0, VOCAB - 2, (shared,), generator=g).tolist()
    return [head + torch.randint(0, VOCAB - 2, (n,), generator=g).tolist() for n in tails]


def _reference(target, p):
    return target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW)[0, len(p):].tolist()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_shared_prefixes_are_reused_and_lossless(compiled):
    target = tiny_target("qwen3")
    prompts = _prompts()
    refs = [_reference(target, p) for p in prompts]
    spec = _pair(target, prefix_caching=True)
    if compiled:
        spec.compile(backend="dflash")
    first = spec.generate([prompts[0]], max_new_tokens=NEW)[0, len(prompts[0]):].tolist()
    assert first == refs[0] and spec.prefix_cache_stats()["hit_tokens"] == 0
    handle = spec.submit(prompts[1], max_new_tokens=NEW)
    assert handle.result().tokens == refs[1] and handle.cached_tokens == 32
    assert spec.prefix_cache_stats()["hit_tokens"] == 32  # the shared 37 tokens' four full pages
    out = spec.generate(prompts, max_new_tokens=NEW, pad_token_id=PAD)  # four prompts over two rows
    assert [out[i, -NEW:].tolist() for i in range(4)] == refs
    stats = spec.prefix_cache_stats()
    assert stats["queries"] == 6 and stats["hit_tokens"] > 32 + 4 * 32 - 1
    cache = spec.kv_cache()
    assert cache.num_free_blocks == cache.num_blocks  # every block free (cached pages included) at the end


def test_eviction_under_a_small_pool_stays_lossless():
    target = tiny_target("qwen3")
    spec = _pair(target, max_batch_size=1, max_seq_len=64, prefix_caching=True)  # 8 blocks in all
    groups = [_prompts(shared=33, tails=(2, 5), seed=s) for s in range(4)]  # four unrelated shared prefixes
    for group in groups:
        for p in group:
            assert spec.generate([p], max_new_tokens=NEW)[0, len(p):].tolist() == _reference(target, p)
    stats = spec.prefix_cache_stats()
    assert stats["evicted_blocks"] > 0 and stats["hit_tokens"] == 4 * 32  # each group's second prompt hit
    assert spec.kv_cache().num_cached_blocks <= spec.kv_cache().num_blocks
    p = groups[0][0]  # its pages were evicted by the later groups: prefilled again, same tokens
    before = spec.prefix_cache_stats()["hit_tokens"]
    assert spec.generate([p], max_new_tokens=NEW)[0, len(p):].tolist() == _reference(target, p)
    assert spec.prefix_cache_stats()["hit_tokens"] == before


def test_off_for_recurrent_state_targets(caplog):
    target = tiny_target("qwen3_5")
    spec = _pair(target, prefix_caching=True)
    prompts = _prompts()[:2]
    with caplog.at_level(logging.WARNING, logger="dflash_compile.runtime.cache_manager"):
        outs = [spec.generate([p], max_new_tokens=NEW)[0, len(p):].tolist() for p in prompts]
    assert outs == [_reference(target, p) for p in prompts]
    assert "prefix caching is off" in caplog.text and "recurrent states" in caplog.text
    assert spec.prefix_cache_stats()["queries"] == 0


def test_pages_matched_in_an_admission_are_held_before_others_take_blocks():
    # Two requests join together: one new and long, one sharing a cached prefix. The long one is prefilled first and
    # needs more blocks than are free, so pages are evicted; the other's matched pages must not be among them.
    target = tiny_target("qwen3")
    spec = _pair(target, max_seq_len=64, prefix_caching=True)
    old, other, long = _prompts(shared=40, tails=(0, 0, 0), seed=1)
    old, other, long = old, [t + 1 for t in other], [(t + 2) % (VOCAB - 2) for t in long] + [3] * 10
    for p in (old, other):  # both cached, ``old`` least recently used
        assert spec.generate([p], max_new_tokens=NEW)[0, len(p):].tolist() == _reference(target, p)
    again = old + [5, 6, 7]
    before = spec.prefix_cache_stats()
    out = spec.generate([long, again], max_new_tokens=NEW, pad_token_id=PAD)  # one admission
    assert [out[i, -NEW:].tolist() for i in range(2)] == [_reference(target, long), _reference(target, again)]
    stats = spec.prefix_cache_stats()
    assert stats["hit_tokens"] - before["hit_tokens"] == 40  # ``again`` reused all of ``old``'s pages
    assert stats["evicted_blocks"] > before["evicted_blocks"], (before, stats, spec.kv_cache().num_blocks)
