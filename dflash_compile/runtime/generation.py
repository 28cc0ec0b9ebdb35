"""Host side of generation: argument resolution (HF semantics), output objects, statistics."""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class DFlashStats:
    """Speculation counters (vLLM names) and the ``K`` of every step (``step_ks``; a step at ``K = 0`` verified no
    draft: plain decoding). ``num_drafts`` counts the steps that verified drafts, ``acceptance_length`` = 1 +
    accepted / drafts over those steps."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    step_ks: list[int] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def num_steps(self) -> int:
        return len(self.step_ks)

    def record(self, num_speculative_tokens: int, num_accepted: int) -> None:
        """One step that verified ``num_speculative_tokens`` drafts and accepted ``num_accepted`` of them."""
        K = num_speculative_tokens
        self.step_ks.append(K)
        if K == 0:
            return
        self.num_accepted_tokens_per_pos += [0] * (K - len(self.num_accepted_tokens_per_pos))
        self.num_drafts += 1
        self.num_draft_tokens += K
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.num_accepted_tokens_per_pos[i] += 1

    @classmethod
    def total(cls, parts: list["DFlashStats"], num_speculative_tokens: int) -> "DFlashStats":
        """The counters of ``parts`` summed (``num_accepted_tokens_per_pos`` over ``num_speculative_tokens``
        positions at least; ``step_ks`` concatenated)."""
        out = cls(num_accepted_tokens_per_pos=[0] * num_speculative_tokens)
        for p in parts:
            out.num_drafts += p.num_drafts
            out.num_draft_tokens += p.num_draft_tokens
            out.num_accepted_tokens += p.num_accepted_tokens
            out.step_ks += p.step_ks
            out.num_accepted_tokens_per_pos += [0] * (len(p.num_accepted_tokens_per_pos)
                                                      - len(out.num_accepted_tokens_per_pos))
            for i, n in enumerate(p.num_accepted_tokens_per_pos):
                out.num_accepted_tokens_per_pos[i] += n
        return out


@dataclass
class DFlashGenerateOutput:
    """What ``generate(..., return_dict_in_generate=True)`` returns.

    ``sequences [B, L + new]`` (prompt included, finished rows padded with ``pad_token_id``); the counters
    are whole-batch totals, ``per_request`` has the same counters for each row, ``finish_reasons`` is
    ``"stop"`` (an eos token or a stop string) or ``"length"`` (``max_new_tokens`` or capacity) per row.
    ``drafts`` (only with ``generate(..., output_drafts=True)``, else None): per row, the ``K`` drafts the target
    verified at each step, in order; with ``sequences`` they determine every step's acceptance, so drafting can be
    checked, not only the (lossless) output. ``step_ks``: per row, the ``K`` of each of its steps (also
    ``per_request[i].step_ks``).
    """

    sequences: torch.Tensor
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: list[int]
    acceptance_length: float
    per_request: list[DFlashStats]
    finish_reasons: list[str]
    num_new_tokens: list[int] = field(default_factory=list)  # generated tokens per row (before end padding)
    prompt_width: int = 0  # sequences[:, :prompt_width] is the (left-padded) prompt
    drafts: list[list[list[int]]] | None = None
    step_ks: list[list[int]] = field(default_factory=list)

    @classmethod
    def build(cls, sequences, per_request, finish_reasons, num_speculative_tokens, num_new_tokens=(), prompt_width=0,
              drafts=None):
        total = DFlashStats.total(per_request, num_speculative_tokens)
        return cls(
            sequences=sequences,
            num_drafts=total.num_drafts,
            num_draft_tokens=total.num_draft_tokens,
            num_accepted_tokens=total.num_accepted_tokens,
            num_accepted_tokens_per_pos=total.num_accepted_tokens_per_pos,
            acceptance_length=total.acceptance_length,
            per_request=per_request,
            finish_reasons=finish_reasons,
            num_new_tokens=list(num_new_tokens),
            prompt_width=prompt_width,
            drafts=drafts,
            step_ks=[list(p.step_ks) for p in per_request],
        )


@dataclass(frozen=True)
class GenerationArgs:
    max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filtering (HF)
    top_p: float = 1.0  # 1: no nucleus filtering (HF)
    stop_strings: tuple[str, ...] = ()
    tokenizer: Any = field(default=None, compare=False)  # decodes for stop_strings
    streamer: Any = field(default=None, compare=False)  # HF streamer: put(LongTensor), end()
    output_drafts: bool = False  # record each step's verified drafts (one more host read per step)


# How ``resolve_generation_args`` treats each field of HF's ``GenerationConfig`` (as a kwarg or in a config):
# resolved with HF's semantics (_RESOLVED); no effect on the tokens of a decoder-only greedy or sampled search with
# one beam (_NO_EFFECT); refused while active (_REFUSED: active unless one of the listed no-op values;
# _SAMPLING_ONLY: the same, only with do_sample=True, since HF applies those warpers only when sampling). A field in
# none of them (one a later transformers adds) is refused unless unset: an error, never a silent difference.
_RESOLVED = {
    "max_new_tokens", "max_length", "min_new_tokens", "min_length", "eos_token_id", "pad_token_id", "do_sample",
    "temperature", "top_k", "top_p", "stop_strings", "num_beams", "num_return_sequences", "cache_implementation",
}
_NO_EFFECT = {
    "bos_token_id", "decoder_start_token_id", "use_cache", "cache_config", "max_cache_len", "compile_config",
    "disable_compile", "prefill_chunk_size", "return_dict_in_generate", "transformers_version", "_from_model_config",
    "is_assistant", "num_beam_groups", "diversity_penalty", "length_penalty", "early_stopping", "low_memory",
    "renormalize_logits", "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
    "assistant_lookbehind", "target_lookbehind", "max_matching_ngram_size", "assistant_ensemble_weight",
    "speculation_type", "continuous_batching_config",
}
_REFUSED = {  # logits processors, other search modes, extra outputs
    "repetition_penalty": (1.0,), "encoder_repetition_penalty": (1.0,), "no_repeat_ngram_size": (0,),
    "encoder_no_repeat_ngram_size": (0,), "bad_words_ids": (), "force_words_ids": (), "constraints": (),
    "suppress_tokens": (), "begin_suppress_tokens": (), "sequence_bias": (), "guidance_scale": (1.0,),
    "forced_bos_token_id": (), "forced_eos_token_id": (), "exponential_decay_length_penalty": (),
    "remove_invalid_values": (False,), "watermarking_config": (), "token_healing": (False,), "max_time": (),
    "penalty_alpha": (0.0,), "prompt_lookup_num_tokens": (), "assistant_early_exit": (), "use_mtp": (False,),
    "dola_layers": (), "output_scores": (False,), "output_logits": (False,), "output_attentions": (False,),
    "output_hidden_states": (False,),
}
_SAMPLING_ONLY = {"min_p": (0.0,), "typical_p": (1.0,), "top_h": (), "epsilon_cutoff": (0.0,), "eta_cutoff": (0.0,)}
# generate() arguments HF takes besides the config fields: refused unless a no-op value; the last two have no effect.
_HF_CALL_ARGS = {
    "logits_processor": ([],), "stopping_criteria": ([],), "prefix_allowed_tokens_fn": (), "assistant_model": (),
    "assistant_tokenizer": (), "negative_prompt_ids": (), "negative_prompt_attention_mask": (), "custom_generate": (),
}
_HF_CALL_ARGS_NO_EFFECT = {"synced_gpus", "trust_remote_code"}
# HF's defaults for fields that nothing sets (GenerationConfig._get_default_generation_params).
_HF_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "num_beams": 1, "num_return_sequences": 1}
_HF_DEFAULT_NEW_TOKENS = 20  # HF's default max_length, counted from the prompt when no length is set anywhere


@functools.cache
def _config_fields() -> frozenset[str]:
    from transformers import GenerationConfig

    return frozenset(GenerationConfig().to_dict())


def _is_off(value, no_ops) -> bool:
    return value is None or any(value == x for x in no_ops)


def resolve_generation_args(target, prompt_len: int, kwargs: dict[str, Any]) -> GenerationArgs:
    """HF ``generate``'s semantics, before any model work.

    Priority as in HF: an argument given in ``kwargs`` (an explicit ``None`` included: ``eos_token_id=None`` never
    stops on eos, ``top_k=None`` disables top-k), then ``generation_config=`` (the argument), then
    ``target.generation_config``, each config's unset (None) fields falling through to the next, then HF's global
    defaults (20 new tokens, ``top_k=50``). ``prompt_len`` is the (left-padded) prompt width, which HF's length
    arguments count. ``kwargs`` holds only what the caller gave.

    Every argument either gives HF's tokens or is an error naming it: ``ValueError`` for a value DFlash does not
    support (a logits processor, beam search, ``min_new_tokens`` with an eos, ...), ``TypeError`` for a name that is
    not a ``generate`` argument. With ``do_sample=False`` temperature, top-k, top-p (and the other sampling
    warpers) are ignored, as HF does."""
    kwargs = dict(kwargs)
    args = _Lookup(kwargs, [(c, where) for c, where in ((kwargs.pop("generation_config", None), "generation_config"),
                                                        (getattr(target, "generation_config", None),
                                                         "target.generation_config")) if c is not None])
    fields = _config_fields()
    unknown = sorted(set(kwargs) - fields - set(_HF_CALL_ARGS) - _HF_CALL_ARGS_NO_EFFECT)
    if unknown:
        raise TypeError(f"generate() got unsupported arguments {unknown} (not HF generation arguments)")
    for name, no_ops in _HF_CALL_ARGS.items():
        if name in kwargs and not _is_off(kwargs[name], no_ops):
            raise ValueError(f"{name}= is not supported by DFlash generation")
    do_sample = bool(args.get("do_sample"))
    _refuse_unsupported(args, fields, do_sample)
    temperature, top_k, top_p = _sampling(args, do_sample)
    max_new = _max_new_tokens(target, prompt_len, kwargs, [c for c, _ in args.sources], args.get)
    eos_ids, pad = _eos_and_pad(args, prompt_len)
    stop = args.get("stop_strings") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if any(not isinstance(x, str) or not x for x in stop):
        raise ValueError(f"stop_strings must be non-empty strings, got {stop}")
    return GenerationArgs(int(max_new), eos_ids, pad, do_sample, temperature, top_k, top_p, stop)


class _Lookup:
    """An argument's value by HF's priority: the call's ``kwargs``, then each config in ``sources``, then HF's
    defaults; ``refuse`` names where an unsupported value came from."""

    def __init__(self, kwargs: dict, sources: list):
        self.kwargs, self.sources = kwargs, sources

    def value(self, name):
        if name in self.kwargs:
            return self.kwargs[name], "argument"
        for c, where in self.sources:
            v = getattr(c, name, None)
            if v is not None:
                return v, where
        return _HF_DEFAULTS.get(name), "default"

    def get(self, name):
        return self.value(name)[0]

    def refuse(self, name, why="DFlash generation does not support it"):
        v, where = self.value(name)
        origin = "" if where == "argument" else f" (from {where}; an argument {name}=... overrides it)"
        raise ValueError(f"{name}={v!r}{origin}: {why}")


def _refuse_unsupported(args: _Lookup, fields, do_sample: bool) -> None:
    for name in sorted(fields - _RESOLVED - _NO_EFFECT):
        no_ops = _REFUSED.get(name, _SAMPLING_ONLY.get(name, ()))
        if name in _SAMPLING_ONLY and not do_sample:
            continue
        if not _is_off(args.get(name), no_ops):
            args.refuse(name)
    for name in ("num_beams", "num_return_sequences"):
        if args.get(name) != 1:
            args.refuse(name, "speculative decoding produces one sequence per prompt (only 1)")
    if args.get("cache_implementation") in ("paged", "quantized"):
        args.refuse("cache_implementation", "HF's paged (continuous batching) and quantized caches are not DFlash's")


def _sampling(args: _Lookup, do_sample: bool) -> tuple[float, int, float]:
    """``(temperature, top_k, top_p)``, checked; neutral when not sampling (HF ignores them then)."""
    temperature, top_k, top_p = (args.get(n) for n in ("temperature", "top_k", "top_p"))
    temperature = 1.0 if temperature is None else temperature  # an explicit None: that warper is off (HF)
    top_k = 0 if top_k is None else top_k
    top_p = 1.0 if top_p is None else top_p
    if isinstance(top_k, bool) or int(top_k) != top_k or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {top_k}")
    if not 0 < float(top_p) <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if do_sample and not float(temperature) > 0:
        raise ValueError(
            f"temperature must be > 0 with do_sample=True, got {temperature} (use do_sample=False for greedy)"
        )
    return (float(temperature), int(top_k), float(top_p)) if do_sample else (1.0, 0, 1.0)


def _eos_and_pad(args: _Lookup, prompt_len: int) -> tuple[tuple[int, ...], int | None]:
    eos = args.get("eos_token_id")
    if isinstance(eos, torch.Tensor):
        eos = eos.tolist()
    eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    pad = args.get("pad_token_id")
    if pad is None and eos_ids:
        pad = eos_ids[0]  # HF's fallback
    min_new, min_length = args.get("min_new_tokens"), args.get("min_length")
    if eos_ids and min_new is not None and min_new > 0:  # HF suppresses eos until then; DFlash's step does not
        args.refuse("min_new_tokens", "suppressing the eos tokens is not supported (it has no effect without an eos)")
    if eos_ids and min_length is not None and min_length > prompt_len:
        args.refuse("min_length", f"suppressing the eos tokens is not supported (only a min_length <= the prompt "
                                  f"width {prompt_len}, or no eos)")
    return eos_ids, None if pad is None else int(pad)


def _max_new_tokens(target, prompt_len, kwargs, configs, get) -> int:
    """HF's ``_prepare_generated_length``: ``max_new_tokens`` wins over ``max_length`` (with HF's warning when
    both are set); ``max_length`` counts the prompt; with neither set anywhere, 20 new tokens (capped at the
    model's ``max_position_embeddings``)."""
    max_new, max_length = get("max_new_tokens"), get("max_length")
    length_set = kwargs.get("max_length") is not None or any(getattr(c, "max_length", None) is not None
                                                              for c in configs)
    if max_new is not None:
        if max_new < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new}")
        if length_set and max_length is not None:
            warnings.warn(f"Both max_new_tokens (={max_new}) and max_length (={max_length}) are set: max_new_tokens "
                          "takes precedence (as in HF generate)", UserWarning, stacklevel=2)
        return max_new
    if "max_length" in kwargs and kwargs["max_length"] is None:
        raise ValueError("max_length=None without max_new_tokens (HF generate fails on it too): give max_new_tokens "
                         "or a max_length")
    if not length_set:
        total = prompt_len + _HF_DEFAULT_NEW_TOKENS
        limit = getattr(getattr(target, "config", None), "max_position_embeddings", None)
        max_length = total if limit is None else min(total, limit)
    if max_length <= prompt_len:
        raise ValueError(f"max_length={max_length} leaves no new token after the {prompt_len}-token prompt: "
                         "raise max_length or give max_new_tokens")
    return max_length - prompt_len


def generate_output(results, prefix: torch.Tensor, pad_token_id: int | None, device, return_dict: bool,
                    output_drafts: bool, num_speculative_tokens: int):
    """``generate``'s result from its requests' ``RequestResult``s: ``[B, L + new]`` (the left-padded prompts, then
    each row's tokens, finished rows padded with ``pad_token_id``), or a ``DFlashGenerateOutput``."""
    width = max(len(r.tokens) for r in results)
    pad = pad_token_id if pad_token_id is not None else 0  # only used when width allows no pad
    new = torch.tensor([r.tokens + [pad] * (width - len(r.tokens)) for r in results], dtype=torch.long)
    sequences = torch.cat([prefix.cpu(), new], dim=1).to(device)
    if not return_dict:
        return sequences
    return DFlashGenerateOutput.build(
        sequences, [r.stats for r in results], [r.finish_reason for r in results], num_speculative_tokens,
        [len(r.tokens) for r in results], prefix.shape[1], [r.drafts for r in results] if output_drafts else None,
    )
