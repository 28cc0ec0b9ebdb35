"""transformers' own DFlash assistant format, both ways: drafts compared step by step with transformers' loop."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import VOCAB, tiny_target
from transformers import AutoModel, MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel
from transformers.generation.utils import GenerationMixin

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper, DFlashStats
from dflash_compile.models.hf_format import WEIGHT_NAMES, transformers_assistant

LOGIT_ATOL = 1e-4  # fp32; measured max |diff| is reported by test_transformers_drafts_equal_ours
MAX_NEW = 24


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


def make_draft(target, layers="full"):
    """A random drafter; ``layers="sliding"``: its first layer slides over 4 positions (a block fits exactly)."""
    kinds = {"full": {}, "sliding": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4)}
    # target_layer_ids include the target's last layer: HF's hidden_states entry for it is the normed output.
    draft = DFlashDraftModel.from_target(target, num_layers=2, block_size=4, target_layer_ids=[0, 3], seed=1,
                                         **kinds[layers])
    with torch.no_grad():  # non-trivial norm weights, so a swapped norm would show
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return draft


@pytest.fixture(scope="module")
def draft(target):
    return make_draft(target)


def _prompt(seed=3, n=11):
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def our_draft_logits(draft, target, ids):
    """Our drafter's logits for the block after ``ids[:, :-1]`` (context) with bonus ``ids[:, -1]``: ``[1, B-1, V]``."""
    draft.bind_target(target)
    L, B = ids.shape[1] - 1, draft.block_size
    with torch.no_grad():
        hidden = target(ids[:, :L], output_hidden_states=True).hidden_states
        ctx = draft.context_features(torch.cat([hidden[i + 1] for i in draft.dflash_config.target_layer_ids], -1))
        k, v = draft.context_kv(ctx, torch.arange(L)[None])
        block = torch.cat([ids[:, L:], ids.new_full((1, B - 1), draft.mask_token_id)], dim=1)
        return draft(block, L + torch.arange(B)[None], k, v, torch.tensor([L]))


@contextlib.contextmanager
def hf_steps():
    """Record every drafting step of transformers' DFlash loop: its ``ids`` (context + bonus), draft ``logits`` and
    ``drafts``, and how many were ``accepted`` (the lead drafts equal to the target's argmax, counted before
    transformers trims at max length)."""
    steps: list[dict] = []
    build = GenerationMixin._get_candidate_generator

    def recording(model, *args, **kwargs):
        gen = build(model, *args, **kwargs)
        get, update = gen.get_candidates, gen.update_candidate_strategy

        def get_candidates(input_ids, *a, **k):
            cand, logits = get(input_ids, *a, **k)
            if logits is not None:
                steps.append({"ids": input_ids.clone(), "logits": logits.clone(), "drafts": cand[:, input_ids.shape[1]:]})
            return cand, logits

        def update_candidate_strategy(input_ids, scores, num_matches):
            if steps and "accepted" not in steps[-1]:
                drafts = steps[-1]["drafts"]
                agree = (drafts == scores[:, : drafts.shape[1]].argmax(-1))[0].long()
                steps[-1]["accepted"] = int(agree.cumprod(0).sum())
            return update(input_ids, scores, num_matches)

        gen.get_candidates, gen.update_candidate_strategy = get_candidates, update_candidate_strategy
        return gen

    with mock.patch.object(GenerationMixin, "_get_candidate_generator", recording):
        yield steps


def hf_dflash(target, assistant, prompt, max_new=MAX_NEW):
    with hf_steps() as steps:
        out = target.generate(prompt, max_new_tokens=max_new, do_sample=False, assistant_model=assistant,
                              speculation_type="dflash")
    return out, steps


def ours(target, draft, prompt, max_new=MAX_NEW):
    """Our generate, the drafter's logits at every step (``[1, B-1, V]``) and the accepted drafts of every step."""
    logits, accepted = [], []
    record = DFlashStats.record

    def recording(stats, n, a):
        accepted.append(a)
        return record(stats, n, a)

    spec = DFlashSpecWrapper(target, draft, speculation="fixed", max_batch_size=1)
    hook = draft.register_forward_hook(lambda module, args, out: logits.append(out[:1].detach().clone()))
    try:
        with mock.patch.object(DFlashStats, "record", recording):
            out = spec.generate(prompt, max_new_tokens=max_new, return_dict_in_generate=True)
    finally:
        hook.remove()
    return out, logits, accepted


