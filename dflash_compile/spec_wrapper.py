"""DFlashSpecWrapper: a Hugging Face causal LM and a DFlash drafter, generating losslessly together.

Read top to bottom, this file is the algorithm: ``forward`` is ONE speculative step for a batch bucket — verify,
accept, inject, propose — as plain, static-shaped torch over the paged KV pools, with no host synchronisation;
``prefill`` brings the requests that join together into the pools in one forward. ``generate`` and ``submit``
validate a call and hand its requests to the host scheduler (``scheduler.py``: admission, buckets, emission,
sampling inputs, threads), which drives the step.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import logging
import numbers
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from .distributed import TensorParallel
from .draft_model import SPLIT_WEIGHTS, DFlashDraftModel
from .generation import DFlashGenerateOutput, resolve_generation_args
from .hidden_states import AuxHiddenStates, decoder_layers
from .kv_cache import (
    PagedKVCache, StateLayout, available_memory, context_visibility, paged_target_cache, probe_layout, read_slots,
    write_slots,
)
from .recurrent import StateAccess, step_by_token, unstep
from .rejection import greedy_accept, process_logits, sample_at_positions
from .scheduler import Scheduler, request_generators
from .speculation import BatchSizeSchedule, FixedK, GoodputPolicy, SpeculationPolicy, default_ks

log = logging.getLogger(__name__)
DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16)
_UNSET = object()  # ``generate``'s default for arguments where an explicit None means something (as in HF)
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
    K = num_speculative_tokens
    if K is not None and (isinstance(K, bool) or not isinstance(K, numbers.Integral)
                          or not 0 <= K <= dflash.block_size - 1):
        raise ValueError(
            f"num_speculative_tokens={K!r}: a DFlash drafter with block_size {dflash.block_size} proposes "
            f"block_size - 1 = {dflash.block_size - 1} tokens, so 0 <= num_speculative_tokens <= "
            f"{dflash.block_size - 1} (0: plain decoding)"
        )
    tp, dp = next(target.parameters()), next(draft.parameters())
    if tp.dtype != dp.dtype:
        raise ValueError(f"dtype mismatch: drafter {dp.dtype}, target {tp.dtype}; call draft.to({tp.dtype})")
    if tp.device != dp.device:
        raise ValueError(f"device mismatch: drafter on {dp.device}, target on {tp.device}")


def _check_heads_divide(tcfg, world: int) -> None:
    """A tensor-parallel target's attention and KV heads must split evenly over its ``world`` ranks."""
    heads = {"num_attention_heads": tcfg.num_attention_heads,
             "num_key_value_heads": getattr(tcfg, "num_key_value_heads", None) or tcfg.num_attention_heads}
    odd = [f"{k}={v}" for k, v in heads.items() if v % world]
    if odd:
        raise ValueError(f"the target's {', '.join(odd)} do not divide over its {world} tensor-parallel ranks: each "
                         f"rank must hold whole heads, the same number on every rank")


def _policy(speculation, num_speculative_tokens: int | None, block_size: int) -> SpeculationPolicy:
    """The constructor's ``speculation`` argument -> a policy (see ``DFlashSpecWrapper``)."""
    K = num_speculative_tokens
    if speculation is None:
        speculation = "auto" if K is None else "fixed"
    if isinstance(speculation, SpeculationPolicy):
        return speculation
    if isinstance(speculation, dict):
        return BatchSizeSchedule(speculation, block_size - 1 if K is None else K)
    if speculation == "fixed":
        return FixedK(block_size - 1 if K is None else K)
    if speculation == "auto":
        return GoodputPolicy(None if K is None else tuple(k for k in default_ks(block_size) if k < K) + (K,))
    raise ValueError(f"speculation={speculation!r}: expected 'auto', 'fixed', a num_speculative_tokens_per_batch_size "
                     f"dict or a SpeculationPolicy")


