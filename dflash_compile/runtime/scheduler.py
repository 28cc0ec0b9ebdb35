"""The host side of generation: requests from any number of threads share one continuous batch.

Threading model. Each ``DFlashSpecWrapper`` owns one ``Scheduler``. ``submit`` may be called from any thread: it
queues the request and returns a ``RequestHandle`` at once. One driver thread per wrapper (started on demand,
gone when no request is left) runs the loop: at every step boundary it drops cancelled requests, admits the
queued ones that fit (prefilled together: one forward per run of similar prompt lengths, ``prefill_groups``) and
runs one step of everything running. So requests that arrive separately share the batch, each at the next step
after it arrives. The driver runs the steps with the intra-op thread count (``torch.get_num_threads()``) of the
thread that submitted last (OpenMP's team size is per thread: a new thread would get the process default), and a
submitting thread releases its own idle OpenMP workers (``openmp.py``: two teams on as many cores make every
parallel region of a step wait for a sleeping worker).
Everything a request produces (tokens, its streamer's calls, its finish) is its own: a
streamer that raises fails that request alone, and the others' rows never see its tokens (row outputs do not
depend on other rows). An error the driver cannot pin on one request (the step itself failing) fails every
request in flight, frees all their blocks and leaves the wrapper usable. A compiled wrapper's steps call their
key's ahead-of-time compiled graph (``compiled_steps.py``) directly, with no dynamo frame evaluation and no global
state, so wrappers step concurrently; only tracing a new graph takes a process-wide lock.

A request's KV blocks and recurrent-state slot are freed when it finishes, fails or is cancelled. Pools grow
(contents kept) when the requests in flight need more blocks than they hold; compiled, they are allocated at
capacity once, so a pool's shape never changes under a compiled graph.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from ..step.step import SamplingInputs
from . import openmp
from .batch import Batch
from .generation import GenerationArgs
from .handles import Request, RequestHandle
from .ranks import ranks_for
from .speculation import StepView


@dataclass
class StepPlan:
    """What one step runs: the policy's view, ``K``, whether it proposes, the bucket and the step's inputs; the
    drafts it verifies (``output_drafts``) and the first drafts (for the policy, when ``K = 0``)."""

    view: StepView
    K: int
    propose: bool
    sampled: bool
    bucket: int
    inputs: tuple
    verified: list | None = None
    first_draft: torch.Tensor | None = None


@dataclass
class StepResult:
    """What one step gave: each row's tokens (padded with -1), the accepted counts, the next block, its time (None
    when it is not the step's cost) and whether each row's first draft was the target's token."""

    tokens: list[list[int]]
    num_accepted: torch.Tensor
    next_block: torch.Tensor
    seconds: float | None
    agreed: list


