"""A call's arguments made into requests, before any model work: HF-style arguments resolved, prompts split out of
a (left-padded) tensor or a list, every refusal raised in the caller's thread."""

from __future__ import annotations

import dataclasses
import numbers
from typing import NamedTuple

import torch
from torch import nn

from .generation import GenerationArgs, resolve_generation_args
from .target_check import check_tokenizer


class Requests(NamedTuple):
    prompts: list[list[int]]  # token ids, no padding
    prefix: torch.Tensor  # the left-padded prompts, the output's prefix
    args: GenerationArgs
    generators: list  # one torch.Generator per prompt, or None (greedy; or seeded by rank 0 when it joins)


class RequestMaker:
    """Makes a call's ``Requests`` for one wrapper: ``target`` (its generation config), prompts up to
    ``max_seq_len`` tokens in ``[0, vocab_size)``; ``seeded_by_rank0``: unseeded sampled requests are seeded by rank 0
    of a tensor-parallel target when they join (``Scheduler``), not here."""

    def __init__(self, target: nn.Module, vocab_size: int, max_seq_len: int, seeded_by_rank0: bool):
        self.target, self.vocab_size, self.max_seq_len = target, vocab_size, max_seq_len
        self.seeded_by_rank0 = seeded_by_rank0

    def __call__(self, input_ids, attention_mask, streamer, tokenizer, seed, generator, output_drafts, kwargs,
                 single=False) -> Requests:
        """``kwargs`` holds only what the caller gave: an explicit None means what it means in HF (``eos_token_id=
        None``: never stop on eos). The lengths count the (padded) prompt width, as HF's do."""
        args = resolve_generation_args(self.target, prompt_width(input_ids), kwargs)
        # Without an attention_mask, HF masks the pad tokens, unless pad is an eos id (after its eos fallback).
        pad = args.pad_token_id if args.pad_token_id not in (None, *args.eos_token_ids) else None
        prompts, prefix = split_prompts(input_ids, attention_mask, pad)
        if single and len(prompts) != 1:
            raise ValueError(f"submit takes one prompt, got {len(prompts)}: submit each, or use generate")
        self._check_prompts(prompts)
        if args.pad_token_id is None and len(prompts) > 1 and (
                (prefix is None and len({len(p) for p in prompts}) > 1) or args.stop_strings):
            # as in HF: prompts of several lengths need a pad to be left-padded, rows that stop early one to be filled
            raise ValueError("pad_token_id (or an eos_token_id) is required to pad a batch of several prompts")
        if tokenizer is not None:
            check_tokenizer(tokenizer, self.target)
        if args.stop_strings and tokenizer is None:
            raise ValueError("stop_strings needs the tokenizer: generate(..., stop_strings=..., tokenizer=tok)")
        if streamer is not None and len(prompts) > 1:
            raise ValueError(f"a streamer supports batch size 1 only (as in HF), got {len(prompts)} prompts")
        if args.do_sample and not (self.seeded_by_rank0 and seed is None and generator is None):
            generators = request_generators(len(prompts), seed, generator)
        else:  # greedy; or tensor-parallel and unseeded: the scheduler seeds it from rank 0 when it joins
            generators = [None] * len(prompts)
        if prefix is None:
            prefix = left_pad(prompts, args.pad_token_id)
        if streamer is not None:
            streamer.put(prefix.cpu())  # HF pushes the prompt first (TextStreamer(skip_prompt=True) drops it)
        args = dataclasses.replace(args, tokenizer=tokenizer, streamer=streamer, output_drafts=output_drafts)
        return Requests(prompts, prefix, args, generators)

    def _check_prompts(self, prompts: list[list[int]]) -> None:
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if len(p) > self.max_seq_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens, more than max_seq_len={self.max_seq_len}")
            bad = [t for t in p if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")


def split_prompts(input_ids, attention_mask, pad_token_id):
    """-> (token lists without padding, the left-padded input tensor to prefix the output or None)."""
    if isinstance(input_ids, (list, tuple)) and (not input_ids or not isinstance(input_ids[0], torch.Tensor)):
        if attention_mask is not None:
            raise ValueError("attention_mask goes with a tensor input_ids, not with a list of prompts")
        if not input_ids:
            raise ValueError("no prompts given")
        if isinstance(input_ids[0], numbers.Number):
            input_ids = [input_ids]
        bad = [t for p in input_ids for t in p if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
        if bad:
            raise TypeError(f"input_ids must hold integer token ids, got {bad[0]!r}")
        return [list(map(int, p)) for p in input_ids], None
    ids = torch.as_tensor(input_ids)
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got a {ids.dtype} tensor")
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] == 0:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(ids.shape)}")
    if attention_mask is None:
        if pad_token_id is not None and bool((ids == pad_token_id).any()):
            attention_mask = ids != pad_token_id  # HF infers the mask from pad tokens the same way
        else:
            attention_mask = torch.ones_like(ids, dtype=torch.bool)
    mask = torch.as_tensor(attention_mask).to(torch.bool).cpu()
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask {tuple(mask.shape)} does not match input_ids {tuple(ids.shape)}")
    # Left padding only: once a row starts, it has no holes.
    started = mask.long().cummax(dim=1).values.bool()
    if bool((started & ~mask).any()):
        raise ValueError("attention_mask must be left-padded (HF convention: tokenizer.padding_side='left')")
    ids_cpu = ids.cpu()
    return [ids_cpu[i][mask[i]].tolist() for i in range(ids.shape[0])], ids


def prompt_width(input_ids) -> int:
    """The width of ``input_ids`` as HF's length arguments count it (the padded tensor's, or the longest prompt's); 0
    for input ``split_prompts`` will refuse."""
    if isinstance(input_ids, torch.Tensor):
        return input_ids.shape[-1] if input_ids.dim() else 0
    if isinstance(input_ids, (list, tuple)) and input_ids:
        if isinstance(input_ids[0], numbers.Number):
            return len(input_ids)
        return max((len(p) if hasattr(p, "__len__") else 0) for p in input_ids)
    return 0


def left_pad(prompts: list[list[int]], pad: int | None) -> torch.Tensor:
    width = max(len(p) for p in prompts)
    return torch.tensor([[pad] * (width - len(p)) + p for p in prompts], dtype=torch.long)


def request_generators(n: int, seed, generator) -> list[torch.Generator]:
    """One CPU ``torch.Generator`` per request, from ``seed`` / ``generator`` (or torch's global RNG)."""
    if seed is not None and generator is not None:
        raise ValueError("give seed or generator, not both")
    if isinstance(generator, (list, tuple)):
        if len(generator) != n:
            raise ValueError(f"{len(generator)} generators for {n} prompts")
        return list(generator)
    if isinstance(seed, (list, tuple)):
        if len(seed) != n:
            raise ValueError(f"{len(seed)} seeds for {n} prompts")
        seeds = [int(x) for x in seed]
    else:
        source = generator if generator is not None else (
            torch.Generator().manual_seed(int(seed)) if seed is not None else None
        )
        seeds = torch.randint(0, 2**62, (n,), generator=source).tolist()
    return [torch.Generator().manual_seed(x) for x in seeds]
