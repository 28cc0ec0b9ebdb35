"""DFlash drafter configuration: the DFlash-specific fields of a published ``config.json``."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Mapping

_LAYER_TYPES = ("full_attention", "sliding_attention")


def _integer(name: str, value: Any) -> int:
    """``value`` if it is an integer (a JSON int, not a bool, a float or a string), else ``ValueError``: a config
    value is never truncated or parsed into one."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The DFlash authors' rule: ``round(1 + i * (N - 4) / (n - 1))`` for ``i < n``; ``[N // 2]`` for ``n == 1``.

    Raises ``ValueError`` when the rule leaves ``[0, N)`` (targets with fewer than 4 layers): pass
    ``target_layer_ids`` explicitly for those.
    """
    n, N = num_draft_layers, num_target_layers
    if n < 1 or N < 1:
        raise ValueError(f"need at least one draft and one target layer, got n={n}, N={N}")
    if n == 1:
        ids = (N // 2,)
    else:
        ids = tuple(int(round(1 + i * (N - 4) / (n - 1))) for i in range(n))
    if any(not 0 <= i < N for i in ids):
        raise ValueError(
            f"the default target_layer_ids rule gives {list(ids)} for a {N}-layer target and a {n}-layer "
            f"drafter, outside [0, {N}); pass target_layer_ids explicitly"
        )
    return ids


@dataclass(frozen=True)
class DFlashConfig:
    """DFlash-specific settings of a drafter.

    ``target_layer_ids[i]`` names the target decoder layer whose output (HF ``output_hidden_states[i + 1]``)
    is the i-th context feature. ``layer_types`` has one entry per drafter layer.
    """

    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    layer_types: tuple[str, ...]
    num_target_layers: int
    sliding_window: int | None = None
    # A reduced draft vocabulary: the drafter's own head scores these many target tokens (its ``d2t`` map says
    # which); None: the target's whole vocabulary through the target's own LM head.
    draft_vocab_size: int | None = None

    def __post_init__(self):
        # Normalise sequences (JSON lists) to tuples so the dataclass stays hashable and immutable.
        ids = tuple(_integer("target_layer_ids", i) for i in self.target_layer_ids)
        object.__setattr__(self, "target_layer_ids", ids)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if _integer("block_size", self.block_size) < 2:
            raise ValueError(f"block_size must be an int >= 2 (one bonus token + drafts), got {self.block_size!r}")
        if _integer("mask_token_id", self.mask_token_id) < 0:
            raise ValueError(f"mask_token_id must be a non-negative int, got {self.mask_token_id!r}")
        if _integer("num_target_layers", self.num_target_layers) < 1:
            raise ValueError(f"num_target_layers must be a positive int, got {self.num_target_layers!r}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one target layer")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ValueError(
                f"target_layer_ids {bad} are outside the target's layers [0, {self.num_target_layers})"
            )
        if not self.layer_types:
            raise ValueError("layer_types must have one entry per drafter layer")
        unknown = sorted(set(self.layer_types) - set(_LAYER_TYPES))
        if unknown:
            raise ValueError(f"unknown layer_types {unknown}; expected entries of {list(_LAYER_TYPES)}")
        if self.draft_vocab_size is not None and _integer("draft_vocab_size", self.draft_vocab_size) < 2:
            raise ValueError(f"draft_vocab_size must be an int >= 2, got {self.draft_vocab_size!r}")
        if "sliding_attention" in self.layer_types:
            if not isinstance(self.sliding_window, int) or self.sliding_window < 1:
                raise ValueError(
                    f"layer_types contain 'sliding_attention' but sliding_window is {self.sliding_window!r}"
                )

    @property
    def num_speculative_tokens(self) -> int:
        return self.block_size - 1

    @property
    def num_draft_layers(self) -> int:
        return len(self.layer_types)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> "DFlashConfig":
        """Parse the authors' ``config.json`` (``block_size`` at top level or inside ``dflash_config``)."""
        dflash = dict(config.get("dflash_config") or {})
        block_size = dflash.get("block_size", config.get("block_size"))
        if block_size is None:
            raise ValueError("config has no block_size (neither top-level nor in dflash_config)")
        for name in ("block_size", "draft_vocab_size"):
            if dflash.get(name, config.get(name)) != config.get(name, dflash.get(name)):
                raise ValueError(f"config has two different {name} values: {config[name]} (top level) "
                                 f"and {dflash[name]} (dflash_config)")
        mask_token_id = dflash.get("mask_token_id", config.get("mask_token_id"))
        if mask_token_id is None:
            raise ValueError("config has no mask_token_id (dflash_config.mask_token_id)")
        if "num_hidden_layers" not in config:
            raise ValueError("config has no num_hidden_layers")
        num_layers = _integer("num_hidden_layers", config["num_hidden_layers"])
        num_target_layers = config.get("num_target_layers")
        if num_target_layers is None:
            raise ValueError("config has no num_target_layers")
        layer_types = config.get("layer_types") or ["full_attention"] * num_layers
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} drafter layers")
        if dflash.get("causal", config.get("is_causal", False)):
            raise ValueError("the config says the drafter's attention is causal (dflash_config.causal / is_causal); "
                             "a DFlash block here is non-causal in every layer")
        window = config.get("sliding_window") if "sliding_attention" in layer_types else None
        swa = dflash.get("swa_window_size")
        if swa is not None and window is not None and swa != window:
            raise ValueError(f"two sliding windows: dflash_config.swa_window_size {swa}, sliding_window {window}")
        window = window if window is not None else (swa if "sliding_attention" in layer_types else None)
        target_layer_ids = dflash.get("target_layer_ids", config.get("target_layer_ids"))
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(_integer("num_target_layers", num_target_layers), num_layers)
        return cls(
            block_size=block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=tuple(target_layer_ids),
            layer_types=tuple(layer_types),
            num_target_layers=num_target_layers,
            sliding_window=window,
            draft_vocab_size=dflash.get("draft_vocab_size", config.get("draft_vocab_size")),
        )

    def to_dict(self) -> dict[str, Any]:
        """The DFlash fields in the authors' layout (merged into the drafter's ``config.json``)."""
        out: dict[str, Any] = {
            "block_size": self.block_size,
            "dflash_config": {
                "block_size": self.block_size,
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
                "causal": False,  # a block sees all of itself in every layer (vLLM reads sliding layers as causal
                                  # unless told)
            },
            "num_target_layers": self.num_target_layers,
            "layer_types": list(self.layer_types),
        }
        if self.sliding_window is not None:
            out["sliding_window"] = self.sliding_window
            out["dflash_config"]["swa_window_size"] = self.sliding_window  # where vLLM's DFlash looks first
        if self.draft_vocab_size is not None:
            out["dflash_config"]["draft_vocab_size"] = self.draft_vocab_size
            out["draft_vocab_size"] = self.draft_vocab_size  # where vLLM's DFlash reads it (not dflash_config)
        return out


