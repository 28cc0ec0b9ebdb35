"""The speculative step: the one thing compiled, one step for a batch bucket as plain, static-shaped torch over the
paged pools — verify, accept, inject, propose — with no host synchronisation; and the prefill that brings joining
requests into the pools.

``DFlashStep`` holds the target, the drafter and the geometry only (no host state): the wrapper's rooms own the
pools, the requests and the compiled graphs and call it. Its phases are public so that benchmarks time them one by
one (``benchmarks/bench_step.py``).
"""

from __future__ import annotations

import functools
import inspect
from typing import NamedTuple

import torch
from torch import nn

from ..models.draft_model import DFlashDraftModel
from ..models.hidden_states import AuxHiddenStates
from ..paged.hf_cache import paged_target_cache
from ..paged.recurrent import StateAccess
from ..primitives.masks import MaskSpec, context_visibility
from ..primitives.slots import read_slots, write_slots
from .rejection import greedy_accept, process_logits, sample_at_positions

PADDING = "padding"  # the mask plan's name for the 2-D padding mask recurrent layers read


class SamplingInputs(NamedTuple):
    """Per-row sampling state of one step (all tensors, so one compiled graph serves greedy and sampled rows).

    ``do_sample``, ``temperature``, ``top_k``, ``top_p``: ``[Bk]`` (greedy rows ignore the last three).
    ``seeds [Bk]`` (int64): each request's sampling seed. The token a sampled row draws at a position is the
    Gumbel-max sample of the target's processed distribution there with noise hashed from (seed, position)
    (``rejection.sample_at_positions``), so nothing else of the step (``K``, the batch, the graph) enters it.
    """

    do_sample: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seeds: torch.Tensor


