"""Drafting itself, not only the (lossless) output: acceptance against a drafter that is partly right by
construction, and the wrapper's drafts against the drafter run on the whole context from scratch."""

import pytest
import torch

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper
from dflash_compile.models.hidden_states import AuxHiddenStates
from oracle_draft import CyclePolicy, check_drafting, greedy_continuations, oracle_pair
from tiny_models import FAMILIES, VOCAB, random_prompts, small_target, tiny_target

PAD = VOCAB - 2


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_partly_right_drafter_is_accepted_as_far_as_it_is_right(family):
    target = small_target(family)
    prompts = random_prompts([5, 13, 2, 9], 1)
    draft, fulls = oracle_pair(target, prompts, 16, 64, num_layers=2, block_size=4, target_layer_ids=[0, 1], seed=0)
    spec = DFlashSpecWrapper(target, draft, speculation="fixed", max_batch_size=4, max_seq_len=64, page_size=8)
    out = spec.generate(prompts, max_new_tokens=16, pad_token_id=PAD, return_dict_in_generate=True,
                        output_drafts=True)
    for i, (p, full) in enumerate(zip(prompts, fulls)):
        assert out.sequences[i, out.prompt_width:].tolist() == full[len(p):len(p) + 16]
    accepted, forced = check_drafting(draft, prompts, fulls, out)
    # Partly right: many drafts accepted, not all, and every position accepted somewhere.
    assert forced >= 10 and accepted < out.num_draft_tokens, (accepted, forced, out.num_draft_tokens)
    assert all(n > 0 for n in out.num_accepted_tokens_per_pos), out.num_accepted_tokens_per_pos
    assert out.acceptance_length == 1 + accepted / out.num_drafts


def test_output_drafts_needs_the_dict():
    target = tiny_target("llama", num_hidden_layers=2)
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=3, seed=0)
    spec = DFlashSpecWrapper(target, draft, max_batch_size=1, max_seq_len=32)
    with pytest.raises(ValueError, match="return_dict_in_generate"):
        spec.generate([[1, 2, 3]], max_new_tokens=4, output_drafts=True)
    assert spec.generate([[1, 2, 3]], max_new_tokens=4, return_dict_in_generate=True).drafts is None


def _drafts_from_scratch(target, draft, seq: list[int], p: int) -> list[int]:
    """The drafter's block after ``seq[p]`` at position ``p``, its context the target's whole prefix ``seq[:p]``
    (one fresh forward, no cache): DESIGN §1 without the paged pools, the step or the host loop."""
    aux = AuxHiddenStates(target, draft.dflash_config.target_layer_ids)
    try:
        target(torch.tensor([seq[:p]]))
        feats = aux.read()  # [1, p, n_ids * H]
    finally:
        aux.remove()
    k, v = draft.context_kv(draft.context_features(feats), torch.arange(p)[None])
    block = torch.tensor([[seq[p]] + [draft.mask_token_id] * (draft.block_size - 1)])
    return draft(block, torch.arange(p, p + draft.block_size)[None], k, v, torch.tensor([p]))[0].argmax(-1).tolist()


@pytest.mark.parametrize("speculation", ["fixed", "switching"])
@pytest.mark.parametrize("family", ["gemma3", "qwen3"])
@torch.no_grad()
def test_wrapper_drafts_are_the_drafter_on_the_whole_context(family, speculation):
    # fp64, so that the paged, stepwise computation and the fresh one agree to the last argmax. The drafter's
    # weights are scaled up so that its drafts depend on the context it is given (injected rows, their positions,
    # which rows were accepted), and its second layer slides, as published drafters' may.
    target = small_target(family, dtype=torch.float64)
    draft = DFlashDraftModel.from_target(target, num_layers=2, block_size=4, target_layer_ids=[0, 1], seed=0,
                                         layer_types=["full_attention", "sliding_attention"], sliding_window=6)
    for w in draft.parameters():
        if w.dim() == 2:
            w.mul_(10)
    prompts = random_prompts([7, 12, 3], 5)
    # "switching": K changes at every step, with plain steps that propose nothing between speculative ones; the
    # positions those steps accept must reach the drafter's cache all the same.
    policy = "fixed" if speculation == "fixed" else CyclePolicy([0, 2, 0, 0, 3, 1])
    spec = DFlashSpecWrapper(target, draft, speculation=policy, max_batch_size=3, max_seq_len=64, page_size=8)
    out = spec.generate(prompts, max_new_tokens=12, pad_token_id=PAD, return_dict_in_generate=True,
                        output_drafts=True)
    fulls = greedy_continuations(target, prompts, 12 + draft.block_size)
    steps = 0
    for prompt, full, drafts in zip(prompts, fulls, out.drafts):
        p = len(prompt)
        for d in drafts:  # a step verifies the first K of the drafter's block - 1 drafts
            assert d == _drafts_from_scratch(target, draft, full, p)[: len(d)], (prompt, p)
            a = next((j for j in range(len(d)) if d[j] != full[p + 1 + j]), len(d))
            p, steps = p + a + 1, steps + (len(d) > 0)
    assert steps == out.num_drafts >= 5
