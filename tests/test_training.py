"""The drafter training recipe: the block mask, train/inference agreement, loss going down, checkpoints, resume."""

from __future__ import annotations

import shutil

import pytest
import torch

from dflash_compile import DFlashDraftModel
from dflash_compile.models.hidden_states import AuxHiddenStates
from dflash_compile.training import (
    DataConfig,
    TrainConfig,
    block_inputs,
    block_mask,
    generate_continuations,
    latest_checkpoint,
    layer_masks,
    position_weights,
    sample_anchors,
    train_drafter,
)
from dflash_compile.training.data import corpus_prompts, docstring_ends
from tiny_models import VOCAB, tiny_target


@pytest.mark.parametrize("window", [None, 3, 6])
@pytest.mark.parametrize("anchors,num_ctx,B", [([[3, 5, 9]], 12, 4), ([[1, 1], [7, 10]], 11, 3), ([[6]], 7, 2)])
def test_block_mask_is_exact(anchors, num_ctx, B, window):
    anchors = torch.tensor(anchors)
    m = block_mask(anchors, num_ctx, B, window)
    N, nb = anchors.shape
    assert m.shape == (N, 1, nb * B, num_ctx + nb * B) and m.dtype == torch.bool
    for n in range(N):
        for q in range(nb * B):
            j = q // B
            q_pos = int(anchors[n, j]) + q % B
            for key in range(num_ctx + nb * B):
                if key < num_ctx:  # context row at position `key`: visible iff strictly before the anchor
                    want = key < anchors[n, j]
                    key_pos = key
                else:  # block key: visible iff in the query's own block
                    want = (key - num_ctx) // B == j
                    key_pos = int(anchors[n, (key - num_ctx) // B]) + (key - num_ctx) % B
                if window is not None:  # and, in a sliding layer, less than `window` positions behind the query
                    want = want and q_pos - key_pos < window
                assert bool(m[n, 0, q, key]) == bool(want), (n, q, key)


def test_block_inputs_and_weights():
    tokens = torch.arange(20).view(1, 20) + 100
    ids, pos, labels = block_inputs(tokens, torch.tensor([[2, 10]]), 4, mask_token_id=7)
    assert ids.tolist() == [[102, 7, 7, 7, 110, 7, 7, 7]]
    assert pos.tolist() == [[2, 3, 4, 5, 10, 11, 12, 13]]
    assert labels.tolist() == [[[103, 104, 105], [111, 112, 113]]]
    w = position_weights(5, gamma=2.0)
    torch.testing.assert_close(w, torch.exp(-torch.arange(4.0) / 2.0))


def test_sample_anchors_in_range():
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([40, 12, 5])
    a, valid = sample_anchors(lengths, 6, 4, torch.tensor([8, 8, 3]), g)
    assert valid.tolist() == [True, True, False]
    assert bool((a[0] >= 8).all() and (a[0] <= 36).all())
    assert bool((a[1] == 8).all())  # the one anchor that fits: 12 - 4
    assert bool((a[:, 1:] >= a[:, :-1]).all())


def _pair(seed=0, block_size=4, **overrides):
    target = tiny_target("qwen3", seed=seed)
    draft = DFlashDraftModel.from_target(target, num_layers=2, block_size=block_size, seed=seed + 1, **overrides)
    return target, draft


@pytest.mark.parametrize("layers", ["full", "sliding"])
def test_training_blocks_match_inference_forward(layers):
    """A block in the one-pass training forward gives the same logits as the inference ``forward`` with the
    context cache holding positions < anchor (``ctx_lens = anchor``); a sliding-window layer hides the same
    keys in both (the window, 5, is shorter than most anchors here)."""
    torch.manual_seed(0)
    sliding = {} if layers == "full" else dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    target, draft = _pair(**sliding)
    B, T = draft.block_size, 24
    tokens = torch.randint(0, VOCAB - 1, (2, T))
    aux = AuxHiddenStates(target, draft.dflash_config.target_layer_ids)
    with torch.no_grad():
        target(input_ids=tokens)
        hidden = aux.read()
        ctx = draft.context_features(hidden)
        ck, cv = draft.context_kv(ctx, torch.arange(T).expand(2, T))
        anchors = torch.tensor([[3, 9, 15], [5, 6, 20]])
        ids, pos, _ = block_inputs(tokens, anchors, B, draft.mask_token_id)
        masks = layer_masks(draft, anchors, T)
        if layers == "sliding":
            assert not torch.equal(masks[0], masks[1])
            with pytest.raises(ValueError, match="one mask per layer"):
                draft.forward_blocks(ids, pos, ck, cv, block_mask(anchors, T, B))
        train_logits = draft.forward_blocks(ids, pos, ck, cv, masks).view(2, 3, B, -1)
        for n in range(2):
            for j in range(3):
                a = int(anchors[n, j])
                block = ids.view(2, 3, B)[n : n + 1, j]
                ref = draft(block, pos.view(2, 3, B)[n : n + 1, j], ck[:, n : n + 1], cv[:, n : n + 1], torch.tensor([a]))
                torch.testing.assert_close(train_logits[n : n + 1, j, 1:], ref, atol=1e-5, rtol=1e-5)
    aux.remove()


def _data(target, n=24, prompt_len=8, gen_len=40):
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, VOCAB - 1, (n, prompt_len), generator=g)
    return generate_continuations(target, prompts, DataConfig(num_prompts=n, prompt_len=prompt_len, gen_len=gen_len,
                                                               gen_batch=8), progress=False)


def test_generate_continuations_are_the_targets_greedy_output():
    target, _ = _pair()
    ds = _data(target, n=4)
    assert ds.tokens.shape == (4, 48) and ds.lengths.tolist() == [48] * 4
    ref = target.generate(ds.tokens[:, :8], do_sample=False, max_new_tokens=40)
    assert torch.equal(ds.tokens, ref)


def test_few_steps_lower_the_loss_and_checkpoint_loads(tmp_path):
    target, draft = _pair()
    ds = _data(target)
    cfg = TrainConfig(steps=30, batch_size=8, blocks_per_seq=6, lr=3e-3, warmup_steps=3, checkpoint_every=10, seed=0)
    summary = train_drafter(target, draft, ds, cfg, tmp_path, progress=False)
    losses = [h["loss"] for h in summary["history"]]
    assert summary["step"] == 30
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5, losses
    loaded = DFlashDraftModel.from_pretrained(tmp_path)
    assert loaded.block_size == draft.block_size
    for k, v in draft.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v)
    assert latest_checkpoint(tmp_path).name == "step_0000030.pt"


