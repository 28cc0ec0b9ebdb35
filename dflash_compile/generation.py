"""Host side of generation: argument resolution (HF semantics), output objects, statistics."""

from __future__ import annotations

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


_KNOWN_KWARGS = {
    "max_new_tokens", "max_length", "eos_token_id", "pad_token_id", "use_cache", "num_beams",
    "num_return_sequences", "temperature", "top_k", "top_p", "stop_strings",
}
# Logits processors HF would apply (greedy or not) that DFlash does not: a generation_config that sets one is an
# error rather than a silently different output.
_UNSUPPORTED_CONFIG = {
    "repetition_penalty": (None, 1.0), "encoder_repetition_penalty": (None, 1.0), "no_repeat_ngram_size": (None, 0),
    "min_p": (None,), "typical_p": (None, 1.0), "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0),
    "min_length": (None, 0), "min_new_tokens": (None, 0), "bad_words_ids": (None,), "force_words_ids": (None,),
    "suppress_tokens": (None,), "begin_suppress_tokens": (None,), "sequence_bias": (None,),
    "guidance_scale": (None, 1.0), "forced_bos_token_id": (None,), "forced_eos_token_id": (None,),
}
# HF's defaults for fields a generation config leaves unset (GenerationConfig._get_default_generation_params).
_HF_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}


def resolve_generation_args(target, prompt_len: int, kwargs: dict[str, Any]) -> GenerationArgs:
    """HF semantics: explicit kwargs override ``generation_config`` (argument or the target's); with
    ``do_sample=False`` temperature, top-k and top-p are ignored. Every invalid value is an error here, before
    any model work."""
    kwargs = dict(kwargs)
    gen_config = kwargs.pop("generation_config", None) or getattr(target, "generation_config", None)
    for name in ("num_beams", "num_return_sequences"):
        value = kwargs.get(name)
        if value not in (None, 1):
            raise ValueError(f"{name}={value} is not supported by speculative decoding (only 1)")
    unknown = sorted(set(kwargs) - _KNOWN_KWARGS - {"do_sample"})
    if unknown:
        raise TypeError(f"generate() got unsupported arguments {unknown}")
    active = {n: getattr(gen_config, n) for n, off in _UNSUPPORTED_CONFIG.items() if getattr(gen_config, n, None) not in off}
    if active:
        raise ValueError(f"generation_config sets {active}, which DFlash generation does not support")

    def pick(name, value=None):
        return value if value is not None else getattr(gen_config, name, None)

    do_sample = bool(pick("do_sample", kwargs.get("do_sample")))
    temperature, top_k, top_p = (
        pick(n, kwargs.get(n)) if pick(n, kwargs.get(n)) is not None else _HF_DEFAULTS[n] for n in _HF_DEFAULTS
    )
    if top_k is not None and (isinstance(top_k, bool) or int(top_k) != top_k or top_k < 0):
        raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {top_k}")
    if not 0 < float(top_p) <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if do_sample and not float(temperature) > 0:
        raise ValueError(
            f"temperature must be > 0 with do_sample=True, got {temperature} (use do_sample=False for greedy)"
        )

    max_new = pick("max_new_tokens", kwargs.get("max_new_tokens"))
    if max_new is None:
        max_length = pick("max_length", kwargs.get("max_length")) or 20
        max_new = max_length - prompt_len
    if max_new < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new}")
    eos = pick("eos_token_id", kwargs.get("eos_token_id"))
    eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    pad = pick("pad_token_id", kwargs.get("pad_token_id"))
    if pad is None and eos_ids:
        pad = eos_ids[0]  # HF's fallback
    stop = pick("stop_strings", kwargs.get("stop_strings")) or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if any(not isinstance(x, str) or not x for x in stop):
        raise ValueError(f"stop_strings must be non-empty strings, got {stop}")
    if not do_sample:  # HF ignores the sampling parameters when not sampling
        temperature, top_k, top_p = 1.0, 0, 1.0
    return GenerationArgs(
        int(max_new), eos_ids, None if pad is None else int(pad), do_sample, float(temperature), int(top_k),
        float(top_p), stop,
    )
