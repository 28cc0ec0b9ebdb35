"""Drafters every engine reads the same way: each format this project writes (the authors' ``dflash``, transformers'
own, ``speculators``) means to transformers' config classes and to vLLM's documented resolution rules exactly what
this project runs (window, causality, target layers, mask token, draft vocabulary), round-trips bit for bit, and
drafts the same tokens."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from dflash_compile import DFlashDraftModel
from tiny_models import VOCAB, tiny_target

KINDS = {
    "full": {},
    "sliding": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6),
    "reduced_vocab": dict(draft_vocab=[3, 90, 7, 11, 50, 64, 2, 33, 80, 95]),  # not ascending: speculators sorts
}


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


def _draft(target, kind):
    d = DFlashDraftModel.from_target(target, num_layers=2, block_size=4, target_layer_ids=[1, 3], seed=2,
                                     mask_token_id=VOCAB - 1, **KINDS[kind])
    with torch.no_grad():
        for name, p in d.named_parameters():
            if name.endswith("norm.weight") or name == "draft_head.weight":
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return d


def _inputs(draft, n_ctx=9):
    g = torch.Generator().manual_seed(4)
    L, Hkv, D = draft.config.num_hidden_layers, draft.config.num_key_value_heads, draft.config.head_dim
    ctx_k, ctx_v = torch.randn(2, L, 2, n_ctx, Hkv, D, generator=g)
    block = torch.tensor([[5, VOCAB - 1, VOCAB - 1, VOCAB - 1], [9, VOCAB - 1, VOCAB - 1, VOCAB - 1]])
    pos = torch.tensor([[n_ctx + i for i in range(4)], [4 + i for i in range(4)]])
    return block, pos, ctx_k, ctx_v, torch.tensor([n_ctx, 4])


def vllm_view(cfg: dict) -> dict:
    """What vLLM's DFlash loader resolves from an authors-format ``config.json`` (its documented rules): the
    window from ``dflash_config.swa_window_size``, else the top-level ``sliding_window`` as transformers' config
    class parses it; sliding layers causal unless ``is_causal`` / ``dflash_config.causal`` say otherwise; the draft
    vocabulary from the parsed config's top-level ``draft_vocab_size``, else the vocabulary (vLLM 0.32,
    ``DFlashQwen3ForCausalLM.__init__``)."""
    d = cfg.get("dflash_config") or {}
    parsed = Qwen3Config(**{k: v for k, v in cfg.items() if k not in ("dflash_config", "architectures")})
    types = list(parsed.layer_types)
    window = d.get("swa_window_size", parsed.sliding_window)
    causal_flag = d.get("causal", cfg.get("is_causal"))
    return {
        "layer_types": types,
        "window": window if "sliding_attention" in types else None,
        "causal": [bool(causal_flag) if causal_flag is not None else t == "sliding_attention" for t in types],
        "target_layer_ids": list(d["target_layer_ids"]),
        "mask_token_id": d["mask_token_id"],
        "draft_vocab_size": getattr(parsed, "draft_vocab_size", None) or parsed.vocab_size,
    }


def ours(draft) -> dict:
    c = draft.dflash_config
    return {"layer_types": list(c.layer_types), "window": c.sliding_window, "causal": [False] * len(c.layer_types),
            "target_layer_ids": list(c.target_layer_ids), "mask_token_id": c.mask_token_id,
            "draft_vocab_size": c.draft_vocab_size or draft.config.vocab_size}


def speculators_view(cfg: dict) -> dict:
    """What a speculators reader resolves: the nested layer config through transformers' Qwen3Config, hidden-state
    indices minus one as decoder-layer ids, non-causal blocks in sliding layers only with ``sliding_window_non_causal``."""
    parsed = Qwen3Config(**cfg["transformer_layer_config"])
    types = list(parsed.layer_types)
    return {
        "layer_types": types,
        "window": parsed.sliding_window if "sliding_attention" in types else None,
        "causal": [t == "sliding_attention" and not cfg["sliding_window_non_causal"] for t in types],
        "target_layer_ids": [i - 1 for i in cfg["aux_hidden_state_layer_ids"]],
        "mask_token_id": cfg["mask_token_id"],
        "draft_vocab_size": cfg["draft_vocab_size"],
    }


@pytest.mark.parametrize("kind", list(KINDS))
def test_written_configs_mean_what_we_run(target, kind, tmp_path):
    draft = _draft(target, kind)
    draft.save_pretrained(tmp_path / "dflash")
    assert vllm_view(json.loads((tmp_path / "dflash" / "config.json").read_text())) == ours(draft)
    draft.save_pretrained(tmp_path / "spec", format="speculators")
    cfg = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash" and cfg["sample_from_anchor"] is False
    assert speculators_view(cfg) == ours(draft)


@pytest.mark.parametrize("pair,window", [("tiny", 192), ("chat", 256)])
def test_the_shipped_drafters_mean_what_we_run(pair, window):
    from dflash_compile.assets import _ROOT

    draft_dir = _ROOT / f"{pair}_pair" / "draft"
    cfg = json.loads((draft_dir / "config.json").read_text())
    draft = DFlashDraftModel.from_pretrained(draft_dir)
    assert vllm_view(cfg) == ours(draft) and ours(draft)["window"] == window


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_format_round_trips_and_drafts_the_same(target, kind, tmp_path):
    draft = _draft(target, kind)
    ref = draft(*_inputs(draft))
    formats = ["dflash", "speculators"] + (["transformers"] if kind != "reduced_vocab" else [])
    for fmt in formats:
        draft.save_pretrained(tmp_path / fmt, format=fmt)
        back = DFlashDraftModel.from_pretrained(tmp_path / fmt, num_target_layers=4, vocab_size=VOCAB)
        back.bind_target(target)
        assert back.dflash_config == draft.dflash_config, fmt
        mine, theirs = draft.state_dict(), back.state_dict()
        if kind == "reduced_vocab":  # written sorted by target id: same map, rows permuted
            assert torch.equal(theirs["d2t"], mine["d2t"].sort().values)
            order = mine["d2t"].argsort()
            assert torch.equal(theirs["draft_head.weight"], mine["draft_head.weight"][order])
            mine = {k: v for k, v in mine.items() if k not in ("d2t", "draft_head.weight")}
        assert all(torch.equal(mine[k], theirs[k]) for k in mine), fmt
        # exact, but for head rows written in another order (a GEMM may round a column by its place: 1e-6)
        tol = 1e-6 if kind == "reduced_vocab" else 0
        torch.testing.assert_close(back(*_inputs(back)), ref, rtol=tol, atol=tol, msg=fmt)
        assert back(*_inputs(back)).argmax(-1).tolist() == ref.argmax(-1).tolist()


@pytest.mark.parametrize("fmt", ["dflash", "speculators"])
def test_draft_vocabulary_tensors_are_the_ones_vllm_loads(target, tmp_path, fmt):
    """vLLM's DFlash loader takes ``lm_head.weight`` as the draft head and ``d2t`` as offsets, skips ``t2d``, and
    shares the target's head when the file has none."""
    draft = _draft(target, "reduced_vocab")
    draft.save_pretrained(tmp_path, format=fmt)
    st = load_file(tmp_path / "model.safetensors")
    ids = sorted(KINDS["reduced_vocab"]["draft_vocab"])
    assert st["d2t"].dtype == torch.int64 and (st["d2t"] + torch.arange(len(ids))).tolist() == ids  # offsets
    assert st["t2d"].dtype == torch.bool and st["t2d"].shape == (VOCAB,) and st["t2d"].nonzero().flatten().tolist() == ids
    assert st["lm_head.weight"].shape == (len(ids), draft.config.hidden_size)
    assert "draft_head.weight" not in st and "embed_tokens.weight" not in st
    # a full-vocabulary drafter writes no head and no maps (readers take the verifier's)
    _draft(target, "full").save_pretrained(tmp_path / "full", format=fmt)
    assert not {"lm_head.weight", "d2t", "t2d"} & set(load_file(tmp_path / "full" / "model.safetensors"))