def test_resume_continues_exactly(tmp_path):
    target, _ = _pair()
    ds = _data(target, n=12)
    cfg = TrainConfig(steps=6, batch_size=4, blocks_per_seq=3, lr=3e-3, warmup_steps=2, checkpoint_every=3, seed=1)

    _, straight = _pair()
    full = train_drafter(target, straight, ds, cfg, tmp_path / "a", progress=False)

    # An interrupted run: only the step-3 checkpoint of the same schedule exists.
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    shutil.copy(tmp_path / "a" / "checkpoints" / "step_0000003.pt", tmp_path / "b" / "checkpoints")
    _, resumed = _pair(seed=5)  # different init: everything must come from the checkpoint
    out = train_drafter(target, resumed, ds, cfg, tmp_path / "b", resume=True, progress=False)
    assert out["step"] == 6 and [h["step"] for h in out["history"]] == list(range(1, 7))
    assert [h["loss"] for h in out["history"]] == [h["loss"] for h in full["history"]]
    for k, v in straight.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[k], v)


def test_held_out_rows_are_never_trained_on_and_are_scored(tmp_path, monkeypatch):
    from dflash_compile.training import trainer

    target, draft = _pair()
    ds = _data(target, n=12)
    cfg = TrainConfig(steps=4, batch_size=4, blocks_per_seq=3, lr=3e-3, warmup_steps=1, checkpoint_every=4, seed=1,
                      held_out=3, eval_every=2)
    seen = []
    real = trainer._Batches.rows

    def rows(self, idx, gen, num_blocks):
        seen.append((idx.tolist(), gen.initial_seed()))
        return real(self, idx, gen, num_blocks)

    monkeypatch.setattr(trainer._Batches, "rows", rows)
    out = train_drafter(target, draft, ds, cfg, tmp_path, progress=False)
    held = {i for idx, s in seen if s == cfg.seed + 2 for i in idx}  # the scoring generator
    trained = {i for idx, s in seen if s == cfg.seed for i in idx}
    assert len(held) == 3 and not held & trained and trained <= set(range(12)) - held
    scores = [h["held_out"] for h in out["history"] if "held_out" in h]
    assert [h["step"] for h in out["history"] if "held_out" in h] == [2, 4]
    assert out["held_out"] == scores[-1] and scores[-1]["rows"] == 3
    assert len(scores[-1]["acc"]) == draft.block_size - 1 and 1.0 <= scores[-1]["tau"] <= draft.block_size
    assert all(0.0 <= a <= 1.0 for a in scores[-1]["acc"])


