"""Tiny random Hugging Face causal LMs of several families, built from configs (no downloads)."""

from __future__ import annotations

import torch
import transformers

VOCAB = 96

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=16)),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=None)),
    "gemma3": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        dict(
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        ),
    ),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(pad_token_id=0, bos_token_id=None, eos_token_id=None)),
}


def tiny_target(family: str, seed: int = 0, dtype=torch.float32, **overrides):
    config_cls, model_cls, extra = FAMILIES[family]
    config = config_cls(**{**_COMMON, **extra, **overrides})
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    model.generation_config.bos_token_id = None
    return model.to(dtype).eval()


def small_target(family: str, **overrides):
    """A two-layer ``tiny_target`` (Gemma3 keeps one sliding and one full layer)."""
    extra = {"layer_types": ["sliding_attention", "full_attention"]} if family == "gemma3" else {}
    return tiny_target(family, num_hidden_layers=2, **extra, **overrides)


def random_prompts(lengths, seed: int) -> list[list[int]]:
    """Prompts of the given lengths, token ids in ``[0, VOCAB - 2)`` (the last two ids stay free for pad / mask)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 2, (n,), generator=g).tolist() for n in lengths]