class Scheduler:
    """Admission, buckets, emission and per-step sampling inputs for one ``DFlashSpecWrapper`` (threads: the module
    docstring); host decisions tensor-parallel ranks share go through ``self.ranks`` (``ranks.py``)."""

    def __init__(self, spec):
        self.spec = spec
        self.ranks = ranks_for(spec.tp, spec.max_batch_size)
        self._lock = threading.Lock()
        self._waiting: deque[Request] = deque()
        self._driver: threading.Thread | None = None
        self._joining = 0  # requests taken off the queue and not yet in the batch (being admitted)
        self._joining_modes: set[bool] = set()  # their do_sample values
        self._announced = 0  # requests whose callers are readying graphs, not queued yet (``graphs_ready``)
        self._announced_modes = {False: 0, True: 0}  # the same, by do_sample
        self._ids = itertools.count()
        self.batch: Batch | None = None
        self.cache = None
        self._threads = torch.get_num_threads()  # intra-op threads of the latest submitting thread
        self._timed: set[tuple] = set()  # step variants already run once (their first call is not timed)
        self._graph_events = 0  # graphs the compiled steps compiled or loaded (``graph_event``)

    def graph_event(self, key, how: str, seconds: float) -> None:
        """The compiled steps compiled, loaded or ran eagerly ``key``'s graph: that step's time is not its cost."""
        self._graph_events += 1

    # ------------------------------------------------------------------ any thread
    def submit(self, prompt: list[int], args: GenerationArgs, generator: torch.Generator | None = None) -> RequestHandle:
        """Queue one validated request; it joins the running batch at the next step."""
        return self.submit_together([prompt], args, [generator])[0]

    def submit_together(self, prompts: list[list[int]], args: GenerationArgs,
                        generators: list[torch.Generator | None]) -> list[RequestHandle]:
        """Queue validated requests atomically (admitted, prefilled together, in one step as far as rows allow)."""
        requests = [Request(next(self._ids), list(p), args, g) for p, g in zip(prompts, generators, strict=True)]
        handles = [RequestHandle(r) for r in requests]
        with graphs_ready(self, len(requests), args.do_sample), self._lock:
            self._waiting.extend(requests)
            self._threads = torch.get_num_threads()  # the caller's: the driver runs the steps with as many
            if self._driver is None:
                self._driver = threading.Thread(target=self._drive, name="dflash-scheduler")  # exit waits for it
                self._driver.start()
            driver = self._driver
        if threading.current_thread() is not driver:  # the driver's team the only one while the caller waits
            openmp.release_idle_team()
        return handles

    def _modes(self) -> set[bool]:  # do_sample of the requests queued, joining, running or being readied (lock held)
        rows = list(self._waiting) + (self.batch.rows if self.batch is not None else [])
        joining = self._joining_modes if self._joining else set()
        return {r.args.do_sample for r in rows} | joining | {m for m, n in self._announced_modes.items() if n}

    def _rows(self) -> int:  # queued, joining and running (the lock held)
        return len(self._waiting) + self._joining + (len(self.batch.rows) if self.batch is not None else 0)

    def in_flight(self) -> int:
        with self._lock:
            return self._rows()

    def idle(self) -> bool:
        with self._lock:
            return self._driver is None

    def prefill_batch(self, prompts: list[list[int]], args: GenerationArgs, K: int | None = None,
                      propose: bool = True) -> tuple[int, tuple]:
        """Admit ``prompts`` together on the calling thread, no step run: ``(bucket, the inputs of a step verifying
        K drafts)`` as the driver would build them (for benchmarks and tests; nothing may be in flight)."""
        if self.in_flight():
            raise RuntimeError("prefill_batch needs an idle scheduler")
        new = [Request(next(self._ids), list(p), args) for p in prompts]
        for r in new:
            RequestHandle(r)  # each request's handle (nobody waits on it)
        with torch.no_grad():
            self._admit(new)
        return self._step_inputs(K, propose)

    # ------------------------------------------------------------------ the driver thread
    def _drive(self) -> None:
        incoming: list[Request] = []
        try:
            with torch.no_grad():
                while True:
                    if torch.get_num_threads() != self._threads:  # a thread's OpenMP team size is its own: a
                        torch.set_num_threads(self._threads)  # new thread would run with the process default
                    admit, seed, busy = self.ranks.admission(self)
                    with self._lock:
                        running = self.batch.rows if self.batch is not None else []
                        free = self.spec.max_batch_size - len(running)
                        n = min(free, len(self._waiting)) if admit is None else admit
                        incoming = [self._waiting.popleft() for _ in range(n)]
                        self._joining = len(incoming)
                        self._joining_modes = {r.args.do_sample for r in incoming}
                        if not incoming and not running and self.ranks.may_stop(admit, busy, len(self._waiting)):
                            self._driver = None
                            self.batch = None
                            return
                    self._join(incoming, seed)
                    if self.batch is not None and self.batch.rows:
                        self._step()
        except BaseException as error:  # not one request's fault: every request in flight fails with it
            self._fail_all(error, incoming)

    def _join(self, incoming: list[Request], seed: int | None) -> None:
        self.ranks.agree_on(incoming, seed)
        self._drop_cancelled(incoming)
        incoming = [r for r in incoming if r.finish_reason is None]
        if incoming:
            try:
                self._admit(incoming)
            except Exception as error:  # e.g. pools that do not fit: the joining requests fail
                self._fail_admission(incoming, error)
        self._joining = 0

    def _fail_all(self, error: BaseException, incoming: list[Request]) -> None:
        with self._lock:
            failed = list(self._waiting) + (self.batch.rows if self.batch is not None else [])
            failed += [r for r in incoming if r not in failed]
            self._waiting.clear()
            self._joining = 0
            self.batch = None
            self._driver = None
        for r in failed:
            if not r.handle.done():
                r.error = error
                self._finish(r)

    def _fail_admission(self, new: list[Request], error: Exception) -> None:
        """``new`` could not join: they fail with ``error``; the running rows go on."""
        batch = self.batch
        for i in range(len(batch.rows) - 1, -1, -1) if batch is not None else ():
            if batch.rows[i] in new:
                batch.remove(i)
        for r in new:
            if not r.handle.done():
                r.error = error
                self._finish(r)

    def _finish(self, r: Request) -> None:
        """``r`` is done (finished, failed or cancelled): its blocks freed, its streamer ended, its caller woken."""
        if self.cache is not None:
            self.cache.free(r.index)
        r.end()

    def _drop_cancelled(self, incoming: list[Request]) -> None:
        for r in incoming if self.ranks.drops_joining_cancelled() else ():
            if r.cancelled:
                r.finish_reason = "cancelled"
                self._finish(r)  # like every other end: its streamer ends too
        batch = self.batch
        for i in range(len(batch.rows) - 1, -1, -1) if batch is not None else ():
            if self.ranks.cancelled(r := batch.rows[i]):
                r.finish_reason = "cancelled"
                batch.remove(i)
                self._finish(r)

    def _admit(self, new: list[Request]) -> None:
        """Prefill ``new`` requests together into free rows; those that finish at once (a prompt at capacity, an
        eos first token, ``max_new_tokens == 1``) leave again."""
        spec = self.spec
        for r in new:
            if len(r.prompt) >= spec.max_seq_len:
                r.finish_reason = "length"
                self._finish(r)
        new = [r for r in new if r.finish_reason is None]
        if not new:
            return
        live = (self.batch.rows if self.batch is not None else []) + new
        self.cache = cache = spec.pools.for_requests(live, spec.compiled, spec.verify_len)
        device = cache.device
        B = spec.block_size
        for r in new:  # the cached pages each prompt starts with, held before any block is taken (or evicted)
            prefix = cache.match(r.prompt)
            cache.ensure(r.index, 0, prefix)
            r.cached = len(prefix) * spec.page_size
        new = sorted(new, key=lambda r: -(len(r.prompt) - r.cached))  # prefill groups: runs of similar lengths
        if self.batch is None:
            self.batch = Batch(spec.batch_bucket(len(new)), B, cache.blocks_per_seq, device)
        batch = self.batch
        if batch.tables.shape[1] != cache.blocks_per_seq:
            raise RuntimeError("the pools' pages per request changed under a running batch")
        if batch.capacity < len(batch.rows) + len(new):
            batch.grow(spec.batch_bucket(len(batch.rows) + len(new)))
        first = len(batch.rows)
        with self._lock:  # the joining requests are the batch's rows now: in_flight() counts them once
            batch.rows.extend(new)
            self._joining = 0
        for j, r in enumerate(new):
            r.seq_len = len(r.prompt)
            r.acceptance = spec.policy.history(B - 1)
            batch.start_row(first + j, r, cache)
        first_tokens = []
        for start, stop in prefill_groups([len(r.prompt) - r.cached for r in new]):
            first_tokens += self._prefill_rows(new[start:stop], first + start)
        for r in new:  # their prompts' pages hold their K/V now
            cache.register(r.index, r.prompt)
        for i in range(first + len(new) - 1, first - 1, -1):
            r = batch.rows[i]
            if r.emit(first_tokens[i - first], spec.max_seq_len):
                if self.ranks.leaves_later(r):
                    r.cancelled = True  # failed here only: it leaves every rank at the next agreement
                    continue
                batch.remove(i)
                self._finish(r)

    def _prefill_rows(self, group: list[Request], first: int) -> list[int]:
        """Prefill ``group`` (in rows ``first..``) in one left-padded forward; -> their first tokens."""
        spec, batch, cache = self.spec, self.batch, self.cache
        device = cache.device
        rows = slice(first, first + len(group))
        L = max(len(r.prompt) - r.cached for r in group)  # what runs: each prompt past its cached pages
        ids = torch.tensor([[0] * (L - len(r.prompt) + r.cached) + r.prompt[r.cached:] for r in group], device=device)
        lens = batch.seq_lens[rows]
        cached = torch.tensor([r.cached for r in group], device=device) if any(r.cached for r in group) else None
        pages = spec.context_bucket(max(len(r.prompt) for r in group))
        sampling = None
        if any(r.args.do_sample for r in group):
            sampling = SamplingInputs(batch.do_sample[rows], batch.temperature[rows], batch.top_k[rows],
                                            batch.top_p[rows], batch.seeds[rows])
        tables = batch.tables[rows, :pages]
        state_slots = batch.state_slots[rows] if cache.has_states else None
        block = spec.dflash_step.prefill(ids, lens, tables, cache.target_pools, cache.draft_pool, sampling,
                                         state_slots, cached)
        batch.block[rows] = block
        return block[:, 0].tolist()

    # ------------------------------------------------------------------ one step: plan, run, apply, emit
    def _step(self) -> None:
        """One speculative step of the running rows: the policy picks its ``K`` (how many of the proposed drafts
        it verifies) and whether it proposes the next block; one call of the step, one host read."""
        plan = self._plan()
        result = self._run(plan)
        accepted = self._apply(plan, result)
        self._emit_all(plan, result, accepted)

    def _plan(self) -> StepPlan:
        spec, batch = self.spec, self.batch
        rows = batch.rows
        sampled = any(r.args.do_sample for r in rows)
        view = StepView(spec.batch_bucket(len(rows)), list(rows), spec.context_bucket(self._longest(spec.verify_len)),
                        sampled)
        choice = self.ranks.plan(spec.policy.choose(view))
        drafted = all(r.drafted for r in rows)
        K = choice.k if drafted else 0  # a row whose last step did not propose has only its bonus
        bucket, inputs = self._step_inputs(K, choice.propose)
        view.pages = inputs[2].shape[1]
        return StepPlan(view, K, choice.propose, sampled, bucket, inputs,
                        verified=batch.block[:bucket, 1:K + 1].tolist() if any(r.args.output_drafts for r in rows)
                        else None,
                        first_draft=batch.block[:bucket, 1].clone() if K == 0 and drafted else None)

    def _run(self, plan: StepPlan) -> StepResult:
        spec, batch = self.spec, self.batch
        sampling = (self.batch.sampling(plan.bucket),) if plan.sampled else ()
        states = {"state_slots": batch.state_slots[:plan.bucket]} if self.cache.has_states else {}
        variant = (plan.bucket, plan.K, plan.propose, plan.sampled, plan.inputs[2].shape[1] if not spec.compiled else 0)
        events = self._graph_events
        start = time.perf_counter()
        tokens, num_accepted, next_block = spec.step(*plan.inputs, *sampling, **states, propose=plan.propose)
        token_list = tokens.tolist()  # the step's one host read (it waits for the step)
        seconds = time.perf_counter() - start
        if variant not in self._timed or self._graph_events != events:
            seconds = None  # a first call, or one that compiled or loaded a graph: not the step's cost
        self._timed.add(variant)
        agreed = ((plan.first_draft == tokens[:, 0]).tolist() if plan.first_draft is not None
                  else [None] * plan.bucket)
        return StepResult(token_list, num_accepted, next_block, seconds, agreed)

    def _apply(self, plan: StepPlan, result: StepResult) -> list[int | None]:
        """The step's results into the batch's buffers and the policy's statistics; -> drafts accepted per row."""
        batch, rows, bucket = self.batch, self.batch.rows, plan.bucket
        batch.block[:bucket, : result.next_block.shape[1]] = result.next_block
        for r in rows:
            r.drafted = plan.propose
        batch.seq_lens[:bucket] += result.num_accepted + batch.active[:bucket]
        accepted = [(row.index(-1) - 1 if -1 in row else plan.K) if plan.K > 0 else None
                    for row in result.tokens[: len(rows)]]
        self.spec.policy.observe(plan.view, plan.K, plan.propose, result.seconds, accepted,
                                 result.agreed[: len(rows)])
        return accepted

    def _emit_all(self, plan: StepPlan, result: StepResult, accepted: list[int | None]) -> None:
        """Each row's accepted tokens to its request; finished rows leave."""
        batch, rows = self.batch, self.batch.rows
        for i in range(len(rows) - 1, -1, -1):  # backwards: a finished row is replaced by the last one
            r, row = rows[i], result.tokens[i]
            a = accepted[i] or 0
            r.stats.record(plan.K, a)
            if plan.verified is not None:
                r.drafts.append(plan.verified[i])
            r.seq_len += a + 1
            for t in row[: a + 1] if r.error is None else ():
                if r.emit(t, self.spec.max_seq_len):
                    break
            if self.ranks.leaves_later(r):
                r.cancelled = True  # failed here only (its streamer): it leaves every rank at the next agreement
            elif r.finish_reason is not None or r.error is not None:
                batch.remove(i)
                self._finish(r)

    def _longest(self, verify_len: int) -> int:
        return max(r.seq_len for r in self.batch.rows) + verify_len

    def _step_inputs(self, K: int | None = None, propose: bool = True) -> tuple[int, tuple]:
        """``(bucket, the step's inputs)`` for the running rows verifying ``K`` drafts (default: the most the policy
        may verify), over the pages that hold every row's verify block (KV blocks allocated as needed). A block
        longer than ``K + 1`` (``StepKeys.block_len``) carries -1 after the bonus: drafts no token equals."""
        spec, batch, cache = self.spec, self.batch, self.cache
        K = spec.num_speculative_tokens if K is None else K
        width = spec.compiled_steps.keys.block_len(K, propose) if spec.compiled else K + 1
        bucket = spec.batch_bucket(len(batch.rows))
        for i, r in enumerate(batch.rows):
            batch.cover(i, r, r.seq_len + width, cache)
        pages = spec.context_bucket(self._longest(width))
        # Every step input has row-major strides: a compiled step's guards (and a saved graph's) match on strides too.
        block = _dense(batch.block[:bucket, :width])
        block[:, K + 1:] = -1
        return bucket, (block, batch.seq_lens[:bucket], _dense(batch.tables[:bucket, :pages]), batch.active[:bucket],
                        cache.target_pools, cache.draft_pool)


