"""A drafter's construction and checkpoints: ``from_target`` (a random drafter sized from a target), ``load`` and
``save`` in the three formats (the DFlash authors', transformers' own DFlash assistant, the speculators one; see
docs/checkpoints.md). Reads only JSON and safetensors: nothing from a checkpoint directory is ever executed."""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import Qwen3Config

from .config import DFlashConfig, _integer, choose_mask_token, default_target_layer_ids, is_ordinary_token
from .hf_format import WEIGHT_NAMES, authors_config, is_transformers_format, transformers_config
from .speculators_format import (
    authors_config_from_speculators, is_speculators_format, speculators_config, vocab_map_weights,
    weights_from_vocab_map,
)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
_POSITIVE_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                   "intermediate_size", "vocab_size")


# ------------------------------------------------------------------------------------------------ from a target
def from_target(cls, target: nn.Module, num_layers: int, block_size: int, mask_token_id: int | None,
                target_layer_ids, seed: int | None, tokenizer, draft_vocab, overrides: dict[str, Any]):
    """``DFlashDraftModel.from_target`` (its docstring)."""
    tcfg = target.config.get_text_config()
    num_target_layers = _positive_int(tcfg, "num_hidden_layers")
    if num_target_layers is None:
        from .hidden_states import decoder_layers

        num_target_layers = len(decoder_layers(target))
    overrides = dict(overrides)
    layer_types = overrides.pop("layer_types", ["full_attention"] * num_layers)
    sliding_window = overrides.pop("sliding_window", None)
    config = Qwen3Config(**{**_arch_from_target(tcfg, num_layers, layer_types, sliding_window), **overrides})
    dflash = DFlashConfig(
        block_size=block_size,
        mask_token_id=_mask_token(tcfg.vocab_size, mask_token_id, tokenizer),
        target_layer_ids=tuple(
            default_target_layer_ids(num_target_layers, num_layers) if target_layer_ids is None else target_layer_ids
        ),
        layer_types=tuple(layer_types),
        num_target_layers=num_target_layers,
        sliding_window=sliding_window,
        draft_vocab_size=None if draft_vocab is None else len(draft_vocab),
    )
    with torch.random.fork_rng(devices=[], enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        model = cls(config, dflash)
        model.reset_parameters()
    ref = next(target.parameters())
    model = model.to(dtype=ref.dtype, device=ref.device).bind_target(target)
    if draft_vocab is not None:
        model.set_draft_vocab(draft_vocab, target)
    return model


def _arch_from_target(tcfg, num_layers: int, layer_types, sliding_window) -> dict:
    """The drafter's Qwen3 fields. Hidden size and vocabulary are the target's (the drafter reads its hidden states
    and shares its vocabulary); the rest follows the target's where the target has one value (a trained drafter
    usually does), else a plain one: targets without attention heads (Mamba, RWKV) or a single MLP width."""
    hidden = tcfg.hidden_size
    heads = _positive_int(tcfg, "num_attention_heads") or max(1, hidden // 64)
    kv_heads = _positive_int(tcfg, "num_key_value_heads") or heads
    if heads % kv_heads:
        kv_heads = heads
    return dict(
        vocab_size=tcfg.vocab_size,
        hidden_size=hidden,
        intermediate_size=_positive_int(tcfg, "intermediate_size") or 4 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=_positive_int(tcfg, "head_dim") or hidden // heads,
        rms_norm_eps=getattr(tcfg, "rms_norm_eps", None) or 1e-6,
        max_position_embeddings=_positive_int(tcfg, "max_position_embeddings") or 32768,
        rope_parameters=_full_attention_rope(tcfg),
        layer_types=list(layer_types),
        sliding_window=sliding_window,
        use_sliding_window=sliding_window is not None,
    )


# ------------------------------------------------------------------------------------------------ load
def load(cls, path, dtype, device, num_target_layers: int | None, vocab_size: int | None):
    """``DFlashDraftModel.from_pretrained`` (its docstring)."""
    path = Path(path)
    config, dflash, names, speculators = _read_config(path, num_target_layers, vocab_size)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    with torch.device("meta"):
        model = cls(config, dflash)
    expected = {names.get(k, k): v.shape for k, v in model.state_dict().items()}
    # A reduced draft vocabulary as vLLM reads it (lm_head, d2t offsets, t2d: speculators_format.vocab_map_weights);
    # authors-format drafters written before this layout hold draft_head and absolute d2t ids, read as they are.
    header = _headers(path, files)
    vocab_map = dflash.draft_vocab_size is not None and (speculators or "draft_head.weight" not in header)
    if vocab_map:
        expected["lm_head.weight"] = expected.pop("draft_head.weight")
        expected["t2d"] = torch.Size([config.vocab_size])
    _check_headers(path, header, expected, vocab_map)
    state = _read_weights(path, files, vocab_map, config.vocab_size)
    model = model.to_empty(device=device or "cpu")
    ours = {v: k for k, v in names.items()}
    model.load_state_dict({ours.get(k, k): v for k, v in state.items()}, strict=True)
    model.rotary_emb = type(model.rotary_emb)(config).to(device=device or "cpu")  # buffers were on meta
    if dflash.draft_vocab_size is not None:
        try:
            model.set_draft_vocab(model.d2t.clone())
        except ValueError as e:
            raise ValueError(f"malformed DFlash checkpoint {path}: its d2t map: {e}") from None
    return model.to(dtype=dtype) if dtype is not None else model


def _read_config(path: Path, num_target_layers, vocab_size):
    """``(Qwen3Config, DFlashConfig, {our weight name: the checkpoint's}, speculators format?)`` of ``path``."""
    cfg_file = path / CONFIG_NAME
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no {CONFIG_NAME} in {path}")
    raw = _with_target_facts(json.loads(cfg_file.read_text()), num_target_layers=num_target_layers,
                             vocab_size=vocab_size)
    names = {}  # our weight name -> the checkpoint's
    speculators = is_speculators_format(raw)
    if is_transformers_format(raw):
        raw, names = authors_config(raw), WEIGHT_NAMES
    elif speculators:
        try:
            raw = authors_config_from_speculators(raw)
        except ValueError as e:
            raise ValueError(f"{cfg_file}: {e}") from None
        raw = _with_target_facts(raw, num_target_layers=num_target_layers, vocab_size=vocab_size)
    arch = raw.get("architectures") or []
    if arch and "DFlashDraftModel" not in arch:
        raise ValueError(f"{cfg_file} describes {arch}, not a DFlashDraftModel")
    try:
        dflash = DFlashConfig.from_dict(raw)
        config = _qwen3_config(raw, dflash)
    except ValueError as e:
        raise ValueError(f"{cfg_file}: {e}") from None
    return config, dflash, names, speculators


def _headers(path: Path, files) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """Each weight's (file, shape, dtype) from the files' headers (nothing is read into memory)."""
    header: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    for f in files:
        with _safetensors(f) as st:
            for key in st.keys():
                if key in header:
                    raise ValueError(f"weight {key!r} appears in more than one file of {path}")
                tensor = st.get_slice(key)
                header[key] = (f, tuple(tensor.get_shape()), tensor.get_dtype())
    return header


def _check_headers(path: Path, header: dict, expected: dict, vocab_map: bool) -> None:
    """Names, shapes and dtypes from the files' headers: nothing is read into memory before they check out."""
    missing = sorted(set(expected) - set(header))
    unexpected = sorted(set(header) - set(expected))
    wrong = sorted(
        f"{k}: checkpoint {header[k][1]}, expected {tuple(expected[k])}"
        for k in set(header) & set(expected)
        if header[k][1] != tuple(expected[k])
    )
    not_float = sorted(
        f"{f.name}: {k!r} is {dt}" for k, (f, _, dt) in header.items()
        if not dt.startswith(("F", "BF")) and not (k == "d2t" and dt.startswith("I"))
        and not (vocab_map and k == "t2d" and dt == "BOOL")
    )
    problems = []
    if missing:
        problems.append(f"missing weights {missing}")
    if unexpected:
        problems.append(f"unexpected weights {unexpected}")
    if wrong:
        problems.append(f"wrong shapes [{'; '.join(wrong)}]")
    if not_float:
        problems.append(f"weights that are not floating point [{'; '.join(not_float)}]")
    if problems:
        raise ValueError(f"malformed DFlash checkpoint {path}: " + ", ".join(problems))


def _read_weights(path: Path, files, vocab_map: bool, vocab_size: int) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in files:
        with _safetensors(f) as st:
            for key in st.keys():
                state[key] = st.get_tensor(key)
                if not bool(torch.isfinite(state[key]).all()):
                    raise ValueError(f"malformed DFlash checkpoint: {f}: weight {key!r} has non-finite values")
    if vocab_map:
        try:
            state = weights_from_vocab_map(state, vocab_size)
        except ValueError as e:
            raise ValueError(f"malformed DFlash checkpoint {path}: {e}") from None
    return state


# ------------------------------------------------------------------------------------------------ save
def save(model, path, format: str) -> None:
    """``DFlashDraftModel.save_pretrained`` (its docstring)."""
    from safetensors.torch import save_file

    if model.split_over is not None:
        raise ValueError(f"this drafter is split over {model.split_over[1]} ranks and holds one rank's share of "
                         f"each layer: save the drafter before a tensor-parallel wrapper splits it")
    if format not in ("dflash", "transformers", "speculators"):
        raise ValueError(f"unknown checkpoint format {format!r}: expected 'dflash', 'transformers' or 'speculators'")
    if format == "transformers" and model.draft_vocab_size is not None:
        raise ValueError("transformers' DFlash assistant format has no reduced draft vocabulary: save this "
                         "drafter with format='dflash'")
    names = WEIGHT_NAMES if format == "transformers" else {}  # our weight name -> the checkpoint's
    cfg = _config_for(model, format)  # refuses what the format cannot say before anything is written
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_NAME).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    state = {names.get(k, k): v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if format != "transformers":  # (which has no reduced vocabulary)
        state = {k: v.contiguous() for k, v in vocab_map_weights(state, model.config.vocab_size).items()}
    save_file(state, str(path / WEIGHTS_NAME), metadata={"format": "pt"})


def _config_for(model, format: str) -> dict:
    if format == "transformers":
        return transformers_config(model.config, model.dflash_config, next(model.parameters()).dtype).to_dict()
    if format == "speculators":
        return speculators_config(model.config, model.dflash_config)
    cfg = model.config.to_dict()
    for k in ("dflash_config", "target_layer_ids", "mask_token_id"):
        cfg.pop(k, None)
    cfg.update(model.dflash_config.to_dict())
    # transformers' Qwen3Config keeps sliding_window only with use_sliding_window (else it reads None, and so would
    # the authors' class and vLLM): the window must mean the same to every reader
    cfg["use_sliding_window"] = "sliding_attention" in model.dflash_config.layer_types
    cfg["architectures"] = ["DFlashDraftModel"]
    cfg["model_type"] = "qwen3"
    rope = cfg.get("rope_parameters") or {}  # also the legacy flat rope_theta that published checkpoints carry
    if "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    return cfg


# ------------------------------------------------------------------------------------------------ helpers
def _with_target_facts(raw: dict, **facts: int | None) -> dict:
    """``raw`` with the given target facts (``num_target_layers``, ``vocab_size``) filled in where it lacks them."""
    for name, value in facts.items():
        if value is None:
            continue
        if raw.get(name) is not None and raw[name] != value:
            raise ValueError(f"{name}={value} was passed, but the checkpoint's config.json says {raw[name]}")
        raw = {**raw, name: value}
    return raw


def _mask_token(vocab_size: int, mask_token_id: int | None, tokenizer) -> int:
    """``from_target``'s mask token rule (its docstring)."""
    if mask_token_id is None and tokenizer is not None:
        return choose_mask_token(tokenizer)
    if mask_token_id is None:
        warnings.warn(f"no mask_token_id and no tokenizer: the drafter's mask token is the last id, {vocab_size - 1}, "
                      f"which may be an ordinary text token; pass tokenizer= to choose a special one",
                      stacklevel=3)
        return vocab_size - 1
    if tokenizer is not None and is_ordinary_token(tokenizer, mask_token_id):
        raise ValueError(f"mask_token_id {mask_token_id} ({tokenizer.convert_ids_to_tokens(mask_token_id)!r}) is an "
                         f"ordinary text token of this tokenizer; use a special token "
                         f"(config.choose_mask_token(tokenizer) gives {choose_mask_token(tokenizer)})")
    return mask_token_id


@contextlib.contextmanager
def _safetensors(f: Path):
    """``safe_open(f)``; a file it cannot read (truncated, not safetensors) is a ``ValueError`` naming ``f``."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(f), framework="pt") as st:
            yield st
    except (SafetensorError, OSError) as e:
        raise ValueError(f"cannot read {f} (truncated or not a safetensors file?): {e}") from None


def _positive_int(cfg, name: str) -> int | None:
    """``cfg.name`` when it is one positive integer (not None, not a per-layer list), else None."""
    value = getattr(cfg, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _full_attention_rope(tcfg) -> dict:
    """The drafter's rotary embedding: the target's full-attention one where it has one, else RoPE with theta 1e4."""
    default = {"rope_type": "default", "rope_theta": 10000.0}
    rope = getattr(tcfg, "rope_parameters", None) or default
    if isinstance(rope.get("full_attention"), dict):  # per-layer-type (Gemma3)
        rope = rope["full_attention"]
    elif rope and all(isinstance(v, dict) for v in rope.values()):  # per layer type, with no full_attention entry
        rope = default
    rope = dict(rope)
    if rope.get("rope_type", "default") == "default" and not isinstance(rope.get("rope_theta"), (int, float)):
        rope["rope_theta"] = 10000.0
    return rope


def _qwen3_config(raw: dict, dflash: DFlashConfig) -> Qwen3Config:
    fields = {k: v for k, v in raw.items() if k not in ("dflash_config", "architectures", "auto_map", "model_type")}
    fields["layer_types"] = list(dflash.layer_types)
    # the drafter's own window, as transformers' Qwen3Config keeps it (only with use_sliding_window)
    fields["use_sliding_window"] = dflash.sliding_window is not None
    fields["sliding_window"] = dflash.sliding_window
    if fields.get("rope_parameters") is None:
        fields["rope_parameters"] = {
            "rope_type": (raw.get("rope_scaling") or {}).get("rope_type", "default"),
            **(raw.get("rope_scaling") or {}),
            "rope_theta": raw.get("rope_theta", 10000.0),
        }
    fields.pop("rope_scaling", None)
    fields.pop("rope_theta", None)
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if name not in fields:
            raise ValueError(f"config.json has no {name}")
    for name in _POSITIVE_SIZES:
        if fields.get(name) is not None and _integer(name, fields[name]) < 1:
            raise ValueError(f"{name} must be a positive integer, got {fields[name]!r}")
    for name, value in (("rms_norm_eps", fields.get("rms_norm_eps", 1e-6)),
                        ("rope_theta", fields["rope_parameters"].get("rope_theta"))):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    if fields.get("head_dim") is None:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    if fields.get("num_key_value_heads") is None:
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    return Qwen3Config(**fields)


def narrow_draft_vocab(model, keep):
    """A copy of ``model`` (a drafter with a reduced draft vocabulary) whose head keeps only the target ids ``keep``,
    each of which must be in its draft vocabulary: the same logits for those tokens, the others never drafted. The
    copy is unbound (``bind_target``) and on ``model``'s device and dtype."""
    import dataclasses

    if model.draft_vocab_size is None:
        raise ValueError("the drafter drafts over the target's whole vocabulary: nothing to narrow")
    keep = torch.as_tensor(keep, dtype=torch.long)
    where = {int(t): i for i, t in enumerate(model.d2t.tolist())}
    missing = [int(t) for t in keep.tolist() if int(t) not in where]
    if missing or keep.unique().numel() != keep.numel():
        raise ValueError(f"keep must be distinct ids of the drafter's vocabulary; not in it: {missing[:5]}")
    rows = torch.tensor([where[int(t)] for t in keep.tolist()], dtype=torch.long)
    narrow = type(model)(model.config, dataclasses.replace(model.dflash_config, draft_vocab_size=len(keep)))
    state = {k: v for k, v in model.state_dict().items() if k not in ("draft_head.weight", "d2t")}
    state["draft_head.weight"] = model.draft_head.weight.detach()[rows.to(model.d2t.device)]
    state["d2t"] = keep.to(model.d2t.device)
    p = next(model.parameters())
    narrow = narrow.to(device=p.device, dtype=p.dtype)
    narrow.load_state_dict(state, strict=True)
    narrow.set_draft_vocab(keep)
    return narrow
