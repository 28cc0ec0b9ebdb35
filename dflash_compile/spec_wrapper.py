"""DFlashSpecWrapper: a Hugging Face causal LM and a DFlash drafter, generating losslessly together.

``forward`` is ONE speculative step for a batch bucket — target verify, acceptance, DFlash propose — as plain,
static-shaped torch over the paged KV pools, with no host synchronisation. ``prefill`` (the requests that join
together, in one forward, outside ``forward``) and ``generate`` (the host loop over persistent batch buffers)
drive it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import numbers
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from .draft_model import DFlashDraftModel
from .generation import DFlashGenerateOutput, DFlashStats, GenerationArgs, resolve_generation_args
from .hidden_states import AuxHiddenStates, decoder_layers
from .kv_cache import (
    PagedKVCache, available_memory, context_visibility, paged_target_cache, read_slots, write_slots,
)
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
    """``(kinds, window)``: the attention kinds of the target's layers when they differ (one mask per kind, keyed as
    HF keys them), else None (one mask for every layer); and the sliding window. A config with ``layer_types``
    windows only its ``sliding_attention`` layers; one without them but with a ``sliding_window`` (Mistral)
    windows every layer."""
    window = getattr(tcfg, "sliding_window", None)
    kinds = getattr(tcfg, "layer_types", None)
    if kinds:
        unknown = sorted(set(kinds) - {"full_attention", "sliding_attention"})
        if unknown:
            raise NotImplementedError(f"target layer types {unknown} are not supported (full and sliding only)")
        return (tuple(sorted(set(kinds))), window) if "sliding_attention" in kinds else (None, None)
    return None, window


def _context_pages(buckets, max_seq_len: int, page_size: int) -> tuple[int, ...]:
    """Context buckets in tokens -> sorted page counts, capacity included (default: 128, 256, ... tokens)."""
    full = -(-max_seq_len // page_size)
    if buckets is None:
        buckets, tokens = [], 128
        while tokens < max_seq_len:
            buckets.append(tokens)
            tokens *= 2
    bad = [b for b in buckets if not isinstance(b, int) or b < 1]
    if bad:
        raise ValueError(f"context_buckets must be positive token counts, got {bad}")
    return tuple(sorted({min(-(-b // page_size), full) for b in buckets} | {full}))


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
    pages: int = 0  # KV blocks allocated to it (the first ``pages`` entries of its block-table row)
    generator: torch.Generator | None = None  # the request's own RNG (sampling)


class _Batch:
    """The running requests' step inputs as persistent device buffers: row ``i`` of every buffer belongs to
    ``rows[i]``; rows ``len(rows)..`` are free (inactive, empty table). A step runs on the first ``bucket`` rows;
    its results update the buffers in place (one host read per step), and a row is rewritten only when a request
    joins, leaves (the last row moves into the hole) or needs another KV block (one table entry)."""

    def __init__(self, num_rows: int, block_size: int, blocks_per_seq: int, device):
        long = dict(dtype=torch.long, device=device)
        self.rows: list[_Request] = []
        self.block = torch.zeros(num_rows, block_size, **long)  # bonus + drafts to verify next
        self.seq_lens = torch.zeros(num_rows, **long)
        self.tables = torch.full((num_rows, blocks_per_seq), -1, **long)
        self.active = torch.zeros(num_rows, dtype=torch.bool, device=device)
        self.do_sample = torch.zeros(num_rows, dtype=torch.bool, device=device)
        self.temperature = torch.ones(num_rows, device=device)
        self.top_k = torch.zeros(num_rows, **long)
        self.top_p = torch.ones(num_rows, device=device)
        self.draft_probs: torch.Tensor | None = None  # [num_rows, B-1, V], allocated when sampling
        self.warm: set[tuple] = set()  # step keys (batch bucket, context pages, sampled) already run

    def clear_row(self, i: int) -> None:
        self.block[i] = 0
        self.seq_lens[i] = 0
        self.tables[i] = -1
        self.active[i] = False
        self.do_sample[i] = False

    def remove(self, i: int) -> None:
        """Drop row ``i``: the last row moves into it."""
        last = len(self.rows) - 1
        if i != last:
            for buf in (self.block, self.seq_lens, self.tables, self.active, self.do_sample, self.temperature,
                        self.top_k, self.top_p) + ((self.draft_probs,) if self.draft_probs is not None else ()):
                buf[i] = buf[last]
            self.rows[i] = self.rows[last]
        self.rows.pop()
        self.clear_row(last)


class DFlashSpecWrapper(nn.Module):
    """A target causal LM and its DFlash drafter over one paged KV cache.

    Args:
        target: any HF causal LM (``sdpa`` or ``eager`` attention).
        draft: a ``DFlashDraftModel`` for it (bound to ``target`` here).
        num_speculative_tokens: optional check; must equal ``block_size - 1``.
        max_batch_size: the most requests decoded at once (larger batches are queued).
        max_seq_len: capacity per request, prompt included (default: ``min(max_position_embeddings, 2048)``).
        page_size: KV block size, in tokens.
        batch_buckets: step batch sizes; a step runs at the smallest bucket that holds the live requests.
        context_buckets: context lengths, in tokens, a step's attention spans (rounded up to whole pages; the
            capacity is always one). A step runs at the smallest that holds every live row's context and block,
            so attention costs what the live context needs, not the capacity. Default: 128, 256, 512, ... up to
            ``max_seq_len``. Each (batch bucket, context bucket) pair is one static step graph when compiled.
        max_cache_bytes: the most the KV pools may take (default: the memory available on the target's device when
            they are allocated). They are allocated at ``generate``, eager for what its requests can need (the
            concurrent ones, ``min(max_batch_size, requests)``, each ``prompt + max_new_tokens + block_size``
            tokens at most), growing for a later call that needs more; compiled at the capacity, ``max_batch_size``
            requests of ``max_seq_len`` tokens, as the step graphs are static in the pools' shapes. Pools that do
            not fit are a ``ValueError`` naming the bytes, before anything is allocated.

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
        context_buckets: tuple[int, ...] | None = None,
        max_cache_bytes: int | None = None,
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
        self.aux = AuxHiddenStates(target, draft.dflash_config.target_layer_ids, enabled=False)
        self._closed = False
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len or min(tcfg.max_position_embeddings, 2048)
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        if self.block_size > self.max_seq_len:  # a block must fit in a request's capacity
            raise ValueError(
                f"the drafter's block_size {self.block_size} is larger than max_seq_len={self.max_seq_len}, the "
                f"tokens a request may hold: a block that long can never be verified"
            )
        self.page_size = page_size
        self.batch_buckets = tuple(sorted({b for b in batch_buckets if 0 < b < max_batch_size} | {max_batch_size}))
        self.context_buckets = _context_pages(context_buckets, self.max_seq_len, page_size)
        self._eager_mask = attn == "eager"
        self._mask_kinds, self._window = _target_layer_kinds(tcfg)
        self._logits_to_keep = "logits_to_keep" in inspect.signature(target.forward).parameters
        self._cache: PagedKVCache | None = None
        self.max_cache_bytes = max_cache_bytes

    @property
    def block_size(self) -> int:
        return self.draft.block_size

    def close(self) -> None:
        """Remove this wrapper's forward hooks from the target and drop its KV pools (idempotent). ``generate``
        afterwards is an error. ``with DFlashSpecWrapper(...) as spec:`` closes on exit."""
        self.aux.remove()
        self._cache = None
        self._closed = True

    def __enter__(self) -> "DFlashSpecWrapper":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def compile(self, *args, **kwargs):
        """``nn.Module.compile`` with ``dynamic=False`` by default: every (batch, context) bucket is its own
        static graph, never an automatically dynamic one."""
        kwargs.setdefault("dynamic", False)
        super().compile(*args, **kwargs)

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def forward(
        self, block, seq_lens, block_tables, active, target_pools, draft_pool, sampling: SamplingInputs | None = None
    ):
        """One speculative step for a batch bucket of ``Bk`` rows.

        ``block [Bk, B]`` = each row's bonus token and drafts (at positions ``seq_lens + 0..B-1``),
        ``seq_lens [Bk]`` tokens already in the cache, ``block_tables [Bk, NB]`` (``NB`` pages: the context bucket;
        they must cover every row's positions up to ``seq_lens + B``, capped at capacity), ``active [Bk]`` (False
        for bucket padding), the pools (``target_pools``: one per target layer; written in place), and
        ``sampling`` (``SamplingInputs``; None: all rows greedy, the greedy-only graph).
        Returns ``tokens [Bk, B]`` (accepted drafts then the target's next token, padded with -1),
        ``num_accepted [Bk]``, ``next_block [Bk, B]`` (the new bonus and its drafts) and ``next_draft_probs
        [Bk, B-1, V]`` (None without ``sampling``).
        """
        positions, in_capacity = self._block_positions(block, seq_lens, active)
        logits, aux = self._verify(block, positions, in_capacity, seq_lens, block_tables, active, target_pools)
        tokens, num_accepted, bonus = self._accept(block, logits, active, sampling)
        # Context rows for the drafter: the bonus and the accepted drafts; rejected rows write nowhere.
        accepted = torch.arange(block.shape[1], device=block.device) <= num_accepted[:, None]  # [Bk, B]
        self._inject(aux, positions, accepted & in_capacity, block_tables, draft_pool)
        next_block, next_draft_probs = self._propose(
            bonus, seq_lens + num_accepted + 1, block_tables, active, draft_pool, sampling
        )
        return tokens, num_accepted, next_block, next_draft_probs

    # The step's phases (``forward`` is their composition; benchmarks time them one by one).
    def _block_positions(self, block, seq_lens, active):
        """Positions of the block's tokens ``[Bk, B]`` and which of them the caches may hold."""
        positions = seq_lens[:, None] + torch.arange(block.shape[1], device=block.device)
        return positions, (positions < self.max_seq_len) & active[:, None]

    def _verify(self, block, positions, in_capacity, seq_lens, block_tables, active, target_pools):
        """The target over the block: ``(logits [Bk, B, V], context features [Bk, B, n_ids * H])``."""
        kv_lens = torch.clamp(seq_lens + block.shape[1], max=self.max_seq_len)  # [Bk]
        return self._target_forward(block, positions, in_capacity, kv_lens, block_tables, active, target_pools)

    def _accept(self, block, logits, active, sampling=None):
        """Acceptance: ``(tokens [Bk, B] padded with -1, num_accepted [Bk], bonus [Bk, 1])``."""
        tokens, num_accepted = greedy_accept(block[:, 1:], logits.argmax(-1))
        if sampling is not None:
            p = sampling
            target_probs = process_logits(logits, p.temperature, p.top_k, p.top_p).softmax(-1)  # [Bk, B, V]
            s_tokens, s_accepted = speculative_accept(block[:, 1:], p.draft_probs, target_probs, p.u_accept, p.u_bonus)
            tokens = torch.where(p.do_sample[:, None], s_tokens, tokens)
            num_accepted = torch.where(p.do_sample, s_accepted, num_accepted)
        bonus = tokens.gather(1, num_accepted[:, None])  # [Bk, 1]: the token after the accepted drafts
        return torch.where(active[:, None], tokens, -1), torch.where(active, num_accepted, 0), bonus

    def _target_mask(self, positions, kv_lens, key_pos):
        """``[Bk, 1, T, S]`` causal visibility over each row's written positions, windowed where the target's layers
        slide (a dict per layer type for targets mixing full and sliding layers). Bucket-padding rows see nothing;
        their outputs are ignored."""
        if self._mask_kinds is None:
            masks = {None: context_visibility(positions, kv_lens, key_pos, True, self._window)[:, None]}
        else:
            masks = {kind: context_visibility(positions, kv_lens, key_pos, True,
                                              self._window if kind == "sliding_attention" else None)[:, None]
                     for kind in self._mask_kinds}
        if self._eager_mask:  # eager attention adds its mask
            dtype = self.draft.fc.weight.dtype
            masks = {k: torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(~m, torch.finfo(dtype).min)
                     for k, m in masks.items()}
        return masks[None] if self._mask_kinds is None else masks

    def _target_forward(self, ids, positions, write_ok, kv_lens, block_tables, active, target_pools, last_only=False):
        """Target over ``ids [Bk, T]`` at ``positions``; K/V land in the paged pool. -> (logits, aux hidden)."""
        write = write_slots(block_tables, positions, write_ok, self.page_size)
        kv_lens = torch.where(active, kv_lens, 0)
        read, key_pos = read_slots(block_tables, kv_lens, self.page_size)
        mask = self._target_mask(positions, kv_lens, key_pos)
        extra = {"logits_to_keep": 1} if last_only and self._logits_to_keep else {}
        self.aux.enabled = True  # the hooks record this forward only, and read() forgets it
        out = self.target(
            input_ids=ids,
            position_ids=positions,
            attention_mask=mask,
            cache=paged_target_cache(target_pools, write, read),
            use_cache=True,
            **extra,
        )
        self.aux.enabled = False
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
    @torch.no_grad()
    def prefill(self, input_ids, lens, block_tables, target_pools, draft_pool, sampling: SamplingInputs | None = None):
        """Run new prompts through the target into the pools, inject their context features into the drafter's
        cache and draft each one's first block, all rows in one forward.

        ``input_ids [n, L]`` left-padded (row ``i``'s prompt is its last ``lens[i]`` tokens), ``block_tables [n,
        NB]`` covering each prompt. Returns ``([n, B], draft_probs)``: each row's first token and its drafts, and
        the drafts' distribution ``[n, B-1, V]`` (None without ``sampling``; there ``sampling.u_bonus`` samples
        the first token, ``draft_probs``/``u_accept`` are unused)."""
        n, L = input_ids.shape
        positions = torch.arange(L, device=input_ids.device) - (L - lens)[:, None]  # [n, L]; < 0: padding
        real = positions >= 0
        positions = positions.clamp(min=0)  # padding queries sit at 0 and see key 0: no empty softmax row
        active = torch.ones(n, dtype=torch.bool, device=input_ids.device)
        logits, aux = self._target_forward(
            input_ids, positions, real, lens, block_tables, active, target_pools, last_only=True
        )
        self._inject(aux, positions, real, block_tables, draft_pool)
        last = logits[:, -1]  # [n, V]: every row's prompt ends at the last column
        bonus = last.argmax(-1, keepdim=True)
        if sampling is not None:
            p = sampling
            probs = process_logits(last, p.temperature, p.top_k, p.top_p).softmax(-1)
            bonus = torch.where(p.do_sample[:, None], sample_from(probs, p.u_bonus)[:, None], bonus)
        return self._propose(bonus, lens, block_tables, active, draft_pool, sampling)

    # ------------------------------------------------------------------ host loop
    def kv_cache(self, num_blocks: int | None = None) -> PagedKVCache:
        """The paged pools with at least ``num_blocks`` KV blocks (default: the capacity, ``max_batch_size`` requests
        of ``max_seq_len`` tokens), (re)allocated on the target's device and dtype when needed."""
        p = next(self.target.parameters())
        num_blocks = num_blocks or self.max_batch_size * -(-self.max_seq_len // self.page_size)
        c = self._cache
        if c is None or c.device != p.device or c.draft_pool.dtype != p.dtype or c.num_blocks < num_blocks:
            self._cache = None  # the old pools go first: the new ones are checked against the memory left
            tcfg = self.target.config.get_text_config()
            t_heads = getattr(tcfg, "num_key_value_heads", None) or tcfg.num_attention_heads
            t_dim = getattr(tcfg, "head_dim", None) or tcfg.hidden_size // tcfg.num_attention_heads
            dcfg = self.draft.config
            pools = functools.partial(
                PagedKVCache,
                max_batch_size=self.max_batch_size,
                max_seq_len=self.max_seq_len,
                page_size=self.page_size,
                target_shape=(len(decoder_layers(self.target)), t_heads, t_dim),
                draft_shape=(dcfg.num_hidden_layers, dcfg.num_key_value_heads, dcfg.head_dim),
                dtype=p.dtype,
                num_blocks=num_blocks,
            )
            need = pools(device="meta").nbytes  # sized on the meta device: nothing allocated yet
            allowed = self.max_cache_bytes if self.max_cache_bytes is not None else available_memory(p.device)
            if allowed is not None and need > allowed:
                raise ValueError(
                    f"the KV pools need {need} bytes ({num_blocks} blocks of {self.page_size} tokens), more than "
                    + (f"max_cache_bytes={allowed}" if self.max_cache_bytes is not None
                       else f"the {allowed} bytes available on {p.device}")
                    + ": fewer or shorter concurrent requests (max_batch_size, max_seq_len, max_new_tokens) need less"
                )
            self._cache = pools(device=p.device)
        return self._cache

    def kv_cache_bytes(self) -> int:
        """Bytes the KV pools hold now (0 before the first ``generate``)."""
        return self._cache.nbytes if self._cache is not None else 0

    def _context_bucket(self, num_tokens: int) -> int:
        """Pages of the smallest context bucket that holds ``num_tokens`` positions (capped at capacity)."""
        need = -(-min(num_tokens, self.max_seq_len) // self.page_size)
        return next(b for b in self.context_buckets if b >= need)

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
        if self._closed:
            raise RuntimeError("this DFlashSpecWrapper is closed (its hooks on the target are removed): make a new one")
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

    def _uniforms(self, rows: list[_Request], num_rows: int, prefill: bool) -> torch.Tensor:
        """This step's uniforms ``[num_rows, draws]``, drawn on the host from each request's generator in a fixed
        order (``[u_accept (B-1), u_bonus, u_draft (B-1)]``; no ``u_accept`` at prefill); zeros for padding."""
        K = self.block_size - 1
        draws = 1 + K if prefill else 1 + 2 * K
        u = torch.zeros(num_rows, draws)
        for i, r in enumerate(rows):
            if r.generator is not None:
                u[i] = torch.rand(draws, generator=r.generator)
        return u

    def _sampling(self, batch: _Batch, bucket: int) -> SamplingInputs:
        """The step's ``SamplingInputs`` for the first ``bucket`` rows of ``batch``."""
        K = self.block_size - 1
        u = self._uniforms(batch.rows, bucket, prefill=False).to(batch.block.device)
        return SamplingInputs(
            do_sample=batch.do_sample[:bucket], temperature=batch.temperature[:bucket], top_k=batch.top_k[:bucket],
            top_p=batch.top_p[:bucket], draft_probs=batch.draft_probs[:bucket],
            u_accept=u[:, :K], u_bonus=u[:, K], u_draft=u[:, K + 1:],
        )

    def _run(self, requests: list[_Request], args: GenerationArgs, device) -> None:
        compiled = self._compiled_call_impl is not None
        rows = min(self.max_batch_size, len(requests))  # at once; each needs at most prompt + new tokens + a block
        longest = min(self.max_seq_len, max(len(r.prompt) for r in requests) + args.max_new_tokens + self.block_size)
        cache = self.kv_cache(None if compiled else rows * -(-longest // self.page_size))
        batch = _Batch(next(b for b in self.batch_buckets if b >= rows), self.block_size, cache.blocks_per_seq, device)
        waiting = deque(requests)
        # Each (batch bucket, context bucket, sampled) key is one static graph, and every wrapper shares forward's
        # code object, hence one dynamo cache: lift the per-code-object limit to dynamo's overall one.
        cfg = torch._dynamo.config
        settings = (
            cfg.patch(recompile_limit=max(cfg.recompile_limit, cfg.accumulated_recompile_limit),
                      automatic_dynamic_shapes=False)
            if compiled else contextlib.nullcontext()
        )
        with settings:
            while waiting or batch.rows:
                free = self.max_batch_size - len(batch.rows)
                if waiting and free:  # everything that fits joins together: one prefill
                    self._admit(batch, [waiting.popleft() for _ in range(min(len(waiting), free))], cache, args)
                if batch.rows:
                    self._step(batch, cache, args)

    def _step(self, batch: _Batch, cache: PagedKVCache, args: GenerationArgs) -> None:
        """One speculative step of the running rows: one call of ``forward``, one host read."""
        B, rows = self.block_size, batch.rows
        bucket, step_inputs = self._step_inputs(batch, cache)
        sampling = (self._sampling(batch, bucket),) if args.do_sample else ()
        # A key that already ran in this generate() has its compiled graph in dynamo's cache: only the guards that
        # tell the cached graphs apart need to run (one graph per key, told apart by the inputs' shapes).
        key = (bucket, step_inputs[2].shape[1], args.do_sample)
        warm = key in batch.warm and self._compiled_call_impl is not None
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True) if warm else contextlib.nullcontext():
            tokens, num_accepted, next_block, next_probs = self(*step_inputs, *sampling)
        batch.warm.add(key)
        batch.block[:bucket] = next_block
        batch.seq_lens[:bucket] += num_accepted + batch.active[:bucket]
        if next_probs is not None:
            batch.draft_probs[:bucket] = next_probs
        tokens = tokens.tolist()  # the step's one host read
        for i in range(len(rows) - 1, -1, -1):  # backwards: a finished row is replaced by the last one
            r, row = rows[i], tokens[i]
            a = row.index(-1) - 1 if -1 in row else B - 1
            r.stats.record(B - 1, a)
            r.seq_len += a + 1
            for t in row[: a + 1]:
                if self._emit(r, t, args):
                    break
            if r.finish_reason is not None:
                cache.free(r.index)
                batch.remove(i)

    def _step_inputs(self, batch: _Batch, cache: PagedKVCache) -> tuple[int, tuple]:
        """``(bucket, forward's inputs)`` for the running rows: the smallest batch bucket that holds them and the
        smallest context bucket that holds every row's next block (KV blocks allocated as needed)."""
        bucket = next(b for b in self.batch_buckets if b >= len(batch.rows))
        longest = 0
        for i, r in enumerate(batch.rows):
            longest = max(longest, r.seq_len + self.block_size)
            self._grow(batch, i, r, r.seq_len + self.block_size, cache)
        pages = self._context_bucket(longest)
        return bucket, (batch.block[:bucket], batch.seq_lens[:bucket], batch.tables[:bucket, :pages],
                        batch.active[:bucket], cache.target_pools, cache.draft_pool)

    def _grow(self, batch: _Batch, i: int, r: _Request, num_tokens: int, cache: PagedKVCache) -> None:
        """Allocate KV blocks so row ``i`` (request ``r``) covers ``num_tokens`` positions (capped at capacity)."""
        if r.pages * self.page_size < min(num_tokens, self.max_seq_len):
            cache.ensure(r.index, num_tokens)
            owned = cache.blocks(r.index)
            batch.tables[i, r.pages : len(owned)] = torch.tensor(owned[r.pages :], dtype=torch.long)
            r.pages = len(owned)

    def _row_sampling(self, r: _Request, args: GenerationArgs) -> tuple[bool, float, int, float]:
        """``(do_sample, temperature, top_k, top_p)`` of request ``r``'s row."""
        return args.do_sample, args.temperature, args.top_k, args.top_p

    def _admit(self, batch: _Batch, new: list[_Request], cache: PagedKVCache, args: GenerationArgs) -> None:
        """Prefill ``new`` requests together into the free rows of ``batch``; those that finish at once (a
        prompt at capacity, an eos first token, ``max_new_tokens == 1``) leave again."""
        B, device = self.block_size, batch.block.device
        for r in new:
            if len(r.prompt) >= self.max_seq_len:
                r.finish_reason = "length"
        new = [r for r in new if r.finish_reason is None]
        if not new:
            return
        first = len(batch.rows)
        batch.rows.extend(new)
        for j, r in enumerate(new):
            i = first + j
            r.seq_len = len(r.prompt)
            self._grow(batch, i, r, r.seq_len, cache)
            batch.seq_lens[i] = r.seq_len
            batch.active[i] = True
            batch.do_sample[i], batch.temperature[i], batch.top_k[i], batch.top_p[i] = self._row_sampling(r, args)
        rows = slice(first, first + len(new))
        L = max(len(r.prompt) for r in new)
        ids = torch.tensor([[0] * (L - len(r.prompt)) + r.prompt for r in new], device=device)
        lens = batch.seq_lens[rows]
        pages = self._context_bucket(L)
        sampling = None
        if args.do_sample:
            if batch.draft_probs is None:
                V = self.draft.config.vocab_size
                batch.draft_probs = torch.zeros(batch.block.shape[0], B - 1, V, device=device)
            u = self._uniforms(new, len(new), prefill=True).to(device)
            sampling = SamplingInputs(
                batch.do_sample[rows], batch.temperature[rows], batch.top_k[rows], batch.top_p[rows],
                batch.draft_probs[rows], torch.zeros(len(new), B - 1, device=device), u[:, 0], u[:, 1:],
            )
        tables = batch.tables[rows, :pages]
        block, probs = self.prefill(ids, lens, tables, cache.target_pools, cache.draft_pool, sampling)
        batch.block[rows] = block
        if probs is not None:
            batch.draft_probs[rows] = probs
        first_tokens = block[:, 0].tolist()
        for i in range(first + len(new) - 1, first - 1, -1):
            r = batch.rows[i]
            if self._emit(r, first_tokens[i - first], args):
                cache.free(r.index)
                batch.remove(i)

    def _emit(self, r: _Request, token: int, args: GenerationArgs) -> bool:
        """Append ``token`` to ``r`` and stream it; True when ``r`` is finished: an eos token or a stop string
        (``"stop"``), ``max_new_tokens`` or capacity (``"length"``)."""
        r.new.append(token)
        if args.streamer is not None:
            args.streamer.put(torch.tensor([token]))
        if token in args.eos_token_ids:
            r.finish_reason = "stop"
        elif args.stop_strings and _ends_with_stop_string(args.tokenizer, r.new, args.stop_strings):
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


def _ends_with_stop_string(tokenizer, tokens: list[int], stop_strings: tuple[str, ...]) -> bool:
    """Whether the text of ``tokens`` has a stop string that its last token completes.

    Every earlier token was checked when it came, so only a tail window is decoded (never the whole generation):
    enough tokens that the text before the last token's own has the longest stop string's length plus 3 characters
    (slack for a UTF-8 character split at the window's edge), doubling the window while tokens decode to less."""
    longest = max(map(len, stop_strings))
    last = len(tokenizer.decode(tokens[-1:]))
    n = longest
    while True:
        text = tokenizer.decode(tokens[-n:])
        if n >= len(tokens) or len(text) - last >= longest + 3:
            return any(s in text for s in stop_strings)
        n *= 2


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
