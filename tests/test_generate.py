"""Greedy DFlash output must be token-identical to the target's own greedy generate."""

import pytest
import torch

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper
from tiny_models import FAMILIES, VOCAB, tiny_target

MAX_NEW = 24


def _prompt(length, seed):
    return torch.randint(0, VOCAB - 1, (1, length), generator=torch.Generator().manual_seed(seed))


def _pair(family, always_right, block_size=4, speculation=None):
    target = tiny_target(family)
    if always_right:  # every logit ties at 0: target and drafter both pick token 0, every draft is accepted
        with torch.no_grad():
            target.get_output_embeddings().weight.zero_()
    draft = DFlashDraftModel.from_target(target, num_layers=2, block_size=block_size, target_layer_ids=[1, 3], seed=0)
    return target, DFlashSpecWrapper(target, draft, speculation=speculation)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("always_right", [False, True], ids=["random", "always_right"])
@pytest.mark.parametrize("speculation", ["fixed", "auto"])
def test_greedy_matches_target_generate(family, always_right, speculation):
    target, spec = _pair(family, always_right, speculation=speculation)
    for length, seed in [(1, 0), (5, 1), (17, 2)]:
        prompt = _prompt(length, seed)
        ref = target.generate(prompt, do_sample=False, max_new_tokens=MAX_NEW)
        out = spec.generate(prompt, max_new_tokens=MAX_NEW, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref), (family, length)
        assert out.finish_reasons == ["length"]
        ks = out.step_ks[0]
        assert out.num_draft_tokens == sum(ks) and out.num_drafts == sum(k > 0 for k in ks)
        if speculation == "auto":
            assert set(ks) <= set(spec.speculative_ks) == {0, 1, 2, 3}
            continue
        assert out.num_drafts >= 1 and ks == [3] * len(ks)
        if always_right:
            assert out.num_accepted_tokens == out.num_draft_tokens
            assert out.acceptance_length == spec.block_size
            assert out.num_accepted_tokens_per_pos == [out.num_drafts] * 3


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_eos_mid_generation(family):
    target, spec = _pair(family, always_right=False)
    prompt = _prompt(9, 3)
    free = target.generate(prompt, do_sample=False, max_new_tokens=MAX_NEW)[0, 9:].tolist()
    # an eos id whose first occurrence is in the middle of the free-running continuation
    eos = next(t for i, t in enumerate(free) if i >= 3 and t not in free[:i])
    stop = free.index(eos)
    ref = target.generate(prompt, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=eos)
    assert ref.shape[1] == 9 + stop + 1  # the reference really stops early
    out = spec.generate(prompt, max_new_tokens=MAX_NEW, eos_token_id=[VOCAB - 1, eos], return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.finish_reasons == ["stop"]


def test_generation_config_defaults():
    target, spec = _pair("qwen3", always_right=False)
    prompt = _prompt(6, 4)
    target.generation_config.max_new_tokens = 11
    assert spec.generate(prompt).shape == (1, 17)
    target.generation_config.max_new_tokens = None
    target.generation_config.max_length = 15  # HF: total length when max_new_tokens is unset
    assert torch.equal(spec.generate(prompt), target.generate(prompt, do_sample=False))
    assert spec.generate(prompt).shape == (1, 15)


def test_max_new_tokens_one_and_block_overshoot():
    target, spec = _pair("llama", always_right=True, block_size=8)
    prompt = _prompt(4, 5)
    for n in (1, 2, 9):  # 9 = one bonus + a full block: the last block must be truncated
        out = spec.generate(prompt, max_new_tokens=n)
        assert torch.equal(out, target.generate(prompt, do_sample=False, max_new_tokens=n))


def test_unsupported_arguments_are_errors():
    _, spec = _pair("llama", always_right=False)
    with pytest.raises(TypeError, match="unsupported arguments"):
        spec.generate(_prompt(3, 0), max_new_tokens=2, typo_arg=1)
    with pytest.raises(ValueError, match="num_beams"):
        spec.generate(_prompt(3, 0), max_new_tokens=2, num_beams=4)
    with pytest.raises(ValueError, match="empty"):
        spec.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2)
