"""DFlashSpecWrapper: a Hugging Face causal LM and a DFlash drafter, generating losslessly together.

``forward`` is ONE speculative step for a batch bucket — target verify, acceptance, DFlash propose — as plain,
static-shaped torch over the paged KV pools, with no host synchronisation. ``prefill`` (per request, outside
``forward``) and ``generate`` (the host loop) drive it.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from .draft_model import DFlashDraftModel
from .generation import DFlashGenerateOutput, DFlashStats, GenerationArgs, resolve_generation_args
from .hidden_states import AuxHiddenStates, decoder_layers
from .kv_cache import PagedKVCache, context_visibility, paged_target_cache, read_slots, write_slots
from .rejection import greedy_accept, process_logits, sample_from, speculative_accept

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16)
_MASKABLE = ("sdpa", "eager")


def validate_pair(target: nn.Module, draft: DFlashDraftModel, num_speculative_tokens: int | None = None) -> None:
    """Raise ``ValueError`` with a specific message when ``draft`` cannot speculate for ``target``."""
    tcfg = target.config.get_text_config()
    dcfg, dflash = draft.config, draft.dflash_config
    if dcfg.hidden_size != tcfg.hidden_size:
        raise ValueError(f"hidden size mismatch: drafter {dcfg.hidden_size}, target {tcfg.hidden_size}")
    embed = target.get_input_embeddings()
    target_vocab = tcfg.vocab_size
    if dcfg.vocab_size != target_vocab:
        raise ValueError(f"vocab size mismatch: drafter {dcfg.vocab_size}, target {target_vocab}")
    if embed is not None and embed.weight.shape[0] < target_vocab:
        raise ValueError(f"target embeddings have {embed.weight.shape[0]} rows for vocab_size {target_vocab}")
    n = len(decoder_layers(target))
    bad = [i for i in dflash.target_layer_ids if not 0 <= i < n]
    if bad:
        raise ValueError(f"target_layer_ids {bad} are outside the target's {n} decoder layers [0, {n})")
    if dflash.num_target_layers != n:
        raise ValueError(
            f"the drafter was built for a {dflash.num_target_layers}-layer target, this target has {n} layers"
        )
    if dflash.mask_token_id >= target_vocab:
        raise ValueError(f"mask_token_id {dflash.mask_token_id} >= target vocab_size {target_vocab}")
    if num_speculative_tokens is not None and num_speculative_tokens != dflash.block_size - 1:
        raise ValueError(
            f"num_speculative_tokens={num_speculative_tokens}, but a DFlash drafter with block_size "
            f"{dflash.block_size} proposes exactly block_size - 1 = {dflash.block_size - 1}"
        )
    tp, dp = next(target.parameters()), next(draft.parameters())
    if tp.dtype != dp.dtype:
        raise ValueError(f"dtype mismatch: drafter {dp.dtype}, target {tp.dtype}; call draft.to({tp.dtype})")
    if tp.device != dp.device:
        raise ValueError(f"device mismatch: drafter on {dp.device}, target on {tp.device}")


def _target_layer_kinds(tcfg) -> tuple[tuple[str, ...] | None, int | None]:
    """Attention kinds the target's layers use (None: one causal mask for all) and its sliding window."""
    window = getattr(tcfg, "sliding_window", None)
    kinds = getattr(tcfg, "layer_types", None)
    if kinds:
        unknown = sorted(set(kinds) - {"full_attention", "sliding_attention"})
        if unknown:
            raise NotImplementedError(f"target layer types {unknown} are not supported (full and sliding only)")
        return (tuple(sorted(set(kinds))) if "sliding_attention" in kinds else None), window
    return (("sliding_attention",) if window is not None else None), window


class SamplingInputs(NamedTuple):
    """Per-row sampling state of one step (all tensors, so one compiled graph serves greedy and sampled rows).

    ``do_sample``, ``temperature``, ``top_k``, ``top_p``: ``[Bk]`` (greedy rows ignore the last three).
    ``draft_probs [Bk, B-1, V]``: the drafter's processed distribution that drew the block's drafts — the full
    rows, because the residual ``max(p_target - p_draft, 0)`` needs them (``Bk * (B-1) * V`` floats: 16 x 15 x
    152k fp32 is ~146 MB, fine for the vocabularies here; a large-vocab deployment would keep it in bf16).
    ``u_accept [Bk, B-1]``, ``u_bonus [Bk]``, ``u_draft [Bk, B-1]``: uniforms in [0, 1) drawn on the host from each
    request's own generator, for the acceptance tests, the residual/bonus sample and the next block's drafts.
    """

    do_sample: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    draft_probs: torch.Tensor
    u_accept: torch.Tensor
    u_bonus: torch.Tensor
    u_draft: torch.Tensor