def _mask_plan(tcfg, layouts) -> dict[str | None, tuple | None]:
    """What each mask the target reads is, keyed as its forward reads them: ``("attention", window, chunk)`` (causal
    visibility over the paged context, windowed or chunked), ``("padding",)`` (the 2-D padding mask that recurrent
    layers zero left padding with) or None (read by layers that cache nothing). Key None: one mask for every layer.

    A config with ``layer_types`` gets a dict, keyed as transformers keys the dict of masks its own ``generate``
    hands a model: each layer type names its mask function(s) in ``LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING`` (a
    ``hybrid`` layer, attention and an SSM in one, reads two masks), and the function says what the mask is. A layer
    type transformers has no mask for is classified by what its layers cache (``layouts``, from
    ``kv_cache.probe_layout``). Without ``layer_types`` every layer attends, windowed by ``sliding_window`` if the
    config has one (Mistral), and one mask serves them all."""
    from transformers import masking_utils as hf

    patterns = getattr(tcfg, "layer_types", None)
    if not patterns:
        return {None: ("attention", getattr(tcfg, "sliding_window", None), None)}
    built_as = {hf.create_causal_mask: ("attention", None, None),
                hf.create_sliding_window_causal_mask: ("attention", getattr(tcfg, "sliding_window", None), None),
                hf.create_chunked_causal_mask: ("attention", None, getattr(tcfg, "attention_chunk_size", None)),
                hf.create_recurrent_attention_mask: ("padding",)}

    def mask(pattern, fn):
        fn = fn.func if isinstance(fn, functools.partial) else fn
        if fn not in built_as:
            raise NotImplementedError(f"target layer type {pattern!r}: transformers masks it with "
                                      f"{getattr(fn, '__name__', fn)}, which this wrapper does not build")
        return built_as[fn]

    plan = {}
    for pattern in dict.fromkeys(patterns):
        fn = hf.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING.get(pattern)
        if isinstance(fn, dict):
            for key, f in fn.items():
                plan.setdefault(key, mask(pattern, f))
        elif fn is not None:
            plan[pattern] = mask(pattern, fn)
        else:
            cached = {type(lay).__name__ if lay is None or lay.attention is None else "both"
                      for lay, p in zip(layouts, patterns) if p == pattern} if layouts is not None else set()
            if cached <= {"NoneType"}:
                plan[pattern] = None  # cache nothing: an MLP-only layer, say (or not probed yet)
            elif cached == {"StateLayout"}:
                plan[pattern] = ("padding",)
            else:
                raise NotImplementedError(f"target layer type {pattern!r} caches attention K/V, and transformers "
                                          f"names no mask for it")
    if len(plan) == 1 and list(plan.values()) == [("attention", None, None)]:
        return {None: plan.popitem()[1]}  # every layer attends alike: one mask
    return plan


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
    ``seeds [Bk]`` (int64): each request's sampling seed. The token a sampled row draws at a position is the
    Gumbel-max sample of the target's processed distribution there with noise hashed from (seed, position)
    (``rejection.sample_at_positions``), so nothing else of the step (``K``, the batch, the graph) enters it.
    """

    do_sample: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seeds: torch.Tensor


class DFlashSpecWrapper(nn.Module):
    """A target causal LM and its DFlash drafter over one paged KV cache.

    Args:
        target: any HF causal LM (``sdpa`` or ``eager`` attention).
        draft: a ``DFlashDraftModel`` for it (bound to ``target`` here).
        num_speculative_tokens: ``K``, the drafts every step verifies, ``0 <= K <= block_size - 1`` (``0``: plain
            decoding). The drafter always drafts its whole block; a smaller ``K`` verifies only its first ``K``
            drafts, a shorter target forward. Given, it fixes ``K`` (unless ``speculation`` says otherwise, where it
            is the largest ``K`` used); not given, ``speculation="auto"`` chooses.
        speculation: how each step's ``K`` is chosen (``speculation.py``): ``"auto"`` (the default without
            ``num_speculative_tokens``: the ``K`` that maximises the batch's expected tokens per second, from step
            costs measured on this machine and each request's acceptance), ``"fixed"``, a vLLM
            ``num_speculative_tokens_per_batch_size`` dict (``{"1-4": 7, "5-16": 1}``) or a ``SpeculationPolicy``.
            Every ``K`` it may use is its own step graph (``spec.speculative_ks``).
        max_batch_size: the most requests decoded at once (larger batches are queued).
        max_seq_len: capacity per request, prompt included (default: ``min(max_position_embeddings, 2048)``).
        page_size: KV block size, in tokens.
        batch_buckets: step batch sizes; a step runs at the smallest bucket that holds the live requests.
        context_buckets: context lengths, in tokens, a step's attention spans (rounded up to whole pages; the
            capacity is always one). A step runs at the smallest that holds every live row's context and block,
            so attention costs what the live context needs, not the capacity. Default: 128, 256, 512, ... up to
            ``max_seq_len``. Compiled with ``dflash`` or ``inductor``, one graph per batch bucket serves every context
            length (the step walks the live pages); with ``dflash_neuron``, each (batch bucket, context bucket)
            pair is one static graph.
        max_cache_bytes: the most the KV pools may take (default: the memory available on the target's device when
            they are allocated). Eager, they hold what the requests in flight can need (each ``prompt +
            max_new_tokens + K + 1`` tokens at most) and grow in place, contents kept, when more requests join;
            compiled, they are allocated at the capacity, ``max_batch_size`` requests of ``max_seq_len`` tokens, as
            the step graphs are static in the pools' shapes. Pools that do not fit are a ``ValueError`` naming the
            bytes, before anything is allocated (for ``generate``/``submit``: the joining requests fail with it).
        prefix_caching: keep the full KV pages of every prompt (the target's and the drafter's), hashed as a chain
            of pages, after their requests finish; a new request whose prompt starts with cached pages reuses them
            and prefills only the rest. Pages no request holds are evicted least-recently-used when the pools need
            room; the pools are then allocated at the capacity, as when compiled. Off for targets with
            recurrent-state layers (their state is not kept at page boundaries; said in the log). ``spec.prefix_cache_stats()`` counts queries, hits and evictions. Greedy output is the same
            with and without it.

    ``generate`` follows HF ``generate``; greedy output is token-identical to ``target.generate``.
    """

    def __init__(
        self,
        target: nn.Module,
        draft: DFlashDraftModel,
        num_speculative_tokens: int | None = None,
        *,
        speculation: str | dict | SpeculationPolicy | None = None,
        max_batch_size: int = 8,
        max_seq_len: int | None = None,
        page_size: int = 16,
        batch_buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS,
        context_buckets: tuple[int, ...] | None = None,
        max_cache_bytes: int | None = None,
        prefix_caching: bool = False,
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
        self.tp = TensorParallel.of(target)  # a tensor-parallel target: ranks run in lockstep (distributed.py)
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
        self._masks = _mask_plan(tcfg, None)  # what each mask the target reads is (completed once probed)
        self._logits_to_keep = "logits_to_keep" in inspect.signature(target.forward).parameters
        self._cache: PagedKVCache | None = None
        self._stepping = False  # recurrent mixers run token by token (installed with the pools; close() undoes)
        self._layout = None  # ((device, dtype), what each target layer caches: kv_cache.probe_layout)
        self._checked = None  # the (device, dtype) the paged forward was checked on (``_check_paged_forward``)
        self.max_cache_bytes = max_cache_bytes
        self.prefix_caching = bool(prefix_caching)
        self.policy = _policy(speculation, num_speculative_tokens, self.block_size)
        self.speculative_ks = self.policy.ks(self.block_size)
        bad = [k for k in self.speculative_ks if not 0 <= k <= self.block_size - 1]
        if not self.speculative_ks or bad:
            raise ValueError(f"speculation policy K values {bad or '(none)'} are outside [0, {self.block_size - 1}]")
        self.num_speculative_tokens = max(self.speculative_ks)  # the most a step verifies (sizes the pools)
        self._steps = None  # CompiledSteps once compile() is called
        self.scheduler = Scheduler(self)
        if self.tp is not None:
            _check_heads_divide(tcfg, self.tp.world)
            self.tp.check_same("target, drafter and wrapper configuration", self._identity())
            self._split_drafter()

    def _split_drafter(self) -> None:
        """Split the drafter over the target's ranks (heads and MLP, ``DFlashDraftModel.split``), or keep it whole
        on every rank where its sizes do not divide (said in the log)."""
        tp, draft = self.tp, self.draft
        if draft.split_over == (tp.rank, tp.world):
            return
        if draft.split_over is not None:
            raise ValueError(f"the drafter is split over {draft.split_over[1]} ranks, the target over {tp.world}")
        reason = draft.split_reason(tp.world)
        if reason:
            log.warning("dflash: the drafter is replicated on each of the %d ranks (%s)", tp.world, reason)
            return
        draft.split(tp.rank, tp.world, tp.group)

    def _identity(self) -> str:
        """What must be the same on every rank of a tensor-parallel target: both configs, the drafter's weights (a
        checksum), the wrapper's geometry and the speculation policy's ``K`` set."""
        split = self.draft.split_over is not None  # already split by another wrapper: each rank holds its share
        with torch.no_grad():
            weights = [round(float(p.double().sum()), 6) for name, p in self.draft.named_parameters()
                       if type(p) in (nn.Parameter, torch.Tensor) and not (split and name.endswith(SPLIT_WEIGHTS))]
        return json.dumps([self.target.config.get_text_config().to_json_string(), self.draft.config.to_json_string(),
                           repr(self.draft.dflash_config), weights, self.draft.split_over and self.draft.split_over[1],
                           self.max_batch_size, self.max_seq_len, self.page_size, self.batch_buckets, self.context_buckets, list(self.speculative_ks),
                           type(self.policy).__name__])

    @property
    def block_size(self) -> int:
        return self.draft.block_size

    @property
    def verify_len(self) -> int:
        """The most tokens the target verifies in one step: the bonus and ``num_speculative_tokens`` drafts."""
        return self.num_speculative_tokens + 1

    def step_graphs(self) -> list[tuple[int, bool]]:
        """The ``(K, proposes)`` step variants the policy may run, per batch bucket and sampling mode: each ``K``
        (proposing when ``K > 0``), and ``K = 0`` proposing where speculation resumes after plain steps."""
        out = [(k, k > 0) for k in self.speculative_ks]
        if 0 in self.speculative_ks and max(self.speculative_ks) > 0:
            out.append((0, True))
        return sorted(set(out))

    sampling_inputs = SamplingInputs

    @classmethod
    def from_speculative_config(cls, target: nn.Module, speculative_config: dict | str, **kwargs):
        """A wrapper from vLLM's ``speculative_config`` (a dict or its JSON): ``{"method": "dflash", "model": DIR,
        "num_speculative_tokens": K}`` (``K`` fixed; without it, ``speculation="auto"``), optionally
        ``"num_speculative_tokens_per_batch_size": {"1-4": 7, "5-16": 2}`` (vLLM's inclusive batch-size ranges, each
        ``K`` clamped to ``num_speculative_tokens``); ``max_model_len`` sets ``max_seq_len``. The drafter is loaded
        from ``DIR`` (either checkpoint format) on the target's device and dtype. ``kwargs`` go to the constructor.
        Other methods, a missing model directory, ``K`` outside ``[0, block_size - 1]``, malformed ranges and keys
        it does not know are ``ValueError``."""
        cfg = json.loads(speculative_config) if isinstance(speculative_config, str) else dict(speculative_config)
        known = {"method", "model", "num_speculative_tokens", "num_speculative_tokens_per_batch_size", "max_model_len"}
        unknown = sorted(set(cfg) - known)
        if unknown:
            raise ValueError(f"speculative_config keys {unknown} are not supported ({', '.join(sorted(known))})")
        if cfg.get("method") != "dflash":
            raise ValueError(f"speculative_config method {cfg.get('method')!r} is not supported: only 'dflash'")
        if not cfg.get("model") or not Path(cfg["model"]).is_dir():
            raise ValueError(f"speculative_config model {cfg.get('model')!r} is not a drafter directory")
        p = next(target.parameters())
        tcfg = target.config.get_text_config()
        draft = DFlashDraftModel.from_pretrained(cfg["model"], dtype=p.dtype, device=p.device,
                                                 num_target_layers=len(decoder_layers(target)),
                                                 vocab_size=tcfg.vocab_size)
        if "max_model_len" in cfg:
            kwargs.setdefault("max_seq_len", cfg["max_model_len"])
        if "num_speculative_tokens_per_batch_size" in cfg:
            kwargs.setdefault("speculation", cfg["num_speculative_tokens_per_batch_size"])
        return cls(target, draft, cfg.get("num_speculative_tokens"), **kwargs)

    def batch_bucket(self, rows: int) -> int:
        """The smallest batch bucket that holds ``rows`` rows."""
        return next(b for b in self.batch_buckets if b >= rows)

    def close(self) -> None:
        """Remove this wrapper's forward hooks (and token stepping) from the target and drop its KV pools
        (idempotent). ``generate`` afterwards is an error; so is closing while requests are in flight. ``with
        DFlashSpecWrapper(...) as spec:`` closes on exit. Not done at garbage collection: that can land while dynamo
        traces another wrapper's step on the same target."""
        if self.scheduler.in_flight():
            raise RuntimeError("requests are still running on this wrapper: cancel or wait for them before close()")
        if self._steps is not None:  # a background compile traces through the hooks removed below: let it finish
            self._steps.wait()
        self.aux.remove()
        if self._stepping and not self._closed:
            unstep(self.target)
        self._cache = None
        self._closed = True

    def __enter__(self) -> "DFlashSpecWrapper":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def compile(self, backend="dflash", *, cache_dir=None, on_miss: str = "compile", mode=None,
                options: dict | None = None, fullgraph: bool = True, dynamic=None, **kwargs) -> None:
        """Run the step compiled by ``backend`` (a registered name such as ``"dflash"``, ``"dflash_neuron"``,
        ``"inductor"``, or a backend callable) from now on: one graph per step key — batch bucket, ``K``, greedy or
        sampled — serving every context length up to ``max_seq_len`` (``dflash_neuron``: one per context bucket
        too, its graphs are static). Graphs are compiled when a key is first met, or up front by
        :meth:`precompile`, and saved in the compile cache (``cache_dir``; default ``$DFLASH_COMPILE_CACHE_DIR``,
        else ``~/.cache/dflash_compile``), which later processes load from instead of compiling. ``on_miss``: what
        a step whose key has no graph yet does — ``"compile"`` it (default: the request waits), run the ``"eager"``
        step for that call, start compiling it on a ``"background"`` thread and run the eager step until it is
        ready, or raise (``"error"``). ``mode``/``options`` go to the backend. See ``compiled_step.py``.

        The step is always one full graph (``fullgraph=False`` is refused) and its shapes are fixed by the key
        (``dynamic`` other than None/False is refused)."""
        from .compiled_step import CompiledSteps

        if not fullgraph:
            raise ValueError("the DFlash step compiles as one full graph: fullgraph=False is not supported")
        if dynamic not in (None, False):
            raise ValueError("dynamic shapes are chosen per dimension by the wrapper (the context length); "
                             "leave dynamic unset")
        if kwargs:
            raise TypeError(f"compile() got unexpected arguments {sorted(kwargs)}")
        if self.tp is not None and on_miss == "background":
            raise ValueError("on_miss='background' is not supported with a tensor-parallel target: each rank would "
                             "switch from the eager to the compiled step at its own time; use 'compile' or "
                             "precompile()")
        self._steps = CompiledSteps(self, backend, cache_dir=cache_dir, on_miss=on_miss, mode=mode, options=options)

    @property
    def compiled(self) -> bool:
        return self._steps is not None

    def step(self, block, seq_lens, block_tables, active, target_pools, draft_pool, sampling=None, state_slots=None,
             propose: bool = True):
        """One step as the host loop runs it (``forward``'s arguments and results): once :meth:`compile` was called,
        through the compiled graph of its key (batch bucket, ``K``, proposes or not, greedy or sampled; loaded or
        compiled on a miss as ``on_miss`` says), else ``forward`` itself."""
        args = (block, seq_lens, block_tables, active, target_pools, draft_pool) + (
            (sampling,) if sampling is not None else ())
        kwargs = {"state_slots": state_slots} if state_slots is not None else {}
        if not propose:
            kwargs["propose"] = False
        if self._steps is None:
            return self(*args, **kwargs)
        key = self._steps.key(block.shape[0], block_tables.shape[1], sampling is not None, block.shape[1], propose)
        return self._steps.run(key, args, kwargs)

    def precompile(self, batch_sizes=None, *, sampling: bool | str = False, progress: bool = True) -> dict:
        """Compile (or load from the compile cache) every step graph a deployment will use, now, so that no
        request ever waits for a compile. ``batch_sizes``: the batch sizes to serve (default: every batch bucket;
        each is rounded up to its bucket); ``sampling``: False (greedy steps), True (sampled steps) or
        ``"both"``. Static-context backends (``dflash_neuron``) compile every context bucket too. A progress bar
        (tqdm) shows each key; returns ``{str(key): (how, seconds)}`` with ``how`` ``"compiled"``, ``"loaded"`` or
        ``"ready"`` (already in memory). Every step variant the speculation policy may use is compiled
        (:meth:`step_graphs`: with ``speculation="auto"`` and a drafter of block size 8, six per batch bucket and
        sampling mode). Call :meth:`compile` first."""
        from tqdm.auto import tqdm

        if self._steps is None:
            raise RuntimeError("precompile() needs a backend: call spec.compile(backend=...) first")
        if sampling not in (False, True, "both"):
            raise ValueError(f"sampling={sampling!r}: expected False, True or 'both'")
        bad = [b for b in (batch_sizes or []) if not isinstance(b, int) or not 1 <= b <= self.max_batch_size]
        if bad:
            raise ValueError(f"batch_sizes {bad} are outside [1, max_batch_size={self.max_batch_size}]")
        buckets = sorted({self.batch_bucket(b) for b in batch_sizes}) if batch_sizes else list(self.batch_buckets)
        modes = [False, True] if sampling == "both" else [bool(sampling)]
        pages = [None] if self._steps.serves_every_context else list(self.context_buckets)
        keys = [(b, p, m, v) for b in buckets for m in modes for p in pages for v in self.step_graphs()]
        cache = self.kv_cache()
        report = {}
        with tqdm(keys, desc="dflash precompile", unit="graph", disable=not progress) as bar:
            for b, p, m, (k, propose) in bar:
                key = self._steps.key(b, p or 2, m, k + 1, propose)
                bar.set_postfix_str(str(key))
                args, kwargs = self._example_step_inputs(cache, b, key.context_pages or 2, m, k, propose)
                how, seconds = self._steps.prepare(key, args, kwargs)
                report[str(key)] = (how, round(seconds, 2))
                bar.write(f"{key}: {how} in {seconds:.1f} s")
        return report

    def _example_step_inputs(self, cache, batch: int, pages: int, sampled: bool, K: int, propose: bool):
        """Step inputs of a key's shapes (every row inactive), to trace its graph."""
        device = cache.device
        long = dict(dtype=torch.long, device=device)
        args = [torch.zeros(batch, K + 1, **long), torch.zeros(batch, **long),
                torch.full((batch, pages), -1, **long), torch.zeros(batch, dtype=torch.bool, device=device),
                cache.target_pools, cache.draft_pool]
        if sampled:
            zeros = functools.partial(torch.zeros, device=device)
            args.append(self.sampling_inputs(
                zeros(batch, dtype=torch.bool), zeros(batch), zeros(batch, dtype=torch.long), zeros(batch),
                zeros(batch, dtype=torch.long)))
        kwargs = {"state_slots": torch.zeros(batch, **long)} if cache.has_states else {}
        if not propose:
            kwargs["propose"] = False
        return tuple(args), kwargs

    # ------------------------------------------------------------------ the step
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
        positions, in_capacity = self._block_positions(block, seq_lens, active)
        logits, aux, states = self._verify(
            block, positions, in_capacity, seq_lens, block_tables, active, target_pools, state_slots
        )
        tokens, num_accepted, bonus = self._accept(block, logits, positions, active, sampling)
        if states is not None:  # recurrent layers keep the state after the bonus and the accepted drafts
            states.commit(num_accepted)
        # Context rows for the drafter: the bonus and the accepted drafts; rejected rows write nowhere.
        accepted = torch.arange(block.shape[1], device=block.device) <= num_accepted[:, None]  # [Bk, B]
        self._inject(aux, positions, accepted & in_capacity, block_tables, draft_pool)
        if not propose:
            return tokens, num_accepted, bonus
        next_block = self._propose(bonus, seq_lens + num_accepted + 1, block_tables, active, draft_pool, sampling)
        return tokens, num_accepted, next_block

    # The step's phases (``forward`` is their composition; benchmarks time them one by one).
    def _block_positions(self, block, seq_lens, active):
        """Positions of the block's tokens ``[Bk, B]`` and which of them the caches may hold."""
        positions = seq_lens[:, None] + torch.arange(block.shape[1], device=block.device)
        return positions, (positions < self.max_seq_len) & active[:, None]

    def _verify(self, block, positions, in_capacity, seq_lens, block_tables, active, target_pools, state_slots=None):
        """The target over the block: ``(logits [Bk, B, V], context features [Bk, B, n_ids * H], StateAccess or
        None)``; recurrent layers run token by token and keep every position's state until ``commit``."""
        kv_lens = torch.clamp(seq_lens + block.shape[1], max=self.max_seq_len)  # [Bk]
        return self._target_forward(block, positions, in_capacity, kv_lens, block_tables, active, target_pools,
                                    state_slots=state_slots, stepped=True)

    def _accept(self, block, logits, positions, active, sampling=None):
        """Acceptance: ``(tokens [Bk, B] padded with -1, num_accepted [Bk], bonus [Bk, 1])``. The target's token
        after each block position (``positions + 1``): its argmax, or for sampled rows its position-keyed draw; the
        drafts that equal them are accepted, and the first that does not is replaced by the target's."""
        target_tokens = self._next_tokens(logits, positions + 1, sampling)
        tokens, num_accepted = greedy_accept(block[:, 1:], target_tokens)
        bonus = tokens.gather(1, num_accepted[:, None])  # [Bk, 1]: the token after the accepted drafts
        return torch.where(active[:, None], tokens, -1), torch.where(active, num_accepted, 0), bonus

    def _target_mask(self, positions, kv_lens, key_pos, padding=None):
        """The masks the target reads (``_mask_plan``): ``[Bk, 1, T, S]`` causal visibility over each row's written
        positions, windowed or chunked where the layers are; ``padding`` (``[Bk, T]``, True at real tokens, or
        None) for recurrent layers, which the model uses to zero left padding before it reaches the state.
        Bucket-padding rows see nothing; their outputs are ignored. A dict keyed as the model reads it, or one
        tensor for every layer."""
        built = {}
        for spec in dict.fromkeys(self._masks.values()):  # each distinct mask once, in a fixed order
            if spec is None or spec == ("padding",):
                continue
            m = context_visibility(positions, kv_lens, key_pos, True, spec[1], spec[2])[:, None]
            if self._eager_mask:  # eager attention adds its mask
                dtype = self.draft.fc.weight.dtype
                m = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(~m, torch.finfo(dtype).min)
            built[spec] = m
        built[("padding",)], built[None] = padding, None
        masks = {key: built[spec] for key, spec in self._masks.items()}
        return masks[None] if list(masks) == [None] else masks

    def _target_forward(self, ids, positions, write_ok, kv_lens, block_tables, active, target_pools, last_only=False,
                        state_slots=None, stepped=False):
        """Target over ``ids [Bk, T]`` at ``positions``; K/V land in the paged pool, recurrent states (``state_slots``)
        in theirs. -> (logits, aux hidden, ``StateAccess`` or None)."""
        write = write_slots(block_tables, positions, write_ok, self.page_size)
        kv_lens = torch.where(active, kv_lens, 0)
        read, key_pos = read_slots(block_tables, kv_lens, self.page_size)
        mask = self._target_mask(positions, kv_lens, key_pos, None if stepped else write_ok)
        states = StateAccess(state_slots, active, stepped) if state_slots is not None else None
        extra = {"logits_to_keep": 1} if last_only and self._logits_to_keep else {}
        self.aux.enabled = True  # the hooks record this forward only, and read() forgets it
        out = self.target(
            input_ids=ids,
            position_ids=positions,
            attention_mask=mask,
            cache=paged_target_cache(target_pools, write, read, states),
            use_cache=True,
            **extra,
        )
        self.aux.enabled = False
        return out.logits, self.aux.read(), states

    def _inject(self, aux, positions, valid, block_tables, draft_pool):
        """Project context rows to every draft layer's K/V and scatter them into the drafter pool."""
        ctx = self.draft.context_features(aux)  # [Bk, T, H]
        k, v = self.draft.context_kv(ctx, positions)  # [Ld, Bk, T, Hkv, D] each
        slots = write_slots(block_tables, positions, valid, self.page_size).flatten()  # [Bk * T]
        draft_pool[:, :, slots] = torch.stack([k, v], dim=1).flatten(2, 3)

    @staticmethod
    def _next_tokens(logits, positions, sampling=None):
        """The token at each of ``positions [Bk, T]`` given ``logits [Bk, T, V]`` for it: the argmax, or for rows
        that sample the Gumbel-max draw of the processed distribution keyed by (the row's seed, the position)."""
        tokens = logits.argmax(-1)
        if sampling is None:
            return tokens
        p = sampling
        drawn = sample_at_positions(process_logits(logits, p.temperature, p.top_k, p.top_p), p.seeds, positions)
        return torch.where(p.do_sample[:, None], drawn, tokens)

    def _propose(self, bonus, ctx_lens, block_tables, active, draft_pool, sampling=None):
        """Draft a block after ``bonus [Bk, 1]`` at position ``ctx_lens``; -> ``[Bk, B]``: the bonus and the
        ``B - 1`` drafts. A sampled row drafts with the noise the target will draw with at the same positions."""
        Bk, B = bonus.shape[0], self.block_size
        block = torch.cat([bonus, bonus.new_full((Bk, B - 1), self.draft.mask_token_id)], dim=1)
        positions = ctx_lens[:, None] + torch.arange(B, device=bonus.device)
        ctx_lens = torch.where(active, ctx_lens, 0)
        read, _ = read_slots(block_tables, ctx_lens, self.page_size)
        kv = draft_pool[:, :, read]  # [Ld, 2, Bk, S, Hkv, D]
        logits = self.draft(block, positions, kv[:, 0], kv[:, 1], ctx_lens)  # [Bk, B-1, V]
        drafts = self._next_tokens(logits, positions[:, 1:], sampling)  # [Bk, B-1]
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
        logits, aux, _ = self._target_forward(
            input_ids, positions, real, lens, block_tables, active, target_pools, last_only=True,
            state_slots=state_slots,
        )
        self._inject(aux, positions, real, block_tables, draft_pool)
        last = logits[:, -1:]  # [n, 1, V]: every row's prompt ends at the last column
        bonus = self._next_tokens(last, lens[:, None], sampling)  # [n, 1]: the token at position lens
        return self._propose(bonus, lens, block_tables, active, draft_pool, sampling)

    # ------------------------------------------------------------------ host loop
    def kv_cache(self, num_blocks: int | None = None) -> PagedKVCache:
        """The paged pools with at least ``num_blocks`` KV blocks (default: the capacity, ``max_batch_size`` requests
        of ``max_seq_len`` tokens), allocated on the target's device and dtype; grown in place, every block's
        contents kept, when more are needed while requests run."""
        p = next(self.target.parameters())
        num_blocks = num_blocks or self.max_batch_size * -(-self.max_seq_len // self.page_size)
        c = self._cache
        fits = c is not None and c.device == p.device and c.draft_pool.dtype == p.dtype
        if fits and c.num_blocks >= num_blocks:
            return c
        if c is not None and not fits and self.scheduler.in_flight():
            raise RuntimeError("the target moved to another device or dtype while requests are running")
        if self._layout is None or self._layout[0] != (p.device, p.dtype):  # what each target layer caches
            self._layout = ((p.device, p.dtype), probe_layout(self.target))
            self._masks = _mask_plan(self.target.config.get_text_config(), self._layout[1])
        layout = self._layout[1]
        if not self._stepping:  # recurrent mixers run token by token in verify (recurrent.py)
            step_by_token(self.target, layout)
            self._stepping = True
        dcfg = self.draft.config
        stateful = [i for i, lay in enumerate(layout) if isinstance(lay, StateLayout)]
        if self.prefix_caching and stateful and self._checked != self._layout[0]:  # said once per layout
            log.warning("prefix caching is off: target layers %s keep recurrent states, which are not kept at page "
                        "boundaries, so a cached prefix could not be resumed", stateful)
        pools = functools.partial(
            PagedKVCache,
            prefix_caching=self.prefix_caching and not stateful,
            max_batch_size=self.max_batch_size,
            max_seq_len=self.max_seq_len,
            page_size=self.page_size,
            target_layout=layout,
            draft_shape=(dcfg.num_hidden_layers, self.draft.num_kv_heads, dcfg.head_dim),
            dtype=p.dtype,
            num_blocks=num_blocks,
        )
        need = pools(device="meta").nbytes  # sized on the meta device: nothing allocated yet
        if fits:  # more requests in flight: grow, keeping every running request's blocks
            self._check_pool_bytes(need, num_blocks, p.device)
            c.grow(num_blocks)
            return c
        self._cache = None  # the old pools go first: the new ones are checked against the memory left
        self._check_pool_bytes(need, num_blocks, p.device)
        if self._checked != self._layout[0]:  # on small pools of its own, before the real ones exist
            self._check_paged_forward(functools.partial(pools, device=p.device))
            self._checked = self._layout[0]
        self._cache = pools(device=p.device)
        return self._cache

    @torch.no_grad()
    def _check_paged_forward(self, make_pools) -> None:
        """Before any work: the target over the paged pools gives its own logits. Two left-padded random prompts
        through a prefill and a 3-token stepped forward (the verify path), against the target's own forward over
        each whole sequence (no cache). A target that reads something the pools and masks do not carry (an
        attention window or positions of its own, state kept outside transformers' cache) or that fails under them
        is refused here with the reason, rather than giving other tokens or failing in a step. The prompts are
        longer than any window-like field of the config the masks do not already encode."""
        tcfg = self.target.config.get_text_config()
        encoded = {"sliding_window", "attention_chunk_size"}  # read by the masks (``_mask_plan``)
        windows = [v for k, v in vars(tcfg).items() if ("window" in k or "chunk" in k) and k not in encoded
                   and isinstance(v, int) and not isinstance(v, bool) and v > 0]
        new = 3
        long = min(max([2 * self.page_size + 3, *(w + 4 for w in windows)]), self.max_seq_len - new)
        lens = [long, max(1, min(5, long - 2))]
        if long < 2:
            return
        vocab = self.draft.config.vocab_size
        g = torch.Generator().manual_seed(0)
        seqs = [torch.randint(0, vocab - 2, (n + new,), generator=g).tolist() for n in lens]
        cache = make_pools(max_batch_size=2, num_blocks=sum(-(-(n + new) // self.page_size) for n in lens))
        device = cache.device
        rows = [0, 1]
        try:
            for r, n in zip(rows, lens):
                cache.ensure(r, n + new)
            tables = cache.block_table(rows)
            slots = torch.tensor([cache.state_slot(r) for r in rows], device=device)
            L = max(lens)
            ids = torch.tensor([[0] * (L - n) + q[:n] for q, n in zip(seqs, lens)], device=device)
            n_t = torch.tensor(lens, device=device)
            positions = torch.arange(L, device=device) - (L - n_t)[:, None]
            real = positions >= 0
            active = torch.ones(2, dtype=torch.bool, device=device)
            try:
                pre, aux, _ = self._target_forward(ids, positions.clamp(min=0), real, n_t, tables, active,
                                                   cache.target_pools, state_slots=slots)
                step_ids = torch.tensor([q[n:] for q, n in zip(seqs, lens)], device=device)
                step_pos = n_t[:, None] + torch.arange(new, device=device)
                step, _, _ = self._target_forward(step_ids, step_pos, step_pos >= 0, n_t + new, tables, active,
                                                  cache.target_pools, state_slots=slots, stepped=True)
            except Exception as e:
                raise ValueError(f"the target fails over the paged cache ({type(e).__name__}: {e}): it reads or "
                                 f"stores something transformers' cache seams do not carry here") from e
            width = len(self.draft.dflash_config.target_layer_ids) * self.draft.config.hidden_size
            if tuple(aux.shape) != (2, L, width):
                raise ValueError(f"the target's decoder layers give hidden states the drafter cannot read: "
                                 f"{tuple(aux.shape)} for its layers {list(self.draft.dflash_config.target_layer_ids)}"
                                 f" over 2 prompts of {L} tokens, expected {(2, L, width)} ([batch, tokens, hidden] "
                                 f"per layer)")
            worst = 0.0
            for i, (q, n) in enumerate(zip(seqs, lens)):
                # positions from 0, given as HF's generate gives them (RoBERTa-like models offset their own)
                ref = self.target(input_ids=torch.tensor([q], device=device),
                                  position_ids=torch.arange(len(q), device=device)[None]).logits[0].float()
                ours = torch.cat([pre[i, L - n:], step[i]]).float()
                scale = 1.0 + ref.abs().max().item()
                worst = max(worst, (ours - ref).abs().max().item() / scale)
            tol = 1e-3 if pre.dtype == torch.float32 else 5e-2
            if not worst <= tol:
                raise ValueError(
                    f"the target's logits over the paged cache differ from its own forward (largest difference "
                    f"{worst:.2g} of the logits' scale, tolerance {tol:g}, prompts of {lens} tokens + {new}): it reads "
                    f"something the cache and masks do not carry (an attention window or positions of its own"
                    + (f", e.g. {', '.join(k for k, v in vars(tcfg).items() if v in windows and 'window' in k)}"
                       if windows else "")
                    + ", or state kept outside transformers' cache)")
        finally:
            for r in rows:
                cache.free(r)

    def _check_pool_bytes(self, need: int, num_blocks: int, device) -> None:
        allowed = self.max_cache_bytes if self.max_cache_bytes is not None else available_memory(device)
        if allowed is not None and need > allowed:
            raise ValueError(
                f"the KV pools need {need} bytes ({num_blocks} blocks of {self.page_size} tokens), more than "
                + (f"max_cache_bytes={allowed}" if self.max_cache_bytes is not None
                   else f"the {allowed} bytes available on {device}")
                + ": fewer or shorter concurrent requests (max_batch_size, max_seq_len, max_new_tokens) need less"
            )

    def prefix_cache_stats(self) -> dict:
        """Prefix caching's counters: ``queries`` (prompts looked up), ``query_tokens``, ``hit_tokens`` (prompt
        tokens whose K/V were reused rather than prefilled), ``evicted_blocks``, and ``cached_blocks`` now."""
        c = self._cache
        if c is None:
            return {"queries": 0, "query_tokens": 0, "hit_tokens": 0, "evicted_blocks": 0, "cached_blocks": 0}
        return {**{k: c.prefix_stats[k] for k in ("queries", "query_tokens", "hit_tokens", "evicted_blocks")},
                "cached_blocks": c.num_cached_blocks}

    def kv_cache_bytes(self) -> int:
        """Bytes the KV pools hold now (0 before the first ``generate``)."""
        return self._cache.nbytes if self._cache is not None else 0

    def context_bucket(self, num_tokens: int) -> int:
        """Pages a step over ``num_tokens`` positions gets: the live pages (at least 2) when the compiled step serves
        every context length, else those of the smallest context bucket that holds them (capped at capacity)."""
        need = -(-min(num_tokens, self.max_seq_len) // self.page_size)
        if self._steps is not None and self._steps.serves_every_context:
            return min(max(need, 2), -(-self.max_seq_len // self.page_size))  # one graph for all: the live pages
        return next(b for b in self.context_buckets if b >= need)

    def generate(
        self,
        input_ids,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int | None = _UNSET,
        eos_token_id=_UNSET,
        pad_token_id: int | None = _UNSET,
        return_dict_in_generate: bool = False,
        *,
        streamer=None,
        tokenizer=None,
        seed: int | list[int] | None = None,
        generator: torch.Generator | list[torch.Generator] | None = None,
        output_drafts: bool = False,
        **kwargs,
    ):
        """Generate like HF ``generate``.

        ``input_ids`` is a ``[B, L]`` tensor, left-padded with ``attention_mask`` (HF convention), or a list of
        token-id lists. Returns ``[B, L + new]`` (prompt included, finished rows padded with
        ``pad_token_id``), or with ``return_dict_in_generate=True`` a ``DFlashGenerateOutput``.

        HF arguments: ``generation_config``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
        ``max_length``, ``stop_strings`` (needs ``tokenizer``), ``streamer`` (``put``/``end``, batch size 1).
        Sampling is lossless and reproducible per request whatever ``K`` each step verifies
        (see below): ``seed`` (an int for the whole batch, or one per request) or ``generator`` (one
        ``torch.Generator``, or one per request) seeds each request's own RNG; with neither, the seeds come from
        torch's global RNG (``torch.manual_seed``).
        ``output_drafts=True`` (with ``return_dict_in_generate``) records the drafts each step verified in the
        output's ``drafts``.

        Thread-safe: calls from several threads share one continuous batch (``submit`` underneath; see
        ``scheduler.py``), and each gets exactly what it would get alone (sampled requests: given the same ``K`` at
        every step, as with a fixed ``num_speculative_tokens``; ``speculation="auto"`` chooses ``K`` from the whole
        batch, and a sampled request's draws follow its steps' ``K``, so only its law is the same).
        """
        if output_drafts and not return_dict_in_generate:
            raise ValueError("output_drafts=True needs return_dict_in_generate=True")
        prompts, prefix, args, generators = self._requests(
            input_ids, attention_mask, streamer, tokenizer, seed, generator, output_drafts,
            dict(kwargs, **{k: v for k, v in (("max_new_tokens", max_new_tokens), ("eos_token_id", eos_token_id),
                                              ("pad_token_id", pad_token_id)) if v is not _UNSET}),
        )
        handles = self.scheduler.submit_together(prompts, args, generators)
        try:
            results = [h.result() for h in handles]
        except BaseException:  # this call fails (or is interrupted): its other rows leave the batch too
            for h in handles:
                h.cancel()
            raise
        width = max(len(r.tokens) for r in results)
        pad = args.pad_token_id if args.pad_token_id is not None else 0  # only used when width allows no pad
        new = torch.tensor([r.tokens + [pad] * (width - len(r.tokens)) for r in results], dtype=torch.long)
        device = next(self.target.parameters()).device
        sequences = torch.cat([prefix.cpu(), new], dim=1).to(device)
        if not return_dict_in_generate:
            return sequences
        return DFlashGenerateOutput.build(
            sequences, [r.stats for r in results], [r.finish_reason for r in results], self.num_speculative_tokens,
            [len(r.tokens) for r in results], prefix.shape[1], [r.drafts for r in results] if output_drafts else None,
        )

    def submit(self, input_ids, attention_mask=None, *, streamer=None, tokenizer=None, seed: int | None = None,
               generator: torch.Generator | None = None, output_drafts: bool = False, **generation_kwargs):
        """Queue ONE prompt (a token list, a 1-D tensor or a ``[1, L]`` tensor) with ``generate``'s arguments and
        return a ``RequestHandle`` at once: iterate over it for the new tokens as they are accepted,
        ``handle.result()`` for a ``RequestResult`` (tokens, finish reason, counters, drafts), ``handle.cancel()``
        to make it leave at the next step (its KV blocks are freed). Any thread; requests join the running batch
        at the next step. Invalid arguments raise here, in the caller's thread."""
        prompts, _, args, generators = self._requests(
            input_ids, attention_mask, streamer, tokenizer, seed, generator, output_drafts, generation_kwargs,
            single=True,
        )
        return self.scheduler.submit(prompts[0], args, generators[0])

    def _requests(self, input_ids, attention_mask, streamer, tokenizer, seed, generator, output_drafts, kwargs,
                  single=False):
        """Validate a call's arguments (before any model work) -> (prompts, the left-padded prefix, its
        ``GenerationArgs``, one generator per prompt or None)."""
        if self._closed:
            raise RuntimeError("this DFlashSpecWrapper is closed (its hooks on the target are removed): make a new one")
        # ``kwargs`` holds only what the caller gave: an explicit None means what it means in HF (``eos_token_id=None``:
        # never stop on eos). The lengths count the (padded) prompt width, as HF's do.
        args = resolve_generation_args(self.target, _prompt_width(input_ids), kwargs)
        # Without an attention_mask, HF masks the pad tokens, unless pad is an eos id (after its eos fallback).
        pad = args.pad_token_id if args.pad_token_id not in (None, *args.eos_token_ids) else None
        prompts, prefix = self._prompts(input_ids, attention_mask, pad)
        if single and len(prompts) != 1:
            raise ValueError(f"submit takes one prompt, got {len(prompts)}: submit each, or use generate")
        vocab = self.draft.config.vocab_size
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if len(p) > self.max_seq_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens, more than max_seq_len={self.max_seq_len}")
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {vocab})")
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
        if args.do_sample and not (self.tp is not None and seed is None and generator is None):
            generators = request_generators(len(prompts), seed, generator)
        else:  # greedy; or tensor-parallel and unseeded: the scheduler seeds it from rank 0 when it joins
            generators = [None] * len(prompts)
        if prefix is None:
            prefix = _left_pad(prompts, args.pad_token_id)
        if streamer is not None:
            streamer.put(prefix.cpu())  # HF pushes the prompt first (TextStreamer(skip_prompt=True) drops it)
        args = dataclasses.replace(args, tokenizer=tokenizer, streamer=streamer, output_drafts=output_drafts)
        return prompts, prefix, args, generators

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


def _prompt_width(input_ids) -> int:
    """The width of ``input_ids`` as HF's length arguments count it (the padded tensor's, or the longest prompt's); 0
    for input ``_prompts`` will refuse."""
    if isinstance(input_ids, torch.Tensor):
        return input_ids.shape[-1] if input_ids.dim() else 0
    if isinstance(input_ids, (list, tuple)) and input_ids:
        if isinstance(input_ids[0], numbers.Number):
            return len(input_ids)
        return max((len(p) if hasattr(p, "__len__") else 0) for p in input_ids)
    return 0


def check_tokenizer(tokenizer, target: nn.Module) -> None:
    """A tokenizer whose vocabulary is larger than the target's cannot be used with it: ``ValueError``."""
    vocab = target.config.get_text_config().vocab_size
    if len(tokenizer) > vocab:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens but the target's vocabulary has {vocab}: "
            f"they do not belong together"
        )


def _left_pad(prompts: list[list[int]], pad: int | None) -> torch.Tensor:
    width = max(len(p) for p in prompts)
    return torch.tensor([[pad] * (width - len(p)) + p for p in prompts], dtype=torch.long)
