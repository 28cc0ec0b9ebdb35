"""A reduced draft vocabulary (the drafter's own head over a subset of the target's tokens, ``d2t`` naming them):
the step's logits are the target-vocabulary ones with -inf elsewhere; the full identity map gives the full-vocabulary
drafter's logits exactly; checkpoints round-trip; greedy output stays the target's own and the sampled law the
target's law; training ignores labels the draft vocabulary cannot say."""

import pytest
import torch

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper
from tiny_models import VOCAB, random_prompts, tiny_target


def _drafter(target, vocab=None, seed=0):
    return DFlashDraftModel.from_target(target, num_layers=2, block_size=4, target_layer_ids=[1, 3], seed=seed,
                                        mask_token_id=VOCAB - 1, draft_vocab=vocab)


def _inputs(target, draft, n_ctx=9):
    torch.manual_seed(1)
    L, Hkv, D = draft.config.num_hidden_layers, draft.config.num_key_value_heads, draft.config.head_dim
    ctx_k, ctx_v = torch.randn(2, L, 2, n_ctx, Hkv, D)
    block = torch.tensor([[5, VOCAB - 1, VOCAB - 1, VOCAB - 1]] * 2)
    pos = torch.tensor([[n_ctx + i for i in range(4)]] * 2)
    return block, pos, ctx_k, ctx_v, torch.tensor([n_ctx, 4])


def test_identity_map_is_the_full_vocabulary_drafter():
    target = tiny_target("qwen3")
    full = _drafter(target)
    same = _drafter(target, vocab=list(range(VOCAB)))
    assert same.draft_head.weight.data_ptr() != target.get_output_embeddings().weight.data_ptr()
    torch.testing.assert_close(same.draft_head.weight, target.get_output_embeddings().weight, rtol=0, atol=0)
    args = _inputs(target, full)
    torch.testing.assert_close(same(*args), full(*args), rtol=0, atol=0)


def test_reduced_vocabulary_logits_are_minus_inf_outside_it():
    target = tiny_target("qwen3")
    vocab = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:37]
    full, small = _drafter(target), _drafter(target, vocab=vocab)
    args = _inputs(target, full)
    got, ref = small(*args), full(*args)
    inside = torch.zeros(VOCAB, dtype=torch.bool)
    inside[vocab] = True
    assert bool(torch.isneginf(got[..., ~inside]).all()) and bool(torch.isfinite(got[..., inside]).all())
    # the same weights score the same tokens: the head rows are the target's rows of those tokens
    torch.testing.assert_close(got[..., vocab], ref[..., vocab], rtol=1e-6, atol=1e-6)
    assert set(got.argmax(-1).flatten().tolist()) <= set(vocab.tolist())
    assert small.target_to_draft(vocab).tolist() == list(range(37))
    outside = int((~inside).nonzero()[0])
    assert small.target_to_draft(torch.tensor([outside])).tolist() == [-1]


def test_checkpoint_round_trip(tmp_path):
    target = tiny_target("qwen3")
    vocab = torch.arange(0, VOCAB, 3)
    draft = _drafter(target, vocab=vocab)
    with torch.no_grad():
        draft.draft_head.weight.mul_(1.5)  # trained away from the target's rows
    draft.save_pretrained(tmp_path / "d")
    back = DFlashDraftModel.from_pretrained(tmp_path / "d").bind_target(target)
    assert back.draft_vocab_size == len(vocab) and torch.equal(back.d2t, vocab)
    args = _inputs(target, draft)
    torch.testing.assert_close(back(*args), draft(*args), rtol=0, atol=0)
    with pytest.raises(ValueError, match="no reduced draft vocabulary"):
        draft.save_pretrained(tmp_path / "t", format="transformers")


def test_bad_d2t_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    target = tiny_target("qwen3")
    _drafter(target, vocab=torch.arange(10)).save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["d2t"] = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 8])  # a repeated id
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="d2t"):
        DFlashDraftModel.from_pretrained(tmp_path)


@pytest.mark.parametrize("do_sample", [False, True])
def test_greedy_and_sampled_output_with_a_reduced_vocabulary(do_sample):
    target = tiny_target("qwen3")
    prompts = random_prompts([5, 11], seed=4)
    # a vocabulary that holds what the target says greedily, and a lot more
    with torch.no_grad():
        ref = [target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=12)[0, len(p):] for p in prompts]
    vocab = torch.unique(torch.cat(ref + [torch.arange(0, VOCAB, 2)]))
    spec = DFlashSpecWrapper(target, _drafter(target, vocab=vocab), num_speculative_tokens=3, max_batch_size=2)
    out = spec.generate(prompts, max_new_tokens=12, do_sample=do_sample, temperature=0.9, seed=[0, 1],
                        pad_token_id=0, return_dict_in_generate=True, output_drafts=True)
    drafted = {t for s in out.drafts for row in s for t in row}
    assert drafted and drafted <= set(vocab.tolist())  # drafts only ever come from the draft vocabulary
    if not do_sample:
        for i, p in enumerate(prompts):
            assert out.sequences[i, -12:].tolist() == ref[i].tolist()  # left-padded: the new tokens come last


def test_training_labels_outside_the_vocabulary_are_not_in_the_loss():
    from dflash_compile.training.objective import dflash_loss

    target = tiny_target("qwen3")
    draft = _drafter(target, vocab=torch.arange(0, VOCAB // 2))
    tokens = torch.randint(0, VOCAB // 2, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hs = target(tokens, output_hidden_states=True).hidden_states
    aux = torch.cat([hs[i + 1] for i in draft.dflash_config.target_layer_ids], -1)
    anchors, valid = torch.tensor([[4, 12], [6, 15]]), torch.tensor([True, True])
    loss, m = dflash_loss(draft, aux, tokens, anchors, valid, gamma=4.0)
    out = tokens.clone()
    out[:, 8:] += VOCAB // 2  # every later label is outside the draft vocabulary
    loss_out, m_out = dflash_loss(draft, aux, out, anchors, valid, gamma=4.0)
    assert torch.isfinite(loss_out) and float(loss_out) != float(loss)
    assert m_out["tau"] <= m["tau"]
    loss_out.backward()
    assert draft.draft_head.weight.grad is not None


def test_narrowed_vocabulary_keeps_the_kept_tokens_logits():
    from dflash_compile.models.checkpoint import narrow_draft_vocab

    target = tiny_target("qwen3")
    vocab = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:37]
    wide = _drafter(target, vocab=vocab)
    keep = vocab[torch.randperm(37, generator=torch.Generator().manual_seed(4))[:20]]
    narrow = narrow_draft_vocab(wide, keep).bind_target(target)
    assert narrow.draft_vocab_size == 20 and narrow.d2t.tolist() == keep.tolist()
    args = _inputs(target, wide)
    a, b = wide(*args), narrow(*args)
    torch.testing.assert_close(b[..., keep], a[..., keep], rtol=0, atol=0)
    others = torch.ones(VOCAB, dtype=torch.bool)
    others[keep] = False
    assert torch.isneginf(b[..., others]).all()
    with pytest.raises(ValueError, match="not in it"):
        narrow_draft_vocab(wide, [int(t) for t in range(VOCAB) if t not in set(vocab.tolist())][:1])
