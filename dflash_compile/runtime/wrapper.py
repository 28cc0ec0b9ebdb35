"""DFlashSpecWrapper: a Hugging Face causal LM and a DFlash drafter, generating losslessly together.

A facade over rooms with one job each: ``step/step.py`` (the one step, the only thing compiled), ``requests.py``
(a call's arguments made into requests), ``target_check.py`` (the pair and the target checked before any work),
``cache_manager.py`` (what the target caches, the pools), ``compiled_steps.py`` (graphs per key, the compile
cache), ``scheduler.py`` (the continuous batch, on its own thread), ``speculation.py`` (each step's ``K``) and
``distributed.py`` (tensor-parallel ranks in lockstep). docs/architecture.md draws it.
"""

from __future__ import annotations


import torch
from torch import nn

from ..models.draft_model import DFlashDraftModel
from ..models.hidden_states import AuxHiddenStates
from ..paged.pools import PagedKVCache
from ..primitives.masks import MaskSpec
from ..primitives.slots import pages
from ..step.step import DFlashStep
from . import openmp
from .cache_manager import CacheManager
from .distributed import TensorParallel, rank_identity, split_drafter
from .generation import generate_output
from .requests import RequestMaker
from .scheduler import Scheduler
from .speculation import SpeculationPolicy, make_policy, read_speculative_config
from .target_check import check_attention, check_heads_divide, validate_pair

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16)
_UNSET = object()  # ``generate``'s default for arguments where an explicit None means something (as in HF)


def _context_pages(buckets, max_seq_len: int, page_size: int) -> tuple[int, ...]:
    """Context buckets in tokens -> sorted page counts, capacity included (default: 128, 256, ... tokens)."""
    full = pages(max_seq_len, page_size)
    if buckets is None:
        buckets, tokens = [], 128
        while tokens < max_seq_len:
            buckets.append(tokens)
            tokens *= 2
    bad = [b for b in buckets if not isinstance(b, int) or b < 1]
    if bad:
        raise ValueError(f"context_buckets must be positive token counts, got {bad}")
    return tuple(sorted({min(pages(b, page_size), full) for b in buckets} | {full}))