@dataclass
class _Request:
    index: int
    prompt: list[int]
    new: list[int] = field(default_factory=list)
    stats: DFlashStats = field(default_factory=DFlashStats)
    finish_reason: str | None = None
    seq_len: int = 0  # tokens in the target cache = position of the pending block's first token
    block: torch.Tensor | None = None  # [1, block_size]: bonus + drafts, to verify next
    draft_probs: torch.Tensor | None = None  # [1, block_size - 1, V] when sampling: the drafts' distribution
    generator: torch.Generator | None = None  # the request's own RNG (sampling)


class DFlashSpecWrapper(nn.Module):
    """A target causal LM and its DFlash drafter over one paged KV cache.

    Args:
        target: any HF causal LM (``sdpa`` or ``eager`` attention).
        draft: a ``DFlashDraftModel`` for it (bound to ``target`` here).
        num_speculative_tokens: optional check; must equal ``block_size - 1``.
        max_batch_size: the most requests decoded at once (larger batches are queued).
        max_seq_len: capacity per request, prompt included (default: ``min(max_position_embeddings, 2048)``).
        page_size: KV block size, in tokens.
        batch_buckets: step batch sizes; a step runs at the smallest bucket that holds the live requests, so
            each bucket reuses one compiled step graph.

    ``generate`` follows HF ``generate``; greedy output is token-identical to ``target.generate``.
    """

    def __init__(
        self,
        target: nn.Module,
        draft: DFlashDraftModel,
        num_speculative_tokens: int | None = None,
        *,
        max_batch_size: int = 8,
        max_seq_len: int | None = None,
        page_size: int = 16,
        batch_buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS,
    ):
        super().__init__()
        validate_pair(target, draft, num_speculative_tokens)
        tcfg = target.config.get_text_config()
        attn = getattr(target.config, "_attn_implementation", None) or "eager"
        if attn not in _MASKABLE:
            raise ValueError(
                f"target attention implementation {attn!r} is not supported: load it with "
                f"attn_implementation='sdpa' (or 'eager')"
            )
        if max_batch_size < 1 or page_size < 1:
            raise ValueError(f"max_batch_size and page_size must be >= 1, got {max_batch_size}, {page_size}")
        self.target = target
        self.draft = draft.bind_target(target)
        self.aux = AuxHiddenStates(target, draft.dflash_config.target_layer_ids)
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len or min(tcfg.max_position_embeddings, 2048)
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        self.page_size = page_size
        self.batch_buckets = tuple(sorted({b for b in batch_buckets if 0 < b < max_batch_size} | {max_batch_size}))
        self._eager_mask = attn == "eager"
        self._mask_kinds, self._window = _target_layer_kinds(tcfg)
        self._logits_to_keep = "logits_to_keep" in inspect.signature(target.forward).parameters
        self._cache: PagedKVCache | None = None

    @property
    def block_size(self) -> int:
        return self.draft.block_size

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def forward(self, block, seq_lens, block_tables, active, target_pool, draft_pool, sampling: SamplingInputs | None = None):
        """One speculative step for a batch bucket of ``Bk`` rows.

        ``block [Bk, B]`` = each row's bonus token and drafts (at positions ``seq_lens + 0..B-1``),
        ``seq_lens [Bk]`` tokens already in the cache, ``block_tables [Bk, NB]``, ``active [Bk]`` (False for
        bucket padding), the two pools (written in place), and ``sampling`` (``SamplingInputs``; None: all rows
        greedy, the greedy-only graph).
        Returns ``tokens [Bk, B]`` (accepted drafts then the target's next token, padded with -1),
        ``num_accepted [Bk]``, ``next_block [Bk, B]`` (the new bonus and its drafts) and ``next_draft_probs
        [Bk, B-1, V]`` (None without ``sampling``).
        """
        B = block.shape[1]
        offsets = torch.arange(B, device=block.device)
        positions = seq_lens[:, None] + offsets  # [Bk, B]
        in_capacity = (positions < self.max_seq_len) & active[:, None]
        kv_lens = torch.clamp(seq_lens + B, max=self.max_seq_len)  # [Bk]

        logits, aux = self._target_forward(block, positions, in_capacity, kv_lens, block_tables, active, target_pool)
        target_tokens = logits.argmax(-1)  # [Bk, B]
        tokens, num_accepted = greedy_accept(block[:, 1:], target_tokens)
        if sampling is not None:
            p = sampling
            target_probs = process_logits(logits, p.temperature, p.top_k, p.top_p).softmax(-1)  # [Bk, B, V]
            s_tokens, s_accepted = speculative_accept(block[:, 1:], p.draft_probs, target_probs, p.u_accept, p.u_bonus)
            tokens = torch.where(p.do_sample[:, None], s_tokens, tokens)
            num_accepted = torch.where(p.do_sample, s_accepted, num_accepted)
        bonus = tokens.gather(1, num_accepted[:, None])  # [Bk, 1]: the token after the accepted drafts
        tokens = torch.where(active[:, None], tokens, -1)
        num_accepted = torch.where(active, num_accepted, 0)

        # Context rows for the drafter: the bonus and the accepted drafts; rejected rows write nowhere.
        accepted = offsets[None, :] <= num_accepted[:, None]  # [Bk, B]
        self._inject(aux, positions, accepted & in_capacity, block_tables, draft_pool)

        next_block, next_draft_probs = self._propose(
            bonus, seq_lens + num_accepted + 1, block_tables, active, draft_pool, sampling
        )
        return tokens, num_accepted, next_block, next_draft_probs

    def _target_mask(self, positions, kv_lens, key_pos):
        """``[Bk, 1, T, S]`` causal visibility over each row's written positions (a dict per layer type for
        targets with sliding-window layers). Bucket-padding rows see nothing; their outputs are ignored."""
        masks = {"full_attention": context_visibility(positions, kv_lens, key_pos, True, None)[:, None]}
        if self._mask_kinds is not None and "sliding_attention" in self._mask_kinds:
            masks["sliding_attention"] = context_visibility(positions, kv_lens, key_pos, True, self._window)[:, None]
        if self._eager_mask:  # eager attention adds its mask
            dtype = self.draft.fc.weight.dtype
            masks = {k: torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(~m, torch.finfo(dtype).min)
                     for k, m in masks.items()}
        if self._mask_kinds is None:
            return masks["full_attention"]
        return {kind: masks[kind] for kind in self._mask_kinds}

    def _target_forward(self, ids, positions, write_ok, kv_lens, block_tables, active, target_pool, last_only=False):
        """Target over ``ids [Bk, T]`` at ``positions``; K/V land in the paged pool. -> (logits, aux hidden)."""
        write = write_slots(block_tables, positions, write_ok, self.page_size)
        kv_lens = torch.where(active, kv_lens, 0)
        read, key_pos = read_slots(block_tables, kv_lens, self.page_size)
        mask = self._target_mask(positions, kv_lens, key_pos)
        extra = {"logits_to_keep": 1} if last_only and self._logits_to_keep else {}
        out = self.target(
            input_ids=ids,
            position_ids=positions,
            attention_mask=mask,
            cache=paged_target_cache(target_pool, write, read),
            use_cache=True,
            **extra,
        )
        return out.logits, self.aux.read()

    def _inject(self, aux, positions, valid, block_tables, draft_pool):
        """Project context rows to every draft layer's K/V and scatter them into the drafter pool."""
        ctx = self.draft.context_features(aux)  # [Bk, T, H]
        k, v = self.draft.context_kv(ctx, positions)  # [Ld, Bk, T, Hkv, D] each
        slots = write_slots(block_tables, positions, valid, self.page_size).flatten()  # [Bk * T]
        draft_pool[:, :, slots] = torch.stack([k, v], dim=1).flatten(2, 3)

    def _propose(self, bonus, ctx_lens, block_tables, active, draft_pool, sampling=None):
        """Draft a block after ``bonus [Bk, 1]`` at position ``ctx_lens``; -> (``[Bk, B]`` bonus + drafts, the
        drafts' processed distribution ``[Bk, B-1, V]`` or None without ``sampling``)."""
        Bk, B = bonus.shape[0], self.block_size
        block = torch.cat([bonus, bonus.new_full((Bk, B - 1), self.draft.mask_token_id)], dim=1)
        positions = ctx_lens[:, None] + torch.arange(B, device=bonus.device)
        ctx_lens = torch.where(active, ctx_lens, 0)
        read, _ = read_slots(block_tables, ctx_lens, self.page_size)
        kv = draft_pool[:, :, read]  # [Ld, 2, Bk, S, Hkv, D]
        logits = self.draft(block, positions, kv[:, 0], kv[:, 1], ctx_lens)
        drafts = logits.argmax(-1)  # [Bk, B-1]
        probs = None
        if sampling is not None:
            p = sampling
            probs = process_logits(logits, p.temperature, p.top_k, p.top_p).softmax(-1)  # [Bk, B-1, V]
            drafts = torch.where(p.do_sample[:, None], sample_from(probs, p.u_draft), drafts)
        return torch.cat([bonus, drafts], dim=1), probs

    # ------------------------------------------------------------------ prefill
    def prefill(
        self, input_ids: torch.Tensor, block_table: torch.Tensor, cache: PagedKVCache,
        sampling: SamplingInputs | None = None,
    ):
        """Run one prompt ``[1, L]`` through the target into the pool, inject its context features into the
        drafter's cache and draft the first block. Returns ``([1, B], draft_probs)``: the first token and its
        drafts, and the drafts' distribution ``[1, B-1, V]`` (None without ``sampling``; there
        ``sampling.u_bonus`` samples the first token, ``draft_probs``/``u_accept`` are unused)."""
        L = input_ids.shape[1]
        device = input_ids.device
        positions = torch.arange(L, device=device)[None]
        ok = torch.ones(1, L, dtype=torch.bool, device=device)
        lens = torch.tensor([L], device=device)
        active = torch.ones(1, dtype=torch.bool, device=device)
        logits, aux = self._target_forward(
            input_ids, positions, ok, lens, block_table, active, cache.target_pool, last_only=True
        )
        self._inject(aux, positions, ok, block_table, cache.draft_pool)
        last = logits[:, -1]  # [1, V]
        bonus = last.argmax(-1, keepdim=True)
        if sampling is not None:
            p = sampling
            probs = process_logits(last, p.temperature, p.top_k, p.top_p).softmax(-1)
            bonus = torch.where(p.do_sample[:, None], sample_from(probs, p.u_bonus)[:, None], bonus)
        return self._propose(bonus, lens, block_table, active, cache.draft_pool, sampling)

    # ------------------------------------------------------------------ host loop
    def kv_cache(self) -> PagedKVCache:
        """The paged pools, (re)allocated on the target's device and dtype when needed."""
        p = next(self.target.parameters())
        c = self._cache
        if c is None or c.device != p.device or c.target_pool.dtype != p.dtype:
            tcfg = self.target.config.get_text_config()
            t_heads = getattr(tcfg, "num_key_value_heads", None) or tcfg.num_attention_heads
            t_dim = getattr(tcfg, "head_dim", None) or tcfg.hidden_size // tcfg.num_attention_heads
            dcfg = self.draft.config
            self._cache = PagedKVCache(
                max_batch_size=self.max_batch_size,
                max_seq_len=self.max_seq_len,
                page_size=self.page_size,
                target_shape=(len(decoder_layers(self.target)), t_heads, t_dim),
                draft_shape=(dcfg.num_hidden_layers, dcfg.num_key_value_heads, dcfg.head_dim),
                dtype=p.dtype,
                device=p.device,
            )
        return self._cache

    @torch.no_grad()
    def generate(
        self,
        input_ids,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int | None = None,
        eos_token_id=None,
        pad_token_id: int | None = None,
        return_dict_in_generate: bool = False,
        *,
        streamer=None,
        tokenizer=None,
        seed: int | list[int] | None = None,
        generator: torch.Generator | list[torch.Generator] | None = None,
        **kwargs,
    ):
        """Generate like HF ``generate``.

        ``input_ids`` is a ``[B, L]`` tensor, left-padded with ``attention_mask`` (HF convention), or a list of
        token-id lists. Returns ``[B, L + new]`` (prompt included, finished rows padded with
        ``pad_token_id``), or with ``return_dict_in_generate=True`` a ``DFlashGenerateOutput``.

        HF arguments: ``generation_config``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
        ``max_length``, ``stop_strings`` (needs ``tokenizer``), ``streamer`` (``put``/``end``, batch size 1).
        Sampling is lossless (speculative sampling) and reproducible per request: ``seed`` (an int for the whole
        batch, or one per request) or ``generator`` (one ``torch.Generator``, or one per request) seeds each
        request's own RNG; with neither, the seeds come from torch's global RNG (``torch.manual_seed``).
        """
        device = next(self.target.parameters()).device
        pad_for_inference = pad_token_id
        if pad_for_inference is None:
            pad_for_inference = getattr(kwargs.get("generation_config") or self.target.generation_config,
                                        "pad_token_id", None)
        prompts, prefix = self._prompts(input_ids, attention_mask, pad_for_inference)
        args = resolve_generation_args(
            self.target,
            prefix.shape[1] if prefix is not None else max(len(p) for p in prompts),
            dict(kwargs, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, pad_token_id=pad_token_id),
        )
        vocab = self.draft.config.vocab_size
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if len(p) > self.max_seq_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens, more than max_seq_len={self.max_seq_len}")
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        if len(prompts) > 1 and args.pad_token_id is None:
            raise ValueError("pad_token_id (or an eos_token_id) is required to pad a batch of several prompts")
        if tokenizer is not None:
            check_tokenizer(tokenizer, self.target)
        if args.stop_strings and tokenizer is None:
            raise ValueError("stop_strings needs the tokenizer: generate(..., stop_strings=..., tokenizer=tok)")
        if streamer is not None and len(prompts) > 1:
            raise ValueError(f"a streamer supports batch size 1 only (as in HF), got {len(prompts)} prompts")
        generators = _request_generators(len(prompts), seed, generator) if args.do_sample else [None] * len(prompts)
        if prefix is None:
            prefix = _left_pad(prompts, args.pad_token_id)

        requests = [_Request(i, p, generator=g) for i, (p, g) in enumerate(zip(prompts, generators))]
        if streamer is not None:
            streamer.put(prefix.cpu())  # HF pushes the prompt first (TextStreamer(skip_prompt=True) drops it)
        self._run(requests, dataclasses.replace(args, tokenizer=tokenizer, streamer=streamer), device)
        if streamer is not None:
            streamer.end()

        width = max(len(r.new) for r in requests)
        pad = args.pad_token_id if args.pad_token_id is not None else 0  # only used when width allows no pad
        new = torch.tensor([r.new + [pad] * (width - len(r.new)) for r in requests], dtype=torch.long)
        sequences = torch.cat([prefix.cpu(), new], dim=1).to(device)
        if not return_dict_in_generate:
            return sequences
        return DFlashGenerateOutput.build(
            sequences, [r.stats for r in requests], [r.finish_reason for r in requests], self.block_size - 1,
            [len(r.new) for r in requests], prefix.shape[1],
        )

    def _sampling(self, rows: list[_Request], pad_rows: int, args: GenerationArgs, device, prefill=False):
        """The step's ``SamplingInputs`` for ``rows`` (+ ``pad_rows`` greedy padding rows); None when greedy.
        Draws this step's uniforms from each request's generator, in a fixed order."""
        if not args.do_sample:
            return None
        K, n = self.block_size - 1, len(rows) + pad_rows
        draws = 1 + K if prefill else 1 + 2 * K  # [u_bonus, u_draft] or [u_accept, u_bonus, u_draft]
        u = torch.zeros(n, draws)
        for i, r in enumerate(rows):
            u[i] = torch.rand(draws, generator=r.generator)
        u_accept, u = (torch.zeros(n, K), u) if prefill else (u[:, :K], u[:, K:])
        if prefill:
            draft_probs = torch.zeros(n, K, 0, device=device)
        else:
            V = rows[0].draft_probs.shape[-1]
            draft_probs = torch.cat([r.draft_probs for r in rows] + [rows[0].draft_probs.new_zeros(pad_rows, K, V)])
        live = torch.arange(n) < len(rows)
        return SamplingInputs(
            do_sample=live.to(device),
            temperature=torch.full((n,), args.temperature, device=device),
            top_k=torch.full((n,), args.top_k, dtype=torch.long, device=device),
            top_p=torch.full((n,), args.top_p, device=device),
            draft_probs=draft_probs,
            u_accept=u_accept.to(device),
            u_bonus=u[:, 0].to(device),
            u_draft=u[:, 1:].contiguous().to(device),
        )

    def _run(self, requests: list[_Request], args: GenerationArgs, device) -> None:
        cache = self.kv_cache()
        B = self.block_size
        waiting = deque(requests)
        running: list[_Request] = []
        while waiting or running:
            while waiting and len(running) < self.max_batch_size:
                r = waiting.popleft()
                if self._admit(r, cache, args, device):
                    running.append(r)
            if not running:
                continue
            bucket = next(b for b in self.batch_buckets if b >= len(running))
            pad_rows = bucket - len(running)
            for r in running:
                cache.ensure(r.index, r.seq_len + B)
            block = torch.cat([r.block for r in running] + [running[0].block.new_zeros(pad_rows, B)])
            seq_lens = torch.tensor([r.seq_len for r in running] + [0] * pad_rows, device=device)
            active = torch.arange(bucket, device=device) < len(running)
            tables = cache.block_table([r.index for r in running] + [None] * pad_rows)
            step_inputs = (block, seq_lens, tables, active, cache.target_pool, cache.draft_pool)
            sampling = self._sampling(running, pad_rows, args, device)
            for t in step_inputs + (tuple(sampling) if sampling is not None else ()):
                torch._dynamo.mark_static(t)  # one graph per bucket, never an automatic-dynamic one
            if sampling is None:
                tokens, num_accepted, next_block, next_probs = self(*step_inputs)
            else:
                tokens, num_accepted, next_block, next_probs = self(*step_inputs, sampling)
            tokens, num_accepted = tokens.tolist(), num_accepted.tolist()  # the step's one host read
            still = []
            for i, r in enumerate(running):
                a = num_accepted[i]
                r.stats.record(B - 1, a)
                r.seq_len += a + 1
                r.block = next_block[i : i + 1]
                r.draft_probs = None if next_probs is None else next_probs[i : i + 1]
                for t in tokens[i][: a + 1]:
                    if self._emit(r, t, args):
                        break
                if r.finish_reason is None:
                    still.append(r)
                else:
                    cache.free(r.index)
            running = still

    def _admit(self, r: _Request, cache: PagedKVCache, args: GenerationArgs, device) -> bool:
        """Prefill ``r``; False when it finished without needing a step."""
        if len(r.prompt) >= self.max_seq_len:
            r.finish_reason = "length"
            return False
        cache.ensure(r.index, len(r.prompt))
        ids = torch.tensor([r.prompt], device=device)
        sampling = self._sampling([r], 0, args, device, prefill=True)
        r.block, r.draft_probs = self.prefill(ids, cache.block_table([r.index]), cache, sampling)
        r.seq_len = len(r.prompt)
        if self._emit(r, int(r.block[0, 0]), args):
            cache.free(r.index)
            return False
        return True

    def _emit(self, r: _Request, token: int, args: GenerationArgs) -> bool:
        """Append ``token`` to ``r`` and stream it; True when ``r`` is finished: an eos token or a stop string
        (``"stop"``), ``max_new_tokens`` or capacity (``"length"``)."""
        r.new.append(token)
        if args.streamer is not None:
            args.streamer.put(torch.tensor([token]))
        if token in args.eos_token_ids:
            r.finish_reason = "stop"
        elif args.stop_strings and _has_stop_string(args.tokenizer.decode(r.new), args.stop_strings):
            r.finish_reason = "stop"
        elif len(r.new) >= args.max_new_tokens or len(r.prompt) + len(r.new) >= self.max_seq_len:
            r.finish_reason = "length"
        return r.finish_reason is not None

    def _prompts(self, input_ids, attention_mask, pad_token_id):
        """-> (token lists without padding, the left-padded input tensor to prefix the output or None)."""
        if isinstance(input_ids, (list, tuple)) and (not input_ids or not isinstance(input_ids[0], torch.Tensor)):
            if attention_mask is not None:
                raise ValueError("attention_mask goes with a tensor input_ids, not with a list of prompts")
            if not input_ids:
                raise ValueError("no prompts given")
            if isinstance(input_ids[0], int):
                input_ids = [input_ids]
            return [list(map(int, p)) for p in input_ids], None
        ids = torch.as_tensor(input_ids)
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2 or ids.shape[0] == 0:
            raise ValueError(f"input_ids must be [batch, length], got shape {tuple(ids.shape)}")
        if attention_mask is None:
            if pad_token_id is not None and ids.shape[0] > 1 and bool((ids == pad_token_id).any()):
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


def _has_stop_string(text: str, stop_strings: tuple[str, ...]) -> bool:
    return any(s in text for s in stop_strings)


def check_tokenizer(tokenizer, target: nn.Module) -> None:
    """A tokenizer whose vocabulary is larger than the target's cannot be used with it: ``ValueError``."""
    vocab = target.config.get_text_config().vocab_size
    if len(tokenizer) > vocab:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens but the target's vocabulary has {vocab}: "
            f"they do not belong together"
        )


def _request_generators(n: int, seed, generator) -> list[torch.Generator]:
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


def _left_pad(prompts: list[list[int]], pad: int | None) -> torch.Tensor:
    width = max(len(p) for p in prompts)
    return torch.tensor([[pad] * (width - len(p)) + p for p in prompts], dtype=torch.long)
