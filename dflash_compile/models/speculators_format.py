"""The ``speculators`` DFlash checkpoint format (``speculators_model_type: "dflash"``), which vLLM reads natively.

Same drafter math as the DFlash authors' layout; what differs:

- config: the drafter's Qwen3 architecture nested as ``transformer_layer_config`` (its ``vocab_size`` is the
  target's), DFlash fields at the top level: ``block_size``, ``mask_token_id``, ``aux_hidden_state_layer_ids``
  (hidden-state indices, i.e. the authors' ``target_layer_ids`` + 1), ``draft_vocab_size`` (the target's vocabulary
  size when the drafter scores all of it), ``sliding_window_non_causal`` (our drafter's blocks see each other in
  every layer: true), ``sample_from_anchor`` (false: the anchor is the bonus token and only the mask positions
  predict), ``target_hidden_size``, and a ``speculators_config`` (algorithm, greedy proposal of ``block_size - 1``
  tokens, the verifier's architectures);
- weights: ``layers.*``, ``fc``, ``hidden_norm``, ``norm`` as ours; a reduced draft vocabulary as
  :func:`vocab_map_weights` writes it (the authors' layout writes it the same way).

``DFlashDraftModel.from_pretrained`` reads it (``is_speculators_format``); ``save_pretrained(format="speculators")``
writes it. ``target_layer_ids`` are read back as ``aux_hidden_state_layer_ids - 1``; a 0 there (the embeddings'
output, which this drafter cannot read) is refused.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .config import DFlashConfig

MODEL_TYPE = "dflash"
ARCHITECTURE = "DFlashSpeculator"
_TOP_LEVEL = ("block_size", "mask_token_id", "aux_hidden_state_layer_ids", "draft_vocab_size")


def is_speculators_format(raw: Mapping[str, Any]) -> bool:
    return raw.get("speculators_model_type") == MODEL_TYPE


def speculators_config(config, dflash: DFlashConfig, verifier_architectures=()) -> dict[str, Any]:
    """The ``config.json`` of a drafter (its Qwen3 ``config`` and ``dflash`` fields) in the speculators layout."""
    layer = {k: v for k, v in config.to_dict().items()
             if k not in ("dflash_config", "target_layer_ids", "mask_token_id", "block_size", "num_target_layers",
                          "architectures", "draft_vocab_size", "transformers_version")}
    layer["model_type"] = "qwen3"
    if "sliding_attention" in dflash.layer_types:
        layer["use_sliding_window"] = True  # else Qwen3Config drops sliding_window
        layer["sliding_window"] = dflash.sliding_window
    V = config.vocab_size
    return {
        "speculators_model_type": MODEL_TYPE,
        "architectures": [ARCHITECTURE],
        "transformer_layer_config": layer,
        "block_size": dflash.block_size,
        "mask_token_id": dflash.mask_token_id,
        "aux_hidden_state_layer_ids": [i + 1 for i in dflash.target_layer_ids],
        "draft_vocab_size": dflash.draft_vocab_size or V,
        "target_hidden_size": config.hidden_size,
        "sliding_window_non_causal": True,
        "sample_from_anchor": False,
        "num_target_layers": dflash.num_target_layers,  # ours: speculators ignores it, we check a target against it
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": dflash.block_size - 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": None, "architectures": list(verifier_architectures)},
        },
    }


def authors_config_from_speculators(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A speculators ``config.json`` as the authors' layout this package parses (``DFlashConfig.from_dict``)."""
    missing = [k for k in (*_TOP_LEVEL, "transformer_layer_config") if raw.get(k) is None]
    if missing:
        raise ValueError(f"speculators DFlash config without {missing}")
    if raw.get("sample_from_anchor"):
        raise ValueError("sample_from_anchor=true (the anchor position predicts too) is not how this drafter drafts")
    layer = dict(raw["transformer_layer_config"])
    types = layer.get("layer_types") or ["full_attention"] * int(layer.get("num_hidden_layers", 0))
    if "sliding_attention" in types and not raw.get("sliding_window_non_causal"):
        raise ValueError("causal sliding-attention layers (sliding_window_non_causal=false) are not this drafter's "
                         "attention: its blocks are non-causal in every layer")
    aux = list(raw["aux_hidden_state_layer_ids"])
    if any(not isinstance(i, int) or i < 1 for i in aux):
        raise ValueError(f"aux_hidden_state_layer_ids {aux}: this drafter reads decoder-layer outputs (ids >= 1)")
    out = {k: v for k, v in layer.items() if k != "use_sliding_window"}
    if "sliding_attention" in types:
        out["sliding_window"] = layer.get("sliding_window")
    out["layer_types"] = types
    V = out.get("vocab_size")
    Vd = raw["draft_vocab_size"]
    dflash = {"block_size": raw["block_size"], "mask_token_id": raw["mask_token_id"],
              "target_layer_ids": [i - 1 for i in aux]}
    if V is None or Vd != V:
        dflash["draft_vocab_size"] = Vd
    out["dflash_config"] = dflash
    out["block_size"] = raw["block_size"]
    if raw.get("num_target_layers") is not None:
        out["num_target_layers"] = raw["num_target_layers"]
    out["architectures"] = ["DFlashDraftModel"]
    return out


def vocab_map_weights(state: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """Our state dict -> a checkpoint's tensors, a reduced draft vocabulary written as vLLM's loaders (DFlash,
    EAGLE-3, speculators) read it: ``lm_head.weight`` (the drafter's own head, our ``draft_head``), ``d2t`` (int64
    *offsets*: draft id ``i`` is target id ``i + d2t[i]``) and ``t2d`` (bool over the target's vocabulary: which
    tokens the drafter has). The draft ids are the selected target ids in ascending order (``t2d`` cannot say
    another order), so a drafter whose ``d2t`` is not ascending is written with its head rows sorted. A drafter
    that scores the whole vocabulary is written as it is."""
    out = {k: v for k, v in state.items() if k not in ("draft_head.weight", "d2t")}
    if "d2t" in state:
        ids, order = state["d2t"].sort()
        out["lm_head.weight"] = state["draft_head.weight"][order]
        out["d2t"] = ids - torch.arange(len(ids), dtype=ids.dtype)
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[ids] = True
        out["t2d"] = t2d
    return out


def weights_from_vocab_map(state: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors as :func:`vocab_map_weights` writes them -> our state dict; ``d2t`` and ``t2d`` must
    name the same tokens."""
    out = {k: v for k, v in state.items() if k not in ("lm_head.weight", "d2t", "t2d", "embed_tokens.weight",
                                                       "verifier_lm_head.weight", "verifier_norm.weight")}
    if "d2t" in state:
        if "t2d" not in state or "lm_head.weight" not in state:
            raise ValueError("a reduced draft vocabulary needs d2t, t2d and lm_head.weight together")
        ids = state["d2t"].to(torch.long) + torch.arange(len(state["d2t"]))
        t2d = state["t2d"].to(torch.bool)
        if t2d.shape != (vocab_size,) or int(t2d.sum()) != len(ids) or not bool(t2d[ids.clamp(0, vocab_size - 1)].all()):
            raise ValueError("d2t and t2d do not name the same target tokens")
        out["d2t"] = ids
        out["draft_head.weight"] = state["lm_head.weight"]
    return out