PREFILL_OVERHEAD_TOKENS = 64


def prefill_groups(lengths: list[int], overhead: int = PREFILL_OVERHEAD_TOKENS) -> list[tuple[int, int]]:
    """Split prompts sorted longest first into runs ``[start, stop)``, each prefilled in one left-padded forward, so
    that padding plus ``overhead`` tokens per forward (its fixed cost) is least: requests that join together with
    similar lengths share a forward, and a short prompt does not pad to a long one's length when a forward of its
    own costs less. (Exact: a minimum over every split into runs, ``O(n^2)``.)"""
    n = len(lengths)
    best = [0.0] + [float("inf")] * n  # best[j]: cost of the first j prompts
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # the last run is [i, j), padded to lengths[i]
            cost = best[i] + overhead + (j - i) * lengths[i]
            if cost < best[j]:
                best[j], cut[j] = cost, i
    runs, j = [], n
    while j > 0:
        runs.append((cut[j], j))
        j = cut[j]
    return runs[::-1]


def _dense(t: torch.Tensor) -> torch.Tensor:
    """A row-major copy (``contiguous()`` keeps a view whose size-1 dims have other strides)."""
    return t.clone(memory_format=torch.contiguous_format)


@contextlib.contextmanager
def graphs_ready(scheduler: Scheduler, rows: int, sampled: bool):
    """Before ``rows`` new requests queue on ``scheduler``: the graphs of every batch they may step in
    (``CompiledSteps.ready``), up to the rows in flight or being readied by other callers plus these; both sampling
    modes when a request in flight has the other mode (a batch with a sampled row runs the sampled graph, and the
    greedy one once the sampled rows leave), else this mode alone."""
    with scheduler._lock:
        others = scheduler._announced + scheduler._rows()
        modes = scheduler._modes() | {sampled}
        scheduler._announced += rows
        scheduler._announced_modes[sampled] += rows
    try:
        if scheduler.spec.compiled_steps is not None:
            scheduler.spec.compiled_steps.ready(others + rows, "both" if len(modes) > 1 else sampled)
        yield
    finally:
        with scheduler._lock:
            scheduler._announced -= rows
            scheduler._announced_modes[sampled] -= rows
