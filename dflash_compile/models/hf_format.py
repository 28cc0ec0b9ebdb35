"""transformers' own DFlash assistant format (model type ``muse_glimmer_assistant``, transformers >= 5.24).

Same drafter math as the DFlash authors' checkpoints, different layout:

- weights: ``fc`` is ``encoder.fc``, ``hidden_norm`` is ``encoder.output_norm_enc``; ``norm`` and ``layers.N.*`` keep
  their names (``WEIGHT_NAMES``);
- config: ``block_size``, ``mask_token_id`` and ``target_layer_ids`` at the top level (no ``dflash_config``),
  ``rope_parameters``, ``layer_types``; ``sliding_window`` is one less than ours (an inclusive distance); fields
  absent from ``config.json`` take transformers' defaults (its config class parses them: that runs transformers'
  code, never code from the checkpoint).

The format records neither the target's vocabulary size nor its decoder-layer count, which this package checks a
drafter against; ``transformers_config`` writes them as two extra keys (``vocab_size``, ``num_target_layers``, which
transformers keeps and ignores) and ``DFlashDraftModel.from_pretrained`` takes them as keywords when a checkpoint
lacks them.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from transformers import MuseGlimmerAssistantConfig, Qwen3Config

from .config import DFlashConfig

MODEL_TYPE = "muse_glimmer_assistant"
ARCHITECTURE = "MuseGlimmerAssistantModel"
# Our weight name -> transformers' (every other weight has the same name in both formats).
WEIGHT_NAMES = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}
# Architecture fields that mean the same in transformers' assistant config and our drafter's Qwen3Config.
_SHARED_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "hidden_act",
    "attention_dropout",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)
# transformers' assistant recomputes these RoPE frequencies as the sequence grows (``dynamic_rope_update``); our
# drafter's rotary embedding is fixed at construction.
_GROWING_ROPE = ("dynamic", "longrope")


def is_transformers_format(raw: Mapping[str, Any]) -> bool:
    return raw.get("model_type") == MODEL_TYPE


def _check_rope(rope: Mapping[str, Any], where: str) -> None:
    kind = rope.get("rope_type", "default")
    if kind in _GROWING_ROPE:
        raise ValueError(
            f"{where}: rope_type {kind!r} rescales RoPE as the sequence grows in transformers' DFlash assistant, "
            "which this drafter does not; the two formats would disagree"
        )


def _check_window(block_size: int, window: int, where: str) -> None:
    """transformers' assistant shows a query the keys with ``|q - k| <= sliding_window`` (both sides); ours those
    with ``q - k < sliding_window`` (behind it; every key ahead of it in the block). The two agree, with
    transformers' ``sliding_window`` = ours - 1, as long as a whole block fits in the window."""
    if block_size > window:
        raise ValueError(
            f"{where}: a block of {block_size} tokens is wider than the sliding window of {window} positions; "
            "transformers' DFlash assistant hides keys on both sides of a query (|q - k| <= its sliding_window, "
            "which is ours - 1), ours only behind it, so inside such a block the two formats disagree"
        )


def authors_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A transformers-format ``config.json`` (as a dict) -> the same drafter's ``config.json`` in the authors' layout.

    Raises ``ValueError`` for what the authors' drafter cannot represent exactly (a block wider than the sliding
    window, growing RoPE types) and when ``vocab_size`` / ``num_target_layers`` are unknown.
    """
    arch = raw.get("architectures") or []
    if arch and ARCHITECTURE not in arch:
        raise ValueError(f"config.json has model_type {MODEL_TYPE!r} but describes {arch}, not a {ARCHITECTURE}")
    hf = MuseGlimmerAssistantConfig.from_dict(dict(raw))
    sliding = "sliding_attention" in hf.layer_types
    if sliding:
        _check_window(hf.block_size, hf.sliding_window + 1, "cannot load this transformers-format drafter")
    _check_rope(hf.rope_parameters, "cannot load this transformers-format drafter")
    for name in ("vocab_size", "num_target_layers"):
        if getattr(hf, name, None) is None:
            raise ValueError(
                f"this transformers-format config.json does not record {name} (the target's; transformers' format "
                f"has no such field): pass DFlashDraftModel.from_pretrained(path, {name}=...)"
            )
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        **{name: getattr(hf, name) for name in _SHARED_FIELDS},
        "rope_parameters": dict(hf.rope_parameters),
        "vocab_size": hf.vocab_size,
        "num_target_layers": hf.num_target_layers,
        "layer_types": list(hf.layer_types),
        "sliding_window": hf.sliding_window + 1 if sliding else None,
        "block_size": hf.block_size,
        "dflash_config": {
            "block_size": hf.block_size,
            "mask_token_id": hf.mask_token_id,
            "target_layer_ids": list(hf.target_layer_ids),
        },
    }


def transformers_config(
    config: Qwen3Config, dflash: DFlashConfig, dtype: torch.dtype | None = None
) -> MuseGlimmerAssistantConfig:
    """Our drafter's configuration as transformers' ``MuseGlimmerAssistantConfig`` (plus ``vocab_size`` and
    ``num_target_layers``, extra keys transformers keeps and ignores). Raises ``ValueError`` where the assistant
    would compute something else: a block wider than the sliding window, growing RoPE types."""
    window = {}  # transformers' default (unused) when no layer slides
    if "sliding_attention" in dflash.layer_types:
        _check_window(dflash.block_size, dflash.sliding_window, "cannot write this drafter in transformers' format")
        window = {"sliding_window": dflash.sliding_window - 1}
    _check_rope(config.rope_parameters, "cannot write this drafter in transformers' format")
    return MuseGlimmerAssistantConfig(
        architectures=[ARCHITECTURE],
        **{name: getattr(config, name) for name in _SHARED_FIELDS},
        rope_parameters=dict(config.rope_parameters),
        layer_types=list(dflash.layer_types),  # transformers' default would be all sliding_attention
        **window,
        block_size=dflash.block_size,
        mask_token_id=dflash.mask_token_id,
        target_layer_ids=list(dflash.target_layer_ids),
        vocab_size=config.vocab_size,
        num_target_layers=dflash.num_target_layers,
        dtype=dtype,
    )


def transformers_assistant(draft) -> torch.nn.Module:
    """``draft`` (a ``DFlashDraftModel``) rebuilt in memory as transformers' ``MuseGlimmerAssistantModel``, for
    ``target.generate(..., assistant_model=A, speculation_type="dflash")``. Same weights (copies), dtype and device;
    like ours, the assistant borrows the target's embeddings and LM head (transformers' loop passes them)."""
    from transformers import MuseGlimmerAssistantModel
    from transformers.models.muse_glimmer_assistant.modeling_muse_glimmer_assistant import (
        MuseGlimmerAssistantRotaryEmbedding,
    )

    ref = next(draft.parameters())
    config = transformers_config(draft.config, draft.dflash_config, ref.dtype)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        assistant = MuseGlimmerAssistantModel(config)
    assistant = assistant.to_empty(device=ref.device)
    assistant.rotary_emb = MuseGlimmerAssistantRotaryEmbedding(config).to(ref.device)  # non-persistent buffers
    state = {WEIGHT_NAMES.get(k, k): v for k, v in draft.state_dict().items()}
    assistant.load_state_dict(state, strict=True)
    return assistant.to(ref.dtype).eval()
