"""What a wrapper leaves on the user's target (hooks, on every path), its KV pools' sizes, and generate's input checks."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.cache_utils import Cache

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper
from dflash_compile.paged.hf_cache import PagedTargetLayer
from tiny_models import VOCAB, tiny_target

PROMPT = [5, 17, 42, 8]


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


def _draft(target, **kw):
    return DFlashDraftModel.from_target(target, num_layers=2, block_size=4, target_layer_ids=[1, 3], seed=0, **kw)


def _hooks(model) -> int:
    return sum(len(m._forward_hooks) for m in model.modules())


def _greedy(target, prompt, n):
    return target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n)[0, len(prompt):].tolist()


# ---------------------------------------------------------------------------------------------- hooks and lifetime
def test_close_and_with_remove_the_hooks(target):
    before = _hooks(target)
    draft = _draft(target)
    specs = [DFlashSpecWrapper(target, draft, max_seq_len=64) for _ in range(3)]
    assert _hooks(target) > before
    for s in specs:
        s.close()
        s.close()  # idempotent
    assert _hooks(target) == before
    with pytest.raises(RuntimeError, match="closed"):
        specs[0].generate([PROMPT], max_new_tokens=2)
    with DFlashSpecWrapper(target, draft, max_seq_len=64) as s:
        assert s.generate([PROMPT], max_new_tokens=3)[0, len(PROMPT):].tolist() == _greedy(target, PROMPT, 3)
        assert _hooks(target) > before
    assert _hooks(target) == before


def test_no_hidden_states_kept_after_generate(target):
    with DFlashSpecWrapper(target, _draft(target), max_seq_len=64) as s:
        s.generate([PROMPT], max_new_tokens=5)
        assert not s.aux._store
        target.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=3)  # a plain target call
        assert not s.aux._store  # records only for the wrapper's own forwards


class _Boom(RuntimeError):
    pass


def test_a_target_that_raises_in_the_paged_check_leaves_no_recording_hooks(target):
    """The target raises inside the wrapper's first forward (the paged-forward check): the hidden-state hooks are off
    again, so the user's own forwards record nothing; closing removes them."""
    before = _hooks(target)
    spec = DFlashSpecWrapper(target, _draft(target), max_seq_len=64)
    layer = target.model.layers[2]
    own = layer.forward

    def boom(*args, **kwargs):  # fails over the wrapper's paged cache only (transformers' own cache still works)
        if any(isinstance(v, Cache) and isinstance(v.layers[0], PagedTargetLayer) for v in kwargs.values()):
            raise _Boom("the target fails")
        return own(*args, **kwargs)

    layer.forward = boom
    try:
        with pytest.raises(ValueError, match="the target fails over the paged cache") as info:
            spec.generate([PROMPT], max_new_tokens=3)
        assert isinstance(info.value.__cause__, _Boom)
    finally:
        del layer.forward
    assert not spec.aux.enabled
    target(torch.tensor([PROMPT]))  # the user's own forward
    assert not spec.aux._store
    spec.close()
    assert _hooks(target) == before


def test_a_refused_wrapper_leaves_no_hooks(target, monkeypatch):
    before = _hooks(target)
    with pytest.raises(ValueError, match="max_seq_len"):
        DFlashSpecWrapper(target, _draft(target), max_seq_len=1)
    assert _hooks(target) == before

    def refuse(*args, **kwargs):  # any room refusing after the hooks are on
        raise _Boom("refused")

    monkeypatch.setattr("dflash_compile.runtime.wrapper.CacheManager", refuse)
    with pytest.raises(_Boom):
        DFlashSpecWrapper(target, _draft(target), max_seq_len=64)
    assert _hooks(target) == before