class DFlashStep(nn.Module):
    """One speculative step over a target and its drafter (see the module docstring).

    ``mask_plan``: what each mask the target reads is (``runtime.target_check.mask_plan``), set by the owner once
    the target's layers are probed. ``aux``: the hooks that record the target's hidden states at the drafter's
    ``target_layer_ids``.
    """

    def __init__(self, target: nn.Module, draft: DFlashDraftModel, aux: AuxHiddenStates, max_seq_len: int,
                 page_size: int, mask_plan: dict):
        super().__init__()
        self.target, self.draft, self.aux = target, draft, aux
        self.max_seq_len, self.page_size = max_seq_len, page_size
        self.mask_plan = mask_plan
        self.eager_mask = (getattr(target.config, "_attn_implementation", None) or "eager") == "eager"
        self.logits_to_keep = "logits_to_keep" in inspect.signature(target.forward).parameters

    @property
    def block_size(self) -> int:
        return self.draft.block_size

    def example_inputs(self, cache, batch: int, pages: int, sampled: bool, K: int, propose: bool):
        """Step inputs of a key's shapes (every row inactive), to trace its graph."""
        device = cache.device
        long = dict(dtype=torch.long, device=device)
        args = [torch.zeros(batch, K + 1, **long), torch.zeros(batch, **long),
                torch.full((batch, pages), -1, **long), torch.zeros(batch, dtype=torch.bool, device=device),
                cache.target_pools, cache.draft_pool]
        if sampled:
            zeros = functools.partial(torch.zeros, device=device)
            args.append(SamplingInputs(
                zeros(batch, dtype=torch.bool), zeros(batch), zeros(batch, dtype=torch.long), zeros(batch),
                zeros(batch, dtype=torch.long)))
        kwargs = {"state_slots": torch.zeros(batch, **long)} if cache.has_states else {}
        if not propose:
            kwargs["propose"] = False
        return tuple(args), kwargs

    @torch.no_grad()
    def forward(
        self, block, seq_lens, block_tables, active, target_pools, draft_pool, sampling: SamplingInputs | None = None,
        state_slots=None, propose: bool = True,
    ):
        """One speculative step for a batch bucket of ``Bk`` rows, verifying ``K = block.shape[1] - 1`` drafts.

        ``block [Bk, K+1]`` = each row's bonus token and drafts (at positions ``seq_lens + 0..K``),
        ``seq_lens [Bk]`` tokens already in the cache, ``block_tables [Bk, NB]`` (``NB`` pages: the context bucket;
        they must cover every row's positions up to ``seq_lens + B``, capped at capacity), ``active [Bk]`` (False
        for bucket padding), the pools (``target_pools``: one per target layer; written in place), and
        ``sampling`` (``SamplingInputs``; None: all rows greedy, the greedy-only graph), and ``state_slots [Bk]`` each
        row's slot in the recurrent-state pools (targets with linear-attention layers only; see ``recurrent.py``).
        Returns ``tokens [Bk, K+1]`` (accepted drafts then the target's next token, padded with -1),
        ``num_accepted [Bk]`` and ``next_block [Bk, B]`` (the new bonus and the drafter's ``B - 1`` drafts after it;
        the host verifies as many of them as the next step's ``K``). With ``propose=False`` the drafter does not run
        (the next step verifies no draft): ``next_block`` is ``[Bk, 1]``, the bonus alone; the accepted positions
        still reach the drafter's cache. ``K = 0`` without proposing is plain decoding.
        """
        positions, in_capacity = self.positions(block, seq_lens, active)
        logits, aux, states = self.verify(
            block, positions, in_capacity, seq_lens, block_tables, active, target_pools, state_slots
        )
        tokens, num_accepted, bonus = self.accept(block, logits, positions, active, sampling)
        if states is not None:  # recurrent layers keep the state after the bonus and the accepted drafts
            states.commit(num_accepted)
        # Context rows for the drafter: the bonus and the accepted drafts; rejected rows write nowhere.
        accepted = torch.arange(block.shape[1], device=block.device) <= num_accepted[:, None]  # [Bk, B]
        self.inject(aux, positions, accepted & in_capacity, block_tables, draft_pool)
        if not propose:
            return tokens, num_accepted, bonus
        next_block = self.propose(bonus, seq_lens + num_accepted + 1, block_tables, active, draft_pool, sampling)
        return tokens, num_accepted, next_block

    # ------------------------------------------------------------------ the phases (``forward`` composes them)
    def positions(self, block, seq_lens, active):
        """Positions of the block's tokens ``[Bk, B]`` and which of them the caches may hold."""
        positions = seq_lens[:, None] + torch.arange(block.shape[1], device=block.device)
        return positions, (positions < self.max_seq_len) & active[:, None]

    def verify(self, block, positions, in_capacity, seq_lens, block_tables, active, target_pools, state_slots=None):
        """The target over the block: ``(logits [Bk, B, V], context features [Bk, B, n_ids * H], StateAccess or
        None)``; recurrent layers run token by token and keep every position's state until ``commit``."""
        kv_lens = torch.clamp(seq_lens + block.shape[1], max=self.max_seq_len)  # [Bk]
        # a draft of -1 (a placeholder where the host has none: StepKeys.block_len) is embedded as token 0; no
        # target token equals it, so it and everything after it are rejected
        return self.target_forward(block.clamp(min=0), positions, in_capacity, kv_lens, block_tables, active,
                                   target_pools, state_slots=state_slots, stepped=True)

    def accept(self, block, logits, positions, active, sampling=None):
        """Acceptance: ``(tokens [Bk, B] padded with -1, num_accepted [Bk], bonus [Bk, 1])``. The target's token
        after each block position (``positions + 1``): its argmax, or for sampled rows its position-keyed draw; the
        drafts that equal them are accepted, and the first that does not is replaced by the target's."""
        target_tokens = self.next_tokens(logits, positions + 1, sampling)
        tokens, num_accepted = greedy_accept(block[:, 1:], target_tokens)
        bonus = tokens.gather(1, num_accepted[:, None])  # [Bk, 1]: the token after the accepted drafts
        return torch.where(active[:, None], tokens, -1), torch.where(active, num_accepted, 0), bonus

    def target_masks(self, positions, kv_lens, key_pos, padding=None):
        """The masks the target reads (``mask_plan``): ``[Bk, 1, T, S]`` causal visibility over each row's written
        positions, windowed or chunked where the layers are; ``padding`` (``[Bk, T]``, True at real tokens, or
        None) for recurrent layers, which the model uses to zero left padding before it reaches the state.
        Bucket-padding rows see nothing; their outputs are ignored. A dict keyed as the model reads it, or one
        tensor for every layer."""
        built = {}
        for spec in dict.fromkeys(self.mask_plan.values()):  # each distinct mask once, in a fixed order
            if not isinstance(spec, MaskSpec):
                continue
            m = context_visibility(positions, kv_lens, key_pos, spec)[:, None]
            if self.eager_mask:  # eager attention adds its mask
                dtype = self.draft.fc.weight.dtype
                m = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(~m, torch.finfo(dtype).min)
            built[spec] = m
        built[PADDING], built[None] = padding, None
        masks = {key: built[spec] for key, spec in self.mask_plan.items()}
        return masks[None] if list(masks) == [None] else masks

    def target_forward(self, ids, positions, write_ok, kv_lens, block_tables, active, target_pools, last_only=False,
                        state_slots=None, stepped=False):
        """Target over ``ids [Bk, T]`` at ``positions``; K/V land in the paged pool, recurrent states (``state_slots``)
        in theirs. -> (logits, aux hidden, ``StateAccess`` or None)."""
        write = write_slots(block_tables, positions, write_ok, self.page_size)
        kv_lens = torch.where(active, kv_lens, 0)
        read, key_pos = read_slots(block_tables, kv_lens, self.page_size)
        mask = self.target_masks(positions, kv_lens, key_pos, None if stepped else write_ok)
        states = StateAccess(state_slots, active, stepped) if state_slots is not None else None
        extra = {"logits_to_keep": 1} if last_only and self.logits_to_keep else {}
        out = self.aux.recording(  # the hooks record this forward only, and read() forgets it
            self.target,
            input_ids=ids,
            position_ids=positions,
            attention_mask=mask,
            cache=paged_target_cache(target_pools, write, read, states),
            use_cache=True,
            **extra,
        )
        return out.logits, self.aux.read(), states

    def inject(self, aux, positions, valid, block_tables, draft_pool):
        """Project context rows to every draft layer's K/V and scatter them into the drafter pool."""
        ctx = self.draft.context_features(aux)  # [Bk, T, H]
        k, v = self.draft.context_kv(ctx, positions)  # [Ld, Bk, T, Hkv, D] each
        slots = write_slots(block_tables, positions, valid, self.page_size).flatten()  # [Bk * T]
        draft_pool[:, :, slots] = torch.stack([k, v], dim=1).flatten(2, 3)

    @staticmethod
    def next_tokens(logits, positions, sampling=None):
        """The token at each of ``positions [Bk, T]`` given ``logits [Bk, T, V]`` for it: the argmax, or for rows
        that sample the Gumbel-max draw of the processed distribution keyed by (the row's seed, the position)."""
        tokens = logits.argmax(-1)
        if sampling is None:
            return tokens
        p = sampling
        drawn = sample_at_positions(process_logits(logits, p.temperature, p.top_k, p.top_p), p.seeds, positions)
        return torch.where(p.do_sample[:, None], drawn, tokens)

    def propose(self, bonus, ctx_lens, block_tables, active, draft_pool, sampling=None):
        """Draft a block after ``bonus [Bk, 1]`` at position ``ctx_lens``; -> ``[Bk, B]``: the bonus and the
        ``B - 1`` drafts. A sampled row drafts with the noise the target will draw with at the same positions."""
        Bk, B = bonus.shape[0], self.block_size
        block = torch.cat([bonus, bonus.new_full((Bk, B - 1), self.draft.mask_token_id)], dim=1)
        positions = ctx_lens[:, None] + torch.arange(B, device=bonus.device)
        ctx_lens = torch.where(active, ctx_lens, 0)
        read, _ = read_slots(block_tables, ctx_lens, self.page_size)
        logits = self.draft(block, positions, ctx_lens=ctx_lens, pool=draft_pool, read=read)  # [Bk, B-1, V]
        drafts = self.next_tokens(logits, positions[:, 1:], sampling)  # [Bk, B-1]
        return torch.cat([bonus, drafts], dim=1)

    # ------------------------------------------------------------------ prefill
    @torch.no_grad()
    def prefill(self, input_ids, lens, block_tables, target_pools, draft_pool, sampling: SamplingInputs | None = None,
                state_slots=None, cached=None):
        """Run new prompts through the target into the pools, inject their context features into the drafter's
        cache and draft each one's first block, all rows in one forward.

        ``input_ids [n, L]`` left-padded (row ``i``'s prompt is its last ``lens[i]`` tokens), ``block_tables [n,
        NB]`` covering each prompt. Returns ``[n, B]``: each row's first token (drawn at position ``lens`` for a
        sampled row) and its drafts. ``state_slots [n]``: the rows' recurrent-state
        slots (hybrid targets), written with each prompt's final state. ``cached [n]`` (prefix caching): how many of
        each prompt's first tokens its blocks already hold (target and drafter K/V); ``input_ids`` then holds the
        rest of each prompt, which is all that runs."""
        n, L = input_ids.shape
        cached = torch.zeros_like(lens) if cached is None else cached
        positions = torch.arange(L, device=input_ids.device) - (L - (lens - cached))[:, None]  # [n, L]; < 0: padding
        real = positions >= 0
        positions = (positions + cached[:, None]).clamp(min=0)  # padding queries see key 0 at least: no empty row
        active = torch.ones(n, dtype=torch.bool, device=input_ids.device)
        logits, aux, _ = self.target_forward(
            input_ids, positions, real, lens, block_tables, active, target_pools, last_only=True,
            state_slots=state_slots,
        )
        self.inject(aux, positions, real, block_tables, draft_pool)
        last = logits[:, -1:]  # [n, 1, V]: every row's prompt ends at the last column
        bonus = self.next_tokens(last, lens[:, None], sampling)  # [n, 1]: the token at position lens
        return self.propose(bonus, lens, block_tables, active, draft_pool, sampling)
