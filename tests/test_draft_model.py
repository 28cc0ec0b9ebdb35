import json
import math

import pytest
import torch
from safetensors.torch import save_file

from dflash_compile import DFlashDraftModel
from dflash_compile.models.hidden_states import AuxHiddenStates
from tiny_models import VOCAB, tiny_target


# ----------------------------------------------------------------------------- fp64 transcription
def _rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    # x [S, heads, D], pos [S]
    D = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    ang = pos.to(torch.float64)[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :]
    rot = torch.cat([-x[..., D // 2 :], x[..., : D // 2]], -1)
    return x * cos + rot * sin


def reference_draft_logits(target, draft, prompt, block_ids, block_pos, ctx_len):
    """DESIGN §1 written out from the weights alone, batch 1, fp64: the block sees the first ``ctx_len`` context
    rows of ``prompt`` and itself; a sliding layer hides every key ``window`` or more positions behind the query."""
    sd = {k: v.to(torch.float64) for k, v in draft.state_dict().items()}
    cfg, dcfg = draft.config, draft.dflash_config
    eps, D, Hq, Hkv = cfg.rms_norm_eps, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    theta = cfg.rope_parameters["rope_theta"]
    hs = target(prompt, output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i + 1][0] for i in dcfg.target_layer_ids], -1)  # [S, n*H]
    ctx = _rms(feats @ sd["fc.weight"].T, sd["hidden_norm.weight"], eps)[:ctx_len]
    ctx_pos = torch.arange(ctx_len)
    embed = target.get_input_embeddings()
    h = embed(block_ids)[0].to(torch.float64)  # borrowed embedding (includes any family scaling)
    Q = h.shape[0]
    for l in range(cfg.num_hidden_layers):
        p = f"layers.{l}."
        W = lambda n: sd[p + n]  # noqa: E731
        x = _rms(h, W("input_layernorm.weight"), eps)
        q = _rope(_rms((x @ W("self_attn.q_proj.weight").T).view(Q, Hq, D), W("self_attn.q_norm.weight"), eps),
                  block_pos, theta)
        kb = _rope(_rms((x @ W("self_attn.k_proj.weight").T).view(Q, Hkv, D), W("self_attn.k_norm.weight"), eps),
                   block_pos, theta)
        vb = (x @ W("self_attn.v_proj.weight").T).view(Q, Hkv, D)
        S = ctx.shape[0]
        kc = _rope(_rms((ctx @ W("self_attn.k_proj.weight").T).view(S, Hkv, D), W("self_attn.k_norm.weight"), eps),
                   ctx_pos, theta)
        vc = (ctx @ W("self_attn.v_proj.weight").T).view(S, Hkv, D)
        K, V = torch.cat([kc, kb]), torch.cat([vc, vb])
        key_pos = torch.cat([ctx_pos, block_pos])
        window = dcfg.sliding_window if dcfg.layer_types[l] == "sliding_attention" else None
        # non-causal: every block row sees all kept context and the whole block, unless the window hides it
        hidden = block_pos[:, None] - key_pos[None, :] >= window if window else torch.zeros(Q, len(key_pos), dtype=bool)
        heads = []
        for hq in range(Hq):
            g = hq // (Hq // Hkv)
            scores = (q[:, hq] @ K[:, g].T / math.sqrt(D)).masked_fill(hidden, -math.inf)
            heads.append(torch.softmax(scores, -1) @ V[:, g])
        h = h + torch.cat(heads, -1) @ W("self_attn.o_proj.weight").T
        x = _rms(h, W("post_attention_layernorm.weight"), eps)
        gate, up = x @ W("mlp.gate_proj.weight").T, x @ W("mlp.up_proj.weight").T
        h = h + (gate * torch.sigmoid(gate) * up) @ W("mlp.down_proj.weight").T
    head = target.get_output_embeddings().weight.to(torch.float64)
    return (_rms(h, sd["norm.weight"], eps) @ head.T)[1:]


@pytest.mark.parametrize("family,num_kv", [("qwen3", 2), ("llama", 4), ("gemma3", 1)])
@torch.no_grad()
def test_draft_forward_matches_fp64_transcription(family, num_kv):
    # Two rows in one batch: one sees 7 of the 11 context rows it is handed (the rest hold real values that must stay
    # hidden), one sees all 11; the second drafter layer slides with a window shorter than the block.
    target = tiny_target(family, dtype=torch.float64, num_key_value_heads=num_kv)
    draft = DFlashDraftModel.from_target(target, num_layers=2, block_size=5, target_layer_ids=[0, 3], seed=1,
                                         layer_types=["full_attention", "sliding_attention"], sliding_window=4)
    for p in draft.parameters():  # non-trivial norm weights so a skipped norm would show
        if p.dim() == 1:
            p.uniform_(0.5, 1.5)
        else:  # and weights large enough that attention, hence every mask, matters
            p.mul_(10)
    prompts = torch.randint(0, VOCAB, (2, 11))
    ctx_lens = torch.tensor([7, 11])
    block = torch.tensor([[7] + [draft.mask_token_id] * 4, [3] + [draft.mask_token_id] * 4])
    block_pos = ctx_lens[:, None] + torch.arange(5)
    aux = AuxHiddenStates(target, draft.dflash_config.target_layer_ids)
    target(prompts)
    feats = aux.read()
    aux.remove()
    k, v = draft.context_kv(draft.context_features(feats), torch.arange(11).expand(2, 11))
    got = draft(block, block_pos, k, v, ctx_lens)
    assert got.dtype == torch.float64 and got.shape == (2, 4, VOCAB)
    for row in range(2):
        ref = reference_draft_logits(target, draft, prompts[row:row + 1], block[row:row + 1], block_pos[row],
                                     int(ctx_lens[row]))
        assert (got[row] - ref).abs().max().item() <= 1e-9, row
    # the compiled step's form: each layer gathers its context K/V from a paged pool inside the layer
    L, _, S, Hkv, D = k.shape
    slots = torch.randperm(40)[:2 * S].view(2, S)  # each row's context at scattered slots of a 40-slot pool
    pool = torch.randn(L, 2, 40, Hkv, D, dtype=torch.float64)  # the unused slots hold values that must not leak
    pool[:, 0, slots], pool[:, 1, slots] = k, v
    paged = draft(block, block_pos, ctx_lens=ctx_lens, pool=pool, read=slots)
    assert (paged - got).abs().max().item() <= 1e-12
    for wrong in (dict(ctx_k=k, ctx_v=v, pool=pool, read=slots), dict(pool=pool), dict(ctx_k=k, pool=pool, read=slots)):
        with pytest.raises(ValueError, match="ctx_lens and its context as ctx_k and ctx_v, or as pool and read"):
            draft(block, block_pos, ctx_lens=ctx_lens, **wrong)
    with pytest.raises(ValueError, match="ctx_lens"):
        draft(block, block_pos, pool=pool, read=slots)


def test_borrows_target_modules():
    target = tiny_target("qwen3")
    draft = DFlashDraftModel.from_target(target, seed=0)
    assert draft.embed_tokens is target.get_input_embeddings()
    assert draft.lm_head is target.get_output_embeddings()
    assert not any("embed" in k or "lm_head" in k for k in draft.state_dict())
    assert draft.mask_token_id == VOCAB - 1


def test_from_target_seed_is_reproducible():
    target = tiny_target("llama")
    a = DFlashDraftModel.from_target(target, seed=3).state_dict()
    b = DFlashDraftModel.from_target(target, seed=3).state_dict()
    c = DFlashDraftModel.from_target(target, seed=4).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["fc.weight"], c["fc.weight"])