def assert_same_drafts(steps, logits):
    """At every step of transformers' loop, ``logits[i]`` (ours) propose the same draft tokens, within tolerance;
    returns the largest logit difference."""
    assert len(steps) >= 3 and len(logits) >= len(steps)
    worst = 0.0
    for step, mine in zip(steps, logits):
        assert torch.equal(mine.argmax(-1), step["drafts"])
        worst = max(worst, (mine - step["logits"]).abs().max().item())
    assert worst <= LOGIT_ATOL
    return worst


def assert_same_steps(steps, logits, accepted):
    """Our generate's steps equal transformers' loop's: the same drafts and the same number accepted. transformers
    stops drafting when no room is left for a draft, so ours may take one step more."""
    assert_same_drafts(steps, logits)
    n = len(steps)
    assert len(accepted) in (n, n + 1)
    assert [s["accepted"] for s in steps] == accepted[:n]


def our_drafts_on(draft, target, steps):
    return [our_draft_logits(draft, target, step["ids"]) for step in steps]


@pytest.mark.parametrize("layers", ["full", "sliding"])
def test_transformers_drafts_equal_ours(target, layers, tmp_path):
    """(a) ours -> transformers' format -> transformers' own class: the same drafts at every step of its loop
    (the prompt is longer than the sliding window)."""
    draft = make_draft(target, layers)
    draft.save_pretrained(tmp_path, format="transformers")
    assistant = AutoModel.from_pretrained(tmp_path, dtype=torch.float32)
    assert isinstance(assistant, MuseGlimmerAssistantModel)
    _, steps = hf_dflash(target, assistant, _prompt())
    worst = assert_same_drafts(steps, our_drafts_on(draft, target, steps))
    print(f"max |logit diff| transformers' assistant vs ours: {worst:.3g}")
    # The in-memory rebuild (benchmarks) is the same model as the saved one.
    mem = transformers_assistant(draft).state_dict()
    assert all(torch.equal(v, mem[k]) for k, v in assistant.state_dict().items())


