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


# Targets beyond plain attention: hybrid linear-attention (Gated DeltaNet layers between full-attention ones), MLA,
# attention sinks with alternating windows and MoE, and every layer sliding without ``layer_types``.
_GDN = dict(
    head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
    linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"] * 2,
)
_MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)

ARCHITECTURES = {
    "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM, _GDN, "sdpa"),
    "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM, {**_GDN, **_MOE}, "sdpa"),
    "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM, {**_GDN, **_MOE}, "sdpa"),
    "deepseek_v3": (
        transformers.DeepseekV3Config,
        transformers.DeepseekV3ForCausalLM,
        dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
             v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
             moe_intermediate_size=32, first_k_dense_replace=1),
        "sdpa",
    ),
    "gpt_oss": (  # HF runs gpt-oss with eager attention only (sinks)
        transformers.GptOssConfig,
        transformers.GptOssForCausalLM,
        dict(intermediate_size=64, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
             layer_types=["sliding_attention", "full_attention"] * 2),
        "eager",
    ),
    "mistral_sliding": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=8), "sdpa"),
    # Layers that cache something else than attention K/V. LFM2: short-convolution layers (a conv window, no
    # recurrent state) between attention layers.
    "lfm2": (transformers.Lfm2Config, transformers.Lfm2ForCausalLM,
             dict(full_attn_idxs=[1, 3], conv_L_cache=3, block_ff_dim=128, block_auto_adjust_ff_dim=False), "sdpa"),
    # Falcon-H1: attention and a Mamba-2 mixer side by side in every layer (K/V and SSM states in one layer).
    "falcon_h1": (transformers.FalconH1Config, transformers.FalconH1ForCausalLM,
                  dict(head_dim=16, mamba_d_ssm=64, mamba_d_state=8, mamba_n_heads=4, mamba_d_head=16,
                       mamba_n_groups=1, mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=16), "sdpa"),
    # Zamba2: Mamba-2 layers, some of which also run a shared attention block (both in one layer).
    "zamba2": (transformers.Zamba2Config, transformers.Zamba2ForCausalLM,
               dict(layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], mamba_d_state=8, mamba_d_conv=4,
                    mamba_expand=1, mamba_ngroups=1, mamba_headdim=16, n_mamba_heads=4, num_mem_blocks=1,
                    attention_head_dim=16, chunk_size=16), "sdpa"),
    # Nemotron-H: interleaved Mamba-2, attention and MLP-only layers (a layer that caches nothing).
    "nemotron_h": (transformers.NemotronHConfig, transformers.NemotronHForCausalLM,
                   dict(layers_block_type=["mamba", "attention", "mamba", "mlp"], head_dim=16, mamba_num_heads=4,
                        mamba_head_dim=16, n_groups=1, ssm_state_size=8, conv_kernel=4, expand=1, chunk_size=16),
                   "sdpa"),
}


def tiny_target(family: str, seed: int = 0, dtype=torch.float32, **overrides):
    if family in ARCHITECTURES:
        config_cls, model_cls, extra, attn = ARCHITECTURES[family]
    else:
        (config_cls, model_cls, extra), attn = FAMILIES[family], "sdpa"
    config = config_cls(**{**_COMMON, **extra, **overrides})
    config._attn_implementation = attn
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    model.generation_config.bos_token_id = None
    if family == "gpt_oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0, 1, generator=torch.Generator().manual_seed(seed))  # non-zero sinks
    return model.to(dtype).eval()


def small_target(family: str, **overrides):
    """A two-layer ``tiny_target`` (Gemma3 keeps one sliding and one full layer)."""
    extra = {"layer_types": ["sliding_attention", "full_attention"]} if family == "gemma3" else {}
    return tiny_target(family, num_hidden_layers=2, **extra, **overrides)


def random_prompts(lengths, seed: int) -> list[list[int]]:
    """Prompts of the given lengths, token ids in ``[0, VOCAB - 2)`` (the last two ids stay free for pad / mask)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 2, (n,), generator=g).tolist() for n in lengths]