_SOURCE = '''import math


def area(r):
    """Area of a circle."""
    return math.pi * r * r


def bare(x):
    return x


class Shape:
    def scale(self, k):
        """Scale by k.

        Multi-line docstring.
        """
        self.k = k

    def only_doc(self):
        """No body after this."""
'''


def _char_tokenizer(text):
    """Characters as token ids: a prompt's tokens are exactly its last characters."""
    return {"input_ids": [ord(c) for c in text]}


def test_docstring_ends_cut_after_each_documented_function_with_a_body():
    ends = docstring_ends(_SOURCE)
    assert [_SOURCE[:e].splitlines()[-1].strip() for e in ends] == ['"""Area of a circle."""', '"""']
    assert all(_SOURCE[e - 1] == "\n" for e in ends)
    assert _SOURCE[ends[0]:].startswith("    return math.pi")
    assert _SOURCE[ends[1]:].startswith("        self.k = k")
    assert docstring_ends("def broken(:\n") == []


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_corpus_prompts_mix_windows_and_signature_prompts(tmp_path, share):
    f = tmp_path / "shapes.py"
    f.write_text(_SOURCE)
    P, n = 24, 10
    prompts = corpus_prompts(_char_tokenizer, [f], n, P, seed=3, signature_share=share)
    assert prompts.shape == (n, P)
    texts = ["".join(map(chr, row.tolist())) for row in prompts]
    assert all(t in _SOURCE for t in texts)  # every prompt is a window of the source
    cut = [t for t in texts if any(_SOURCE[:e].endswith(t) for e in docstring_ends(_SOURCE))]
    assert len(cut) >= round(share * n)  # random windows may also end at a cut by chance
    if share == 1.0:
        assert len(cut) == n
    assert torch.equal(prompts, corpus_prompts(_char_tokenizer, [f], n, P, seed=3, signature_share=share))


def test_corpus_prompts_refuses_signature_prompts_the_corpus_cannot_give(tmp_path):
    f = tmp_path / "shapes.py"
    f.write_text(_SOURCE)
    with pytest.raises(ValueError, match="no documented function"):
        corpus_prompts(_char_tokenizer, [f], 4, len(_SOURCE), seed=0, signature_share=0.5)
    with pytest.raises(ValueError, match=r"signature_share must be in \[0, 1\]"):
        DataConfig(signature_share=1.5)


def test_the_reported_draft_vocabulary_is_the_one_trained_with_resumed_included(tmp_path, capsys):
    """The coverage line describes the drafter's own map: a resumed run reports its checkpoint's, not the data's
    most frequent tokens (what the command line would choose afresh)."""
    from dflash_compile.training.data import frequent_tokens, token_coverage

    target, _ = _pair()
    ds = _data(target, n=8)
    rare = torch.arange(VOCAB - 32, VOCAB)  # a map the data seldom uses
    _, draft = _pair(draft_vocab=rare)
    cfg = TrainConfig(steps=2, batch_size=4, blocks_per_seq=2, lr=1e-3, warmup_steps=1, checkpoint_every=1, seed=0)
    train_drafter(target, draft, ds, cfg, tmp_path, progress=False)
    first = capsys.readouterr().out
    want = f"{token_coverage(ds, rare, VOCAB):.2%}"
    assert f"draft vocabulary: 32 of {VOCAB} tokens, {want} of" in first, first
    fresh = frequent_tokens(ds, 32, VOCAB)  # what a fresh choice would be
    assert f"{token_coverage(ds, fresh, VOCAB):.2%}" != want
    _, again = _pair(draft_vocab=fresh)
    train_drafter(target, again, ds, TrainConfig(**{**cfg.__dict__, "steps": 3}), tmp_path, resume=True,
                  progress=False)
    resumed = capsys.readouterr().out
    assert "resumed from" in resumed and f"{want} of" in resumed, resumed
    assert torch.equal(again.d2t, rare)
