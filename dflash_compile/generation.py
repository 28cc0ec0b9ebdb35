"""Host side of generation: argument resolution (HF semantics), output objects, statistics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class DFlashStats:
    """Speculation counters (vLLM names). ``acceptance_length`` = 1 + accepted / drafts."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def record(self, num_speculative_tokens: int, num_accepted: int) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * num_speculative_tokens
        self.num_drafts += 1
        self.num_draft_tokens += num_speculative_tokens
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.num_accepted_tokens_per_pos[i] += 1

    @classmethod
    def total(cls, parts: list["DFlashStats"], num_speculative_tokens: int) -> "DFlashStats":
        out = cls(num_accepted_tokens_per_pos=[0] * num_speculative_tokens)
        for p in parts:
            out.num_drafts += p.num_drafts
            out.num_draft_tokens += p.num_draft_tokens
            out.num_accepted_tokens += p.num_accepted_tokens
            for i, n in enumerate(p.num_accepted_tokens_per_pos):
                out.num_accepted_tokens_per_pos[i] += n
        return out


@dataclass
class DFlashGenerateOutput:
    """What ``generate(..., return_dict_in_generate=True)`` returns.

    ``sequences [B, L + new]`` (prompt included, finished rows padded with ``pad_token_id``); the counters
    are whole-batch totals, ``per_request`` has the same counters for each row, ``finish_reasons`` is
    ``"stop"`` (an eos token) or ``"length"`` (``max_new_tokens`` or capacity) per row.
    """

    sequences: torch.Tensor
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: list[int]
    acceptance_length: float
    per_request: list[DFlashStats]
    finish_reasons: list[str]

    @classmethod
    def build(cls, sequences, per_request, finish_reasons, num_speculative_tokens):
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
        )


@dataclass(frozen=True)
class GenerationArgs:
    max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None


_KNOWN_KWARGS = {"max_new_tokens", "eos_token_id", "pad_token_id", "use_cache", "num_beams", "num_return_sequences"}


def resolve_generation_args(target, prompt_len: int, kwargs: dict[str, Any]) -> GenerationArgs:
    """HF semantics: explicit kwargs override ``generation_config`` (argument or the target's)."""
    gen_config = kwargs.pop("generation_config", None) or getattr(target, "generation_config", None)
    do_sample = kwargs.pop("do_sample", None)
    if do_sample is None:
        do_sample = bool(getattr(gen_config, "do_sample", False))
    if do_sample:
        raise NotImplementedError("do_sample=True is not supported yet: DFlash generation here is greedy")
    for name in ("num_beams", "num_return_sequences"):
        value = kwargs.get(name)
        if value not in (None, 1):
            raise ValueError(f"{name}={value} is not supported by speculative decoding (only 1)")
    unknown = sorted(set(kwargs) - _KNOWN_KWARGS)
    if unknown:
        raise TypeError(f"generate() got unsupported arguments {unknown}")

    def pick(name, value):
        return value if value is not None else getattr(gen_config, name, None)

    max_new = kwargs.get("max_new_tokens")
    max_new = pick("max_new_tokens", max_new)
    if max_new is None:
        max_length = getattr(gen_config, "max_length", None) or 20
        max_new = max_length - prompt_len
    if max_new < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new}")
    eos = pick("eos_token_id", kwargs.get("eos_token_id"))
    eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    pad = pick("pad_token_id", kwargs.get("pad_token_id"))
    if pad is None and eos_ids:
        pad = eos_ids[0]  # HF's fallback
    return GenerationArgs(int(max_new), eos_ids, None if pad is None else int(pad))