def test_unbound_draft_is_a_clear_error(tmp_path):
    target = tiny_target("qwen3")
    DFlashDraftModel.from_target(target, seed=0).save_pretrained(tmp_path)
    draft = DFlashDraftModel.from_pretrained(tmp_path)
    with pytest.raises(RuntimeError, match="bind_target"):
        draft.lm_head


# ----------------------------------------------------------------------------- checkpoint format
def test_save_load_roundtrip(tmp_path):
    target = tiny_target("qwen3")
    draft = DFlashDraftModel.from_target(target, num_layers=3, block_size=6, target_layer_ids=[0, 2, 3], seed=0)
    draft.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["block_size"] == 6
    assert raw["dflash_config"]["target_layer_ids"] == [0, 2, 3]
    loaded = DFlashDraftModel.from_pretrained(tmp_path)
    assert loaded.dflash_config == draft.dflash_config
    sd, ld = draft.state_dict(), loaded.state_dict()
    assert sd.keys() == ld.keys() and all(torch.equal(sd[k], ld[k]) for k in sd)
    assert torch.equal(loaded.rotary_emb.inv_freq, draft.rotary_emb.inv_freq)


def _published_weights(L, H, Hq, Hkv, D, I, n_ids):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g) * 0.02  # noqa: E731
    w = {"fc.weight": r(H, n_ids * H), "hidden_norm.weight": torch.ones(H), "norm.weight": torch.ones(H)}
    for i in range(L):
        p = f"layers.{i}."
        w |= {
            p + "input_layernorm.weight": torch.ones(H),
            p + "post_attention_layernorm.weight": torch.ones(H),
            p + "self_attn.q_proj.weight": r(Hq * D, H),
            p + "self_attn.k_proj.weight": r(Hkv * D, H),
            p + "self_attn.v_proj.weight": r(Hkv * D, H),
            p + "self_attn.o_proj.weight": r(H, Hq * D),
            p + "self_attn.q_norm.weight": torch.ones(D),
            p + "self_attn.k_norm.weight": torch.ones(D),
            p + "mlp.gate_proj.weight": r(I, H),
            p + "mlp.up_proj.weight": r(I, H),
            p + "mlp.down_proj.weight": r(H, I),
        }
    return w