def _edit(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if isinstance(v, dict):
            cfg[k] = {**cfg.get(k, {}), **v}
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("fmt, edit, message", [
    ("dflash", dict(dflash_config={"causal": True}), "causal"),
    ("dflash", dict(dflash_config={"swa_window_size": 5}), "two sliding windows"),
    ("speculators", dict(sample_from_anchor=True), "sample_from_anchor"),
    ("speculators", dict(sliding_window_non_causal=False), "causal sliding-attention"),
    ("speculators", dict(aux_hidden_state_layer_ids=[0, 4]), "ids >= 1"),
])
def test_configs_we_would_run_differently_are_refused(target, tmp_path, fmt, edit, message):
    _draft(target, "sliding").save_pretrained(tmp_path, format=fmt)
    _edit(tmp_path, **edit)
    with pytest.raises(ValueError, match=message):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_speculators_maps_that_disagree_are_refused(target, tmp_path):
    _draft(target, "reduced_vocab").save_pretrained(tmp_path, format="speculators")
    st = load_file(tmp_path / "model.safetensors")
    st["t2d"][st["t2d"].nonzero()[0]] = False
    st["t2d"][0] = True  # a token d2t does not name
    save_file(st, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="d2t and t2d"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_drafters_written_with_the_earlier_vocabulary_layout_still_load(target, tmp_path):
    """Before the vLLM layout, the authors' format held ``draft_head.weight`` and absolute ``d2t`` ids."""
    draft = _draft(target, "reduced_vocab")
    draft.save_pretrained(tmp_path)
    st = load_file(tmp_path / "model.safetensors")
    old = {k: v for k, v in st.items() if k not in ("lm_head.weight", "d2t", "t2d")}
    old["draft_head.weight"], old["d2t"] = draft.draft_head.weight.detach(), draft.d2t
    save_file(old, tmp_path / "model.safetensors")
    back = DFlashDraftModel.from_pretrained(tmp_path, num_target_layers=4, vocab_size=VOCAB)
    assert torch.equal(back.d2t, draft.d2t) and torch.equal(back.draft_head.weight, draft.draft_head.weight)


def test_two_draft_vocabulary_sizes_are_refused(target, tmp_path):
    _draft(target, "reduced_vocab").save_pretrained(tmp_path)
    _edit(tmp_path, draft_vocab_size=len(KINDS["reduced_vocab"]["draft_vocab"]) + 1)
    with pytest.raises(ValueError, match="two different draft_vocab_size"):
        DFlashDraftModel.from_pretrained(tmp_path)