def special_token_ids(tokenizer) -> set[int]:
    """Ids the tokenizer treats as special (its special tokens and every added token marked special): never
    produced by tokenizing ordinary text."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(t, "special", False):
            ids.add(int(i))
    return ids


def is_ordinary_token(tokenizer, token_id: int) -> bool:
    """Whether ``token_id`` is a token of ordinary text (not special): a mask token must not be one, or a draft
    block's mask positions look like text the target may really write there."""
    return token_id not in special_token_ids(tokenizer)


def choose_mask_token(tokenizer) -> int:
    """The drafter's mask token for a target's tokenizer: the tokenizer's own ``mask_token`` if it has one, else
    the highest-numbered special token that has no role (not bos/eos/pad/unk/sep/cls) and that the chat template
    does not use (SmolLM2: ``<empty_output>``, a Jupyter-output marker no chat contains). ``ValueError`` when
    there is none: add a mask token to the tokenizer (and resize the target's embeddings) first."""
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    roles = {getattr(tokenizer, f"{r}_token_id", None) for r in ("bos", "eos", "pad", "unk", "sep", "cls")}
    template = getattr(tokenizer, "chat_template", None) or ""
    free = []
    for i in sorted(special_token_ids(tokenizer) - roles):
        text = tokenizer.convert_ids_to_tokens(i)
        if text and text not in template and i < len(tokenizer):
            free.append(i)
    if not free:
        raise ValueError("the tokenizer has no mask token and no unused special token: add one "
                         "(tokenizer.add_special_tokens({'mask_token': '<|mask|>'}) and "
                         "target.resize_token_embeddings(len(tokenizer))) and pass its id as mask_token_id")
    return free[-1]