# ---------------------------------------------------------------------------------------------- KV pools
def test_pools_are_sized_from_the_requests(target):
    spec = DFlashSpecWrapper(target, _draft(target), max_batch_size=64, max_seq_len=512, page_size=8)
    out = spec.generate([PROMPT], max_new_tokens=8)
    assert out[0, len(PROMPT):].tolist() == _greedy(target, PROMPT, 8)
    assert spec.kv_cache_bytes() < 2**20 and spec.pools.cache.num_blocks <= 4  # 4 + 8 + 4 tokens, not 64 x 512

    prompts = [PROMPT * k for k in range(1, 7)]  # 6 requests, 3 at a time: the pools grow for them, once
    spec = DFlashSpecWrapper(target, _draft(target), max_batch_size=3, max_seq_len=512, page_size=8)
    out = spec.generate(prompts, max_new_tokens=20, pad_token_id=0, return_dict_in_generate=True)
    width = out.prompt_width
    assert [out.sequences[i, width:].tolist() for i in range(6)] == [_greedy(target, p, 20) for p in prompts]
    assert spec.pools.cache.num_blocks <= 2 * 3 * -(-(24 + 20 + 4) // 8)


def test_huge_max_batch_size_with_one_prompt(target):
    spec = DFlashSpecWrapper(target, _draft(target), max_batch_size=100_000, max_cache_bytes=10**8)
    assert spec.generate([PROMPT], max_new_tokens=4)[0, len(PROMPT):].tolist() == _greedy(target, PROMPT, 4)


def test_pools_over_the_allowed_memory_are_refused_naming_the_bytes(target):
    spec = DFlashSpecWrapper(target, _draft(target), max_batch_size=4, max_seq_len=64, page_size=8,
                             max_cache_bytes=10_000)
    with pytest.raises(ValueError, match=r"need \d+ bytes .*max_cache_bytes=10000"):
        spec.generate([PROMPT], max_new_tokens=8)
    assert spec.pools.cache is None


# ---------------------------------------------------------------------------------------------- generate inputs
@pytest.fixture(scope="module")
def spec(target):
    return DFlashSpecWrapper(target, _draft(target), max_batch_size=4, max_seq_len=96)


@pytest.mark.parametrize("ids", [
    torch.tensor([PROMPT], dtype=torch.float32), torch.tensor([PROMPT], dtype=torch.float64),
    torch.tensor([[True, False, True]]), torch.tensor([PROMPT]) + 0j, [[5.0, 17.0, 42.0]], [[5, 17.5]],
    [[True, 3]], [5.0, 17.0],
], ids=["f32", "f64", "bool", "complex", "float_list", "mixed_list", "bool_list", "flat_float_list"])
def test_input_ids_must_be_integers(spec, monkeypatch, ids):
    def no_work(*a, **k):
        raise AssertionError("model work started before validation")

    monkeypatch.setattr(spec.dflash_step, "prefill", no_work)
    with pytest.raises(TypeError, match="input_ids must hold integer token ids"):
        spec.generate(ids, max_new_tokens=4)


def _tokenizer():
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


class _CountingTokenizer:
    """Records the most token ids any one ``decode`` call was given."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def __len__(self):
        return len(self.tok)

    def decode(self, ids, **kw):
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(ids, **kw)


def test_stop_strings_decode_a_bounded_tail(target, spec):
    tok = _CountingTokenizer(_tokenizer())
    out = spec.generate([PROMPT], max_new_tokens=60, stop_strings=["never there"], tokenizer=tok,
                        return_dict_in_generate=True)
    assert out.num_new_tokens == [60] and out.finish_reasons == ["length"]
    assert tok.longest <= 2 * len("never there"), tok.longest  # not the whole generation (60 tokens)

    # A stop string that starts and ends inside tokens and spans three of them still stops at the right token.
    free = _greedy(target, PROMPT, 30)
    plain = _tokenizer()
    piece = plain.decode(free[20:23])
    stop = piece[1:-1]
    first = next(k for k in range(1, 31) if stop in plain.decode(free[:k]))
    out = spec.generate([PROMPT], max_new_tokens=30, stop_strings=[stop], tokenizer=tok, return_dict_in_generate=True)
    assert out.finish_reasons == ["stop"] and out.sequences[0, len(PROMPT):].tolist() == free[:first]