def _write_published(path, nested: bool, weights=None, **over):
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": 64, "num_hidden_layers": 2, "head_dim": 16, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 96, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
        "vocab_size": VOCAB, "max_position_embeddings": 512, "num_target_layers": 4,
        "layer_types": ["full_attention", "full_attention"],
        "dflash_config": {"mask_token_id": VOCAB - 1, "target_layer_ids": [1, 3]},
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},  # must be ignored, never executed
    }
    if nested:
        cfg["dflash_config"]["block_size"] = 16
    else:
        cfg["block_size"] = 16
    cfg.update(over)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "dflash.py").write_text("raise SystemExit('checkpoint code must never run')\n")
    save_file(weights if weights is not None else _published_weights(2, 64, 4, 2, 16, 96, 2),
              str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("nested", [False, True])
def test_loads_authors_format(tmp_path, nested):
    draft = DFlashDraftModel.from_pretrained(_write_published(tmp_path, nested))
    assert draft.block_size == 16 and draft.dflash_config.target_layer_ids == (1, 3)
    assert draft.config.rope_parameters["rope_theta"] == 1000000
    assert torch.equal(draft.fc.weight, _published_weights(2, 64, 4, 2, 16, 96, 2)["fc.weight"])
    target = tiny_target("qwen3")
    from dflash_compile import DFlashSpecWrapper

    out = DFlashSpecWrapper(target, draft).generate(torch.tensor([[1, 2, 3]]), max_new_tokens=5)
    assert out.shape == (1, 8)


def test_sharded_weights_load(tmp_path):
    w = _published_weights(2, 64, 4, 2, 16, 96, 2)
    path = _write_published(tmp_path, False)
    (path / "model.safetensors").unlink()
    keys = sorted(w)
    save_file({k: w[k] for k in keys[::2]}, str(path / "model-00001-of-00002.safetensors"))
    save_file({k: w[k] for k in keys[1::2]}, str(path / "model-00002-of-00002.safetensors"))
    assert torch.equal(DFlashDraftModel.from_pretrained(path).fc.weight, w["fc.weight"])


def test_dtype_argument(tmp_path):
    draft = DFlashDraftModel.from_pretrained(_write_published(tmp_path, False), dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in draft.parameters())


def _malformed(kind):
    w = _published_weights(2, 64, 4, 2, 16, 96, 2)
    if kind == "missing":
        del w["layers.1.mlp.up_proj.weight"]
        return w, r"missing weights \['layers.1.mlp.up_proj.weight'\]"
    if kind == "extra":
        w["layers.2.mlp.up_proj.weight"] = torch.zeros(96, 64)
        return w, r"unexpected weights \['layers.2.mlp.up_proj.weight'\]"
    w["fc.weight"] = torch.zeros(64, 3 * 64)
    return w, r"wrong shapes \[fc.weight: checkpoint \(64, 192\), expected \(64, 128\)\]"


@pytest.mark.parametrize("kind", ["missing", "extra", "shape"])
def test_malformed_checkpoint_names_the_problem(tmp_path, kind):
    weights, match = _malformed(kind)
    with pytest.raises(ValueError, match=match):
        DFlashDraftModel.from_pretrained(_write_published(tmp_path, False, weights=weights))


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        DFlashDraftModel.from_pretrained(tmp_path)
    _write_published(tmp_path, False)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_missing_block_size(tmp_path):
    path = _write_published(tmp_path, False)
    raw = json.loads((path / "config.json").read_text())
    del raw["block_size"]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="no block_size"):
        DFlashDraftModel.from_pretrained(path)


# ----------------------------------------------------------------------------- the mask token
def test_mask_token_is_never_ordinary_text():
    from transformers import AutoTokenizer

    from dflash_compile.assets import tiny_pair_paths
    from dflash_compile.models.config import choose_mask_token, is_ordinary_token

    tok = AutoTokenizer.from_pretrained(tiny_pair_paths()[0])
    target = tiny_target("qwen3", vocab_size=len(tok))
    mask = tok.convert_tokens_to_ids("<|mask|>")
    assert DFlashDraftModel.from_target(target, tokenizer=tok).mask_token_id == mask == tok.mask_token_id
    # without a declared mask token: an added special token with no role (bos/eos/pad) that no template uses
    tok.mask_token = None
    assert choose_mask_token(tok) == mask and not is_ordinary_token(tok, mask)
    plain = tok("def f(x):\n    return x")["input_ids"][1]
    assert is_ordinary_token(tok, plain)
    with pytest.raises(ValueError, match="ordinary text token"):
        DFlashDraftModel.from_target(target, mask_token_id=plain, tokenizer=tok)
    with pytest.warns(UserWarning, match="may be an ordinary text token"):
        assert DFlashDraftModel.from_target(target).mask_token_id == len(tok) - 1
    # a tokenizer whose every special token has a role: nothing to choose, and the error says what to do
    tok.add_special_tokens({"pad_token": "<|mask|>", "sep_token": "<|pad|>"})
    with pytest.raises(ValueError, match="add_special_tokens"):
        choose_mask_token(tok)