class DFlashSpecWrapper(nn.Module):
    """A target causal LM and its DFlash drafter over one paged KV cache.

    Args:
        target: any HF causal LM (``sdpa`` or ``eager`` attention).
        draft: a ``DFlashDraftModel`` for it (bound to ``target`` here).
        num_speculative_tokens: ``K``, the drafts every step verifies, ``0 <= K <= block_size - 1`` (``0``: plain
            decoding). The drafter always drafts its whole block; a smaller ``K`` verifies only its first ``K``
            drafts, a shorter target forward. Given, it fixes ``K`` (unless ``speculation`` says otherwise, where it
            is the largest ``K`` used); not given, ``speculation="auto"`` chooses.
        speculation: how each step's ``K`` is chosen (``runtime/speculation.py``): ``"auto"`` (the default without
            ``num_speculative_tokens``: the ``K`` that maximises the batch's expected tokens per second, from step
            costs measured on this machine and each request's acceptance), ``"fixed"``, a vLLM
            ``num_speculative_tokens_per_batch_size`` dict (``{"1-4": 7, "5-16": 1}``) or a ``SpeculationPolicy``.
            Every ``K`` it may use is its own step graph (``spec.speculative_ks``).
        max_batch_size: the most requests decoded at once (larger batches are queued).
        max_seq_len: capacity per request, prompt included (default: ``min(max_position_embeddings, 2048)``).
        page_size: KV block size, in tokens.
        batch_buckets: step batch sizes; a step runs at the smallest bucket that holds the live requests.
        context_buckets: context lengths, in tokens, a step's attention spans (default 128, 256, ... up to
            ``max_seq_len``). Compiled with ``dflash`` or ``inductor`` one graph per batch bucket serves every context
            length; ``dflash_neuron`` compiles one static graph per (batch bucket, context bucket).
        max_cache_bytes: the most the KV pools may take (default: the memory available on the target's device).
            Eager, they hold what the requests in flight can need and grow in place; compiled, they are allocated at
            the capacity (``max_batch_size`` requests of ``max_seq_len`` tokens). Pools that do not fit are a
            ``ValueError`` naming the bytes, before anything is allocated (docs/architecture.md, "Memory").
        prefix_caching: keep every prompt's full KV pages, hashed as a chain, after their requests finish; a
            request whose prompt starts with cached pages prefills only the rest (evicted least-recently-used; off
            for targets with recurrent-state layers; ``prefix_cache_stats()``). Greedy output is unchanged.

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
        check_attention(target)
        if max_batch_size < 1 or page_size < 1:
            raise ValueError(f"max_batch_size and page_size must be >= 1, got {max_batch_size}, {page_size}")
        self.max_batch_size, self.page_size = max_batch_size, page_size
        self.max_seq_len = max_seq_len or min(target.config.get_text_config().max_position_embeddings, 2048)
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        if draft.block_size > self.max_seq_len:  # a block must fit in a request's capacity
            raise ValueError(
                f"the drafter's block_size {draft.block_size} is larger than max_seq_len={self.max_seq_len}, the "
                f"tokens a request may hold: a block that long can never be verified")
        self.batch_buckets = tuple(sorted({b for b in batch_buckets if 0 < b < max_batch_size} | {max_batch_size}))
        self.context_buckets = _context_pages(context_buckets, self.max_seq_len, page_size)
        self.policy = make_policy(speculation, num_speculative_tokens, draft.block_size)
        self.speculative_ks = self.policy.ks(draft.block_size)
        bad = [k for k in self.speculative_ks if not 0 <= k <= draft.block_size - 1]
        if not self.speculative_ks or bad:
            raise ValueError(f"speculation policy K values {bad or '(none)'} are outside [0, {draft.block_size - 1}]")
        self.num_speculative_tokens = max(self.speculative_ks)  # the most a step verifies (sizes the pools)
        self.target = target
        self.tp = TensorParallel.of(target)  # a tensor-parallel target: ranks run in lockstep (distributed.py)
        self.draft = draft.bind_target(target)
        self.aux = AuxHiddenStates(target, draft.dflash_config.target_layer_ids, enabled=False)
        try:
            self._build_rooms(max_cache_bytes, prefix_caching)
        except BaseException:  # refused: nothing of this wrapper stays on the user's target
            self.aux.remove()
            raise

    def _build_rooms(self, max_cache_bytes, prefix_caching) -> None:
        tcfg = self.target.config.get_text_config()
        self.dflash_step = DFlashStep(self.target, self.draft, self.aux, self.max_seq_len, self.page_size,
                                      {None: MaskSpec()})  # the mask plan is completed when the target is probed
        self.scheduler = Scheduler(self)
        self.pools = CacheManager(self.dflash_step, max_batch_size=self.max_batch_size, max_seq_len=self.max_seq_len,
                                  page_size=self.page_size, max_cache_bytes=max_cache_bytes,
                                  prefix_caching=bool(prefix_caching), busy=self.scheduler.in_flight)
        self._request_maker = RequestMaker(self.target, self.draft.config.vocab_size, self.max_seq_len,
                                           seeded_by_rank0=self.tp is not None)
        self.compiled_steps = None  # CompiledSteps once compile() is called
        self._closed = False
        if self.tp is not None:
            check_heads_divide(tcfg, self.tp.world)
            self.tp.check_same("target, drafter and wrapper configuration", rank_identity(self))
            split_drafter(self.draft, self.tp)

    @property
    def block_size(self) -> int:
        return self.draft.block_size

    @property
    def verify_len(self) -> int:
        """The most tokens the target verifies in one step: the bonus and ``num_speculative_tokens`` drafts."""
        return self.num_speculative_tokens + 1

    @property
    def prefix_caching(self) -> bool:
        return self.pools.prefix_caching

    @property
    def max_cache_bytes(self) -> int | None:
        return self.pools.max_cache_bytes

    def step_graphs(self) -> list[tuple[int, bool]]:
        """The ``(K, proposes)`` step variants the policy may run, per batch bucket and sampling mode: each ``K``
        (proposing when ``K > 0``), and ``K = 0`` proposing where speculation resumes after plain steps."""
        out = [(k, k > 0) for k in self.speculative_ks]
        if 0 in self.speculative_ks and max(self.speculative_ks) > 0:
            out.append((0, True))
        return sorted(set(out))

    @classmethod
    def from_speculative_config(cls, target: nn.Module, speculative_config: dict | str, **kwargs):
        """A wrapper from vLLM's ``speculative_config`` (a dict or its JSON): ``{"method": "dflash", "model": DIR,
        "num_speculative_tokens": K}`` (``K`` fixed; without it, ``speculation="auto"``), optionally
        ``"num_speculative_tokens_per_batch_size": {"1-4": 7, "5-16": 2}`` (vLLM's inclusive batch-size ranges, each
        ``K`` clamped to ``num_speculative_tokens``); ``max_model_len`` sets ``max_seq_len``. The drafter is loaded
        from ``DIR`` (either checkpoint format) on the target's device and dtype. ``kwargs`` go to the constructor.
        Other methods, a missing model directory, ``K`` outside ``[0, block_size - 1]``, malformed ranges and keys
        it does not know are ``ValueError``."""
        draft, K, kwargs = read_speculative_config(target, speculative_config, kwargs)
        return cls(target, draft, K, **kwargs)

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
        if self.compiled_steps is not None:  # a background compile traces through the hooks removed below
            self.compiled_steps.wait()
        self.aux.remove()
        self.pools.release()
        self._closed = True

    def __enter__(self) -> "DFlashSpecWrapper":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def compile(self, backend="dflash", *, cache_dir=None, on_miss: str = "compile", mode=None,
                options: dict | None = None, fullgraph: bool = True, dynamic=None, regions: bool | None = None,
                workers: int | None = None, **kwargs) -> None:
        """Run the step compiled by ``backend`` (``"dflash"``, ``"dflash_neuron"``, ``"inductor"``, or a backend
        callable) from now on: one full graph per step key (batch bucket, greedy or sampled, ``K = 0`` or every
        ``K >= 1``; every context length up to ``max_seq_len``; ``dflash_neuron``'s are static: one per ``K`` and
        context bucket). ``generate`` and ``submit`` ready the graphs their batch may step through before it steps,
        :meth:`precompile` up front; they are saved in the compile cache (``cache_dir``; default
        ``$DFLASH_COMPILE_CACHE_DIR``, else ``~/.cache/dflash_compile``) that later processes load. ``on_miss`` (a
        key with no graph yet): ``"compile"`` it (default), run the ``"eager"`` step, compile it on a
        ``"background"`` thread while the eager step serves, or raise (``"error"``). ``mode``/``options`` go to the
        backend. ``regions``: each distinct decoder layer compiled once (``runtime/regions.py``); None: for stacks
        of 16 layers or more, not tensor-parallel or recurrent targets. ``workers``: how many graphs compile at once,
        each in a forked process (``runtime/compile_workers.py``; CPU models, Linux; default
        ``$DFLASH_COMPILE_WORKERS``, else the usable CPUs; 1: one after the other here). ``fullgraph=False`` and
        ``dynamic`` other than None/False are refused. See ``runtime/compiled_steps.py``."""
        from .compiled_steps import compiled_steps_for

        self.compiled_steps = compiled_steps_for(self, backend, cache_dir=cache_dir, on_miss=on_miss, mode=mode,
                                                 options=options, fullgraph=fullgraph, dynamic=dynamic,
                                                 regions=regions, workers=workers, **kwargs)
        self.compiled_steps.listeners.append(self.scheduler.graph_event)  # a step that compiled is not timed
        self.pools.check_record = self.compiled_steps.check_record

    @property
    def compiled(self) -> bool:
        return self.compiled_steps is not None

    def step(self, block, seq_lens, block_tables, active, target_pools, draft_pool, sampling=None, state_slots=None,
             propose: bool = True):
        """One step as the host loop runs it (``DFlashStep.forward``'s arguments and results): once :meth:`compile`
        was called, through the compiled graph of its key (batch bucket, ``K``, proposes or not, greedy or sampled;
        loaded or compiled on a miss as ``on_miss`` says), else eagerly; under ``torch.no_grad()`` either way (the
        compiled graphs are guarded on grad mode)."""
        args = (block, seq_lens, block_tables, active, target_pools, draft_pool) + (
            (sampling,) if sampling is not None else ())
        kwargs = {"state_slots": state_slots} if state_slots is not None else {}
        if not propose:
            kwargs["propose"] = False
        if self.compiled_steps is None:
            return self.dflash_step(*args, **kwargs)
        with torch.no_grad():
            return self.compiled_steps.step(args, kwargs, propose)

    def precompile(self, batch_sizes=None, *, sampling: bool | str = False, progress: bool = True) -> dict:
        """Compile (or load from the compile cache) every step graph a deployment will use, now, with a progress bar
        (tqdm). ``batch_sizes``: the batch sizes to serve (default: every batch bucket); ``sampling``: False, True
        or ``"both"``; static-context backends (``dflash_neuron``) compile every context bucket too. Every
        (:meth:`step_graphs`) variant the policy may use: with ``dflash``/``inductor`` two graphs per sampling mode
        under ``speculation="auto"`` for one row, and two for every bucket from 2 rows (``StepKeys.open_batch``). Returns ``{str(key): (how, seconds)}``, ``how`` one of
        ``"compiled"``, ``"loaded"``, ``"ready"``. Call :meth:`compile` first. The calling thread's idle OpenMP
        workers are released at the end (``runtime/openmp.py``: the steps run on the scheduler's thread)."""
        if self.compiled_steps is None:
            raise RuntimeError("precompile() needs a backend: call spec.compile(backend=...) first")
        try:
            return self.compiled_steps.precompile(batch_sizes, sampling, progress)
        finally:
            openmp.release_idle_team()

    # ------------------------------------------------------------------ pools
    def kv_cache(self, num_blocks: int | None = None) -> PagedKVCache:
        """The paged pools with at least ``num_blocks`` KV blocks (default: the capacity, ``max_batch_size`` requests
        of ``max_seq_len`` tokens), allocated on the target's device and dtype (``CacheManager.pools``)."""
        return self.pools.pools(num_blocks)

    def prefix_cache_stats(self) -> dict:
        """Prefix caching's counters (``CacheManager.prefix_cache_stats``)."""
        return self.pools.prefix_cache_stats()

    def kv_cache_bytes(self) -> int:
        """Bytes the KV pools hold now (0 before the first ``generate``)."""
        return self.pools.nbytes

    def context_bucket(self, num_tokens: int) -> int:
        """Pages a step over ``num_tokens`` positions gets: the live pages (at least 2) when the compiled step serves
        every context length, else those of the smallest context bucket that holds them (capped at capacity)."""
        need = pages(min(num_tokens, self.max_seq_len), self.page_size)
        if self.compiled_steps is not None and self.compiled_steps.keys.serves_every_context:
            return min(max(need, 2), pages(self.max_seq_len, self.page_size))  # one graph for all: the live pages
        return next(b for b in self.context_buckets if b >= need)

    # ------------------------------------------------------------------ requests
    def _requests(self, *args, **kwargs):
        if self._closed:
            raise RuntimeError("this DFlashSpecWrapper is closed (its hooks on the target are removed): make a new one")
        return self._request_maker(*args, **kwargs)

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
        ``runtime/scheduler.py``), and each gets exactly what it would get alone, greedy or seeded sampling, whatever
        ``K`` each step verifies and whoever shares the batch (the draws are keyed by position, not by step).
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
        return generate_output(results, prefix, args.pad_token_id, next(self.target.parameters()).device,
                               return_dict_in_generate, output_drafts, self.num_speculative_tokens)

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