def _default_pair(sliding=False):
    """The shipped trained pair (it accepts several drafts per step); ``sliding``: the same drafter weights with
    its first layer sliding over 8 positions (one block) and the others full attention."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_compile.assets import tiny_pair_paths

    target_dir, draft_dir = tiny_pair_paths()
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    prompt = AutoTokenizer.from_pretrained(target_dir)(["def fibonacci(n):\n"], return_tensors="pt")["input_ids"]
    draft = DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32)
    if sliding:
        layers = draft.dflash_config.num_draft_layers
        kinds = dict(layer_types=["sliding_attention"] + ["full_attention"] * (layers - 1), sliding_window=8)
        config = type(draft.config)(**{**draft.config.to_dict(), **kinds})
        windowed = DFlashDraftModel(config, dataclasses.replace(draft.dflash_config, **kinds))
        windowed.load_state_dict(draft.state_dict())
        draft = windowed.eval()
    return target, draft, prompt


@pytest.mark.parametrize("pair", ["tiny", "default_pair", "default_pair_sliding"])
def test_transformers_loop_is_lossless_and_accepts_as_ours(pair, target, draft, tmp_path):
    """(b) transformers' loop with our drafter equals target greedy, and drafts and accepts exactly what our
    generate drafts and accepts, step by step (the trained default pair accepts several per step)."""
    if pair.startswith("default_pair"):
        target, draft, prompt = _default_pair(sliding=pair.endswith("sliding"))
        max_new = 48
    else:
        prompt, max_new = _prompt(), MAX_NEW
    draft.save_pretrained(tmp_path, format="transformers")
    assistant = AutoModel.from_pretrained(tmp_path, dtype=torch.float32)
    reference = target.generate(prompt, max_new_tokens=max_new, do_sample=False)
    hf_out, steps = hf_dflash(target, assistant, prompt, max_new)
    assert torch.equal(hf_out, reference)
    assert_same_drafts(steps, our_drafts_on(draft, target, steps))
    out, logits, accepted = ours(target, draft, prompt, max_new)
    assert torch.equal(out.sequences, reference)
    assert_same_steps(steps, logits, accepted)
    if pair.startswith("default_pair"):
        assert sum(accepted) / len(accepted) > 1.0


def _hf_built_checkpoint(path, target):
    """A transformers-format checkpoint written by transformers' own class (random init), sized from ``target``.
    RMS eps, RoPE and layer types are left to transformers' defaults (1e-5, theta 500000, all sliding), with a
    window shorter than the prompt."""
    tc = target.config
    fields = {name: getattr(tc, name) for name in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                  "num_key_value_heads", "head_dim", "max_position_embeddings")}
    fields.update(
        num_hidden_layers=2,
        sliding_window=6,
        block_size=5,
        mask_token_id=VOCAB - 2,
        target_layer_ids=[1, 3],
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    assistant = MuseGlimmerAssistantModel(MuseGlimmerAssistantConfig(**fields))
    with torch.no_grad():
        for name, p in assistant.named_parameters():
            if name.endswith("norm.weight") or name.endswith("output_norm_enc.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    assistant.save_pretrained(path)
    return path


def test_transformers_built_checkpoint_loads_as_ours(target, tmp_path):
    """(c) a checkpoint transformers' own class wrote -> our from_pretrained: the same drafts as transformers' at
    every step of its loop, and our generate is lossless."""
    path = _hf_built_checkpoint(tmp_path, target)
    draft = DFlashDraftModel.from_pretrained(path, num_target_layers=4, vocab_size=VOCAB)
    assert draft.config.rms_norm_eps == 1e-5 and draft.config.rope_parameters["rope_theta"] == 500000.0
    assert draft.block_size == 5 and draft.dflash_config.target_layer_ids == (1, 3)
    assert draft.dflash_config.layer_types == ("sliding_attention",) * 2 and draft.dflash_config.sliding_window == 7
    assistant = AutoModel.from_pretrained(path, dtype=torch.float32)
    prompt = _prompt(seed=5)
    hf_out, steps = hf_dflash(target, assistant, prompt)
    assert_same_drafts(steps, our_drafts_on(draft, target, steps))
    reference = target.generate(prompt, max_new_tokens=MAX_NEW, do_sample=False)
    out, logits, accepted = ours(target, draft, prompt)
    assert torch.equal(out.sequences, reference) and torch.equal(hf_out, reference)
    assert_same_steps(steps, logits, accepted)


@pytest.mark.parametrize("layers", ["full", "sliding"])
def test_round_trips_are_bit_identical(target, layers, tmp_path):
    """(d) ours -> transformers -> ours, and transformers -> ours -> transformers, change no bit."""
    draft = make_draft(target, layers)
    draft.save_pretrained(tmp_path / "hf", format="transformers")
    back = DFlashDraftModel.from_pretrained(tmp_path / "hf")
    assert back.dflash_config == draft.dflash_config
    draft.save_pretrained(tmp_path / "ours")
    assert back.config.to_dict() == DFlashDraftModel.from_pretrained(tmp_path / "ours").config.to_dict()
    mine, theirs = draft.state_dict(), back.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert set(load_file(tmp_path / "hf" / "model.safetensors")) == {WEIGHT_NAMES.get(k, k) for k in mine}

    hf_dir = _hf_built_checkpoint(tmp_path / "built", target)
    DFlashDraftModel.from_pretrained(hf_dir, num_target_layers=4, vocab_size=VOCAB).save_pretrained(
        tmp_path / "again", format="transformers"
    )
    a, b = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _edit(path, drop=(), **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    for k in drop:
        cfg.pop(k)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "edit, message",
    [
        (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=2), "wider than the sliding window"),
        (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}), "'dynamic' rescales"),
        (dict(drop=["num_target_layers"]), "num_target_layers=..."),
        (dict(drop=["vocab_size"]), "vocab_size=..."),
        (dict(architectures=["LlamaForCausalLM"]), "not a MuseGlimmerAssistantModel"),
        (dict(model_type="llama"), "not a DFlashDraftModel"),
    ],
)
def test_unrepresentable_transformers_configs_raise(draft, tmp_path, edit, message):
    """(e) what our drafter cannot compute exactly, or cannot know, is an error naming it."""
    draft.save_pretrained(tmp_path, format="transformers")
    _edit(tmp_path, **edit)
    with pytest.raises(ValueError, match=message):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_malformed_transformers_checkpoints_raise(draft, tmp_path):
    """(e) missing weights are named as the checkpoint names them; the caller's target facts must agree."""
    draft.save_pretrained(tmp_path, format="transformers")
    with pytest.raises(ValueError, match="num_target_layers=8 was passed, but the checkpoint's config.json says 4"):
        DFlashDraftModel.from_pretrained(tmp_path, num_target_layers=8)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["encoder.fc.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing weights \['encoder.fc.weight'\]"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_save_rejects_what_transformers_would_compute_differently(target, tmp_path):
    """(e) an unknown format, and a block wider than the sliding window in transformers' format, are refused
    before anything is written."""
    draft = DFlashDraftModel.from_target(target, num_layers=2, block_size=8, sliding_window=6,
                                         layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ValueError, match="unknown checkpoint format 'onnx'"):
        draft.save_pretrained(tmp_path / "x", format="onnx")
    with pytest.raises(ValueError, match="cannot write .* a block of 8 tokens is wider than the sliding window of 6"):
        draft.save_pretrained(tmp_path / "y", format="transformers")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
