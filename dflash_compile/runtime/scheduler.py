"""The host side of generation: requests from any number of threads share one continuous batch.

Threading model. Each ``DFlashSpecWrapper`` owns one ``Scheduler``. ``submit`` may be called from any thread: it
queues the request and returns a ``RequestHandle`` at once. One driver thread per wrapper (started on demand,
gone when no request is left) runs the loop: at every step boundary it drops cancelled requests, admits the
queued ones that fit (prefilled together: one forward per run of similar prompt lengths, ``prefill_groups``) and
runs one step of everything running. So requests that arrive separately share the batch, each at the next step
after it arrives. The driver runs the steps with the intra-op thread count (``torch.get_num_threads()``) of the
thread that submitted last (OpenMP's team size is per thread: a new thread would get the process default).
Everything a request produces (tokens, its streamer's calls, its finish) is its own: a
streamer that raises fails that request alone, and the others' rows never see its tokens (row outputs do not
depend on other rows). An error the driver cannot pin on one request (the step itself failing) fails every
request in flight, frees all their blocks and leaves the wrapper usable. A compiled wrapper's steps call their
key's ahead-of-time compiled graph (``compiled_step.py``) directly, with no dynamo frame evaluation and no global
state, so wrappers step concurrently; only tracing a new graph takes a process-wide lock.

A request's KV blocks and recurrent-state slot are freed when it finishes, fails or is cancelled. Pools grow
(contents kept) when the requests in flight need more blocks than they hold; compiled, they are allocated at
capacity once, so a pool's shape never changes under a compiled graph.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import CancelledError
from dataclasses import dataclass, field

import torch

from .generation import DFlashStats, GenerationArgs
from .speculation import AcceptanceHistory, StepView

log = logging.getLogger(__name__)

_END = object()


@dataclass
class _Request:
    index: int
    prompt: list[int]
    args: GenerationArgs
    generator: torch.Generator | None = None  # the request's own RNG (sampling): its seed is drawn from it
    new: list[int] = field(default_factory=list)
    stats: DFlashStats = field(default_factory=DFlashStats)
    finish_reason: str | None = None  # "stop", "length", or "cancelled"
    seq_len: int = 0  # tokens in the target cache = position of the pending block's first token
    pages: int = 0  # KV blocks allocated to it (the first ``pages`` entries of its block-table row)
    cached: int = 0  # prompt tokens whose K/V it adopted from the prefix cache (not prefilled)
    drafts: list[list[int]] = field(default_factory=list)  # each step's verified drafts (``output_drafts``)
    error: BaseException | None = None
    cancelled: bool = False
    handle: RequestHandle | None = None
    acceptance: AcceptanceHistory | None = None  # per-position acceptance, for the speculation policy
    drafted: bool = True  # its row holds drafts: its prefill or last step proposed (else only the bonus is fresh)
    cancel_agreed: bool = False  # tensor-parallel: a cancel every rank has seen (``Scheduler._sync``)
    _seed: int | None = None  # drawn by sampling_seed

    def sampling_seed(self) -> int:
        """The seed of this request's sampling noise (``rejection.position_noise``): drawn once from its generator,
        so the same generator state, or the same ``seed``, gives the same text."""
        if self._seed is None:
            self._seed = int(torch.randint(0, 2**62, (1,), generator=self.generator).item())
        return self._seed


@dataclass
class RequestResult:
    """What one request produced: its new tokens, why it stopped, its speculation counters and (with
    ``output_drafts``) the drafts each step verified."""

    prompt: list[int]
    tokens: list[int]
    finish_reason: str
    stats: DFlashStats
    drafts: list[list[int]] | None


class RequestHandle:
    """One submitted request. Iterate over it for its new tokens as they are accepted (from any thread);
    ``result()`` waits for the end; ``cancel()`` makes it leave the batch at the next step (its blocks are freed)
    and ``result()`` then raises ``concurrent.futures.CancelledError``."""

    def __init__(self, request: _Request):
        self._request = request
        self._tokens: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()
        self._callbacks: list = []
        self._callbacks_lock = threading.Lock()
        request.handle = self

    @property
    def stats(self) -> DFlashStats:
        """Its speculation counters so far (live; also after a cancel or a failure, when ``result()`` raises)."""
        return self._request.stats

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose K/V came from the prefix cache (not prefilled); 0 before it joins the batch."""
        return self._request.cached

    def add_done_callback(self, fn) -> None:
        """Call ``fn(handle)`` once the request is done (finished, failed or cancelled): on the thread that ends it
        (the scheduler's driver), or at once on this thread if it is done already. An exception in ``fn`` is
        logged, never raised into the scheduler."""
        with self._callbacks_lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        _call(fn, self)

    def __iter__(self):
        while (token := self._tokens.get()) is not _END:
            yield token
        self._raise()

    def result(self, timeout: float | None = None) -> RequestResult:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self._request.index} is still running after {timeout} s")
        self._raise()
        r = self._request
        return RequestResult(r.prompt, list(r.new), r.finish_reason, r.stats,
                             r.drafts if r.args.output_drafts else None)

    def cancel(self) -> None:
        self._request.cancelled = True

    def done(self) -> bool:
        return self._done.is_set()

    def _raise(self) -> None:
        r = self._request
        if r.error is not None:
            raise r.error
        if r.finish_reason == "cancelled":
            raise CancelledError(f"request {r.index} was cancelled")

    def _put(self, token: int) -> None:
        self._tokens.put(token)

    def _finish(self) -> None:
        self._tokens.put(_END)
        with self._callbacks_lock:
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            _call(fn, self)


def _call(fn, handle: RequestHandle) -> None:
    try:
        fn(handle)
    except Exception:  # the caller's callback: its failure is its own
        log.exception("a done callback of request %d raised", handle._request.index)


class _Batch:
    """The running requests' step inputs as persistent device buffers: row ``i`` of every buffer belongs to
    ``rows[i]``; rows ``len(rows)..`` are free (inactive, empty table). A step runs on the first ``bucket`` rows;
    its results update the buffers in place (one host read per step), and a row is rewritten only when a request
    joins, leaves (the last row moves into the hole) or needs another KV block (one table entry). ``grow`` makes
    room for more rows (contents kept)."""

    def __init__(self, num_rows: int, block_size: int, blocks_per_seq: int, device):
        long = dict(dtype=torch.long, device=device)
        self.rows: list[_Request] = []
        self.block = torch.zeros(num_rows, block_size, **long)  # the bonus and the drafts after it
        self.seq_lens = torch.zeros(num_rows, **long)
        self.tables = torch.full((num_rows, blocks_per_seq), -1, **long)
        self.active = torch.zeros(num_rows, dtype=torch.bool, device=device)
        self.do_sample = torch.zeros(num_rows, dtype=torch.bool, device=device)
        self.temperature = torch.ones(num_rows, device=device)
        self.top_k = torch.zeros(num_rows, **long)
        self.top_p = torch.ones(num_rows, device=device)
        self.state_slots = torch.zeros(num_rows, **long)  # each row's slot in the recurrent-state pools
        self.seeds = torch.zeros(num_rows, **long)  # each sampled row's noise seed

    _BUFFERS = ("block", "seq_lens", "tables", "active", "do_sample", "temperature", "top_k", "top_p", "state_slots",
                "seeds")

    @property
    def capacity(self) -> int:
        return self.block.shape[0]

    def grow(self, num_rows: int) -> None:
        """At least ``num_rows`` rows; new rows are free."""
        for name in self._BUFFERS:
            old = getattr(self, name)
            if old is None:
                continue
            fill = -1 if name == "tables" else (1 if name in ("temperature", "top_p") else 0)
            new = torch.full((num_rows, *old.shape[1:]), fill, dtype=old.dtype, device=old.device)
            new[: old.shape[0]] = old
            setattr(self, name, new)

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
            for name in self._BUFFERS:
                buf = getattr(self, name)
                if buf is not None:
                    buf[i] = buf[last]
            self.rows[i] = self.rows[last]
        self.rows.pop()
        self.clear_row(last)


class Scheduler:
    """Admission, buckets, emission and per-step sampling inputs for one ``DFlashSpecWrapper`` (see the module
    docstring for the threading model)."""

    def __init__(self, spec):
        self.spec = spec
        self._lock = threading.Lock()
        self._waiting: deque[_Request] = deque()
        self._driver: threading.Thread | None = None
        self._joining = 0  # requests taken off the queue and not yet in the batch (being admitted)
        self._ids = itertools.count()
        self.batch: _Batch | None = None
        self.cache = None
        self._threads = torch.get_num_threads()  # intra-op threads of the latest submitting thread
        self._timed: set[tuple] = set()  # step variants already run once (their first call is not timed)

    # ------------------------------------------------------------------ any thread
    def submit(self, prompt: list[int], args: GenerationArgs, generator: torch.Generator | None = None) -> RequestHandle:
        """Queue one validated request; it joins the running batch at the next step."""
        return self.submit_together([prompt], args, [generator])[0]

    def submit_together(self, prompts: list[list[int]], args: GenerationArgs,
                        generators: list[torch.Generator | None]) -> list[RequestHandle]:
        """Queue validated requests atomically: the driver sees all of them at once, so they are admitted in the
        same step (prefilled together) as far as free rows allow."""
        requests = [_Request(next(self._ids), list(p), args, g) for p, g in zip(prompts, generators, strict=True)]
        handles = [RequestHandle(r) for r in requests]
        with self._lock:
            self._waiting.extend(requests)
            self._threads = torch.get_num_threads()  # the caller's: the driver runs the steps with as many
            if self._driver is None:
                self._driver = threading.Thread(target=self._drive, name="dflash-scheduler")  # exit waits for it
                self._driver.start()
        return handles

    def in_flight(self) -> int:
        with self._lock:
            return len(self._waiting) + self._joining + (len(self.batch.rows) if self.batch is not None else 0)

    def idle(self) -> bool:
        with self._lock:
            return self._driver is None

    def prefill_batch(self, prompts: list[list[int]], args: GenerationArgs) -> tuple[int, tuple]:
        """Admit ``prompts`` together on the calling thread, without running any step, and return ``(bucket, the
        step's inputs)`` exactly as the driver would build them (for benchmarks and tests; nothing may be in
        flight)."""
        if self.in_flight():
            raise RuntimeError("prefill_batch needs an idle scheduler")
        new = []
        for p in prompts:
            r = _Request(next(self._ids), list(p), args)
            RequestHandle(r)
            new.append(r)
        with torch.no_grad():
            self._admit(new)
        return self._step_inputs()

    # ------------------------------------------------------------------ the driver thread
    def _drive(self) -> None:
        incoming: list[_Request] = []
        tp = self.spec.tp
        try:
            with torch.no_grad():
                while True:
                    if torch.get_num_threads() != self._threads:  # a thread's OpenMP team size is its own: a
                        torch.set_num_threads(self._threads)  # new thread would run with the process default
                    admit, seed = self._sync() if tp is not None else (None, None)
                    with self._lock:
                        running = self.batch.rows if self.batch is not None else []
                        free = self.spec.max_batch_size - len(running)
                        n = min(free, len(self._waiting)) if admit is None else admit
                        incoming = [self._waiting.popleft() for _ in range(n)]
                        self._joining = len(incoming)
                        if not incoming and not running and (tp is None or (admit == 0 and seed is None
                                                                            and not self._waiting)):
                            self._driver = None
                            self.batch = None
                            return
                    if tp is not None:
                        self._agree_on(incoming, seed)
                    self._drop_cancelled(incoming)
                    incoming = [r for r in incoming if r.finish_reason is None]
                    if incoming:
                        try:
                            self._admit(incoming)
                        except Exception as error:  # e.g. pools that do not fit: the joining requests fail
                            self._fail_admission(incoming, error)
                    self._joining = 0
                    if self.batch is not None and self.batch.rows:
                        self._step()
        except BaseException as error:  # not one request's fault: every request in flight fails with it
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

    def _sync(self) -> tuple[int, int | None]:
        """Tensor-parallel: agree with the other ranks, at the top of every driver iteration, on how many queued
        requests join (as many as every rank has), which running rows are cancelled (any rank's cancel) and, as
        rank 0 draws it, a seed for the joining requests that sample without one. -> ``(requests to admit, the
        seed, or None when no rank has work: the driver may stop)``."""
        tp, spec = self.spec.tp, self.spec
        with self._lock:
            running = self.batch.rows if self.batch is not None else []
            free = spec.max_batch_size - len(running)
            queued = len(self._waiting)
            unseeded = any(r.args.do_sample and r.generator is None for r in self._waiting)
        flags = [int(r.cancelled) for r in running] + [0] * (spec.max_batch_size - len(running))
        # from rank 0's global RNG, as an unseeded request's seed is in one process; drawn only when one is queued
        seed = int(torch.randint(0, 2**62, (1,)).item()) if tp.rank == 0 and unseeded else 0
        ranks = tp.gather([min(free, queued), int(bool(queued or running)), seed] + flags)
        for i, r in enumerate(running):
            r.cancel_agreed = any(v[3 + i] for v in ranks)
        admit = min(v[0] for v in ranks)
        return admit, (ranks[0][2] if any(v[1] for v in ranks) else None)

    def _agree_on(self, incoming: list[_Request], seed: int | None) -> None:
        """Tensor-parallel: check that every rank admits the same requests (a digest of each), and seed the ones
        that sample without a seed from rank 0's ``seed``."""
        if not incoming:
            return
        for j, r in enumerate(incoming):
            if r.args.do_sample and r.generator is None:
                r.generator = torch.Generator().manual_seed((seed + j) % 2**62)
        mine = [_digest(r) for r in incoming]
        ranks = self.spec.tp.gather(mine)
        odd = [k for k, v in enumerate(ranks) if v != ranks[0]]
        if odd:
            raise RuntimeError(
                f"tensor-parallel ranks {odd} were given different requests than rank 0 (prompt, generation "
                f"arguments or seed of the {len(incoming)} joining now): every rank must submit the same requests "
                f"in the same order"
            )

    def _fail_admission(self, new: list[_Request], error: Exception) -> None:
        """``new`` could not join: they fail with ``error``; the running rows go on."""
        batch = self.batch
        if batch is not None:
            for i in range(len(batch.rows) - 1, -1, -1):
                if batch.rows[i] in new:
                    batch.remove(i)
        for r in new:
            if not r.handle.done():
                r.error = error
                self._finish(r)

    def _release(self, r: _Request) -> None:
        if self.cache is not None:
            self.cache.free(r.index)

    def _finish(self, r: _Request) -> None:
        """``r`` is done (finished, failed or cancelled): free its blocks, end its streamer, wake its caller."""
        self._release(r)
        if r.args.streamer is not None:
            try:
                r.args.streamer.end()
            except Exception as e:  # the caller's streamer: its request fails, nobody else
                r.error = r.error or e
        r.handle._finish()

    def _drop_cancelled(self, incoming: list[_Request]) -> None:
        tp = self.spec.tp is not None  # ranks drop the rows they agreed on (``_sync``); joining ones next time
        for r in incoming if not tp else ():
            if r.cancelled:
                r.finish_reason = "cancelled"
                self._finish(r)  # like every other end: its streamer ends too
        batch = self.batch
        if batch is not None:
            for i in range(len(batch.rows) - 1, -1, -1):
                r = batch.rows[i]
                if r.cancel_agreed if tp else r.cancelled:
                    r.finish_reason = "cancelled"
                    batch.remove(i)
                    self._finish(r)

    def _pools(self, incoming: list[_Request]):
        """The pools, with room for every request in flight (at capacity when compiled)."""
        spec = self.spec
        if spec.compiled or spec.prefix_caching:  # at capacity (prefix caching: room for pages no request holds)
            return spec.kv_cache()
        live = (self.batch.rows if self.batch is not None else []) + incoming
        need = sum(-(-min(spec.max_seq_len, len(r.prompt) + r.args.max_new_tokens + spec.verify_len) // spec.page_size)
                   for r in live)
        return spec.kv_cache(need)

    def _admit(self, new: list[_Request]) -> None:
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
        self.cache = cache = self._pools(new)
        device = cache.device
        B = spec.block_size
        for r in new:  # the cached pages each prompt starts with, held before any block is taken (or evicted)
            prefix = cache.match(r.prompt)
            cache.ensure(r.index, 0, prefix)
            r.cached = len(prefix) * spec.page_size
        new = sorted(new, key=lambda r: -(len(r.prompt) - r.cached))  # prefill groups: runs of similar lengths
        if self.batch is None:
            self.batch = _Batch(spec.batch_bucket(len(new)), B, cache.blocks_per_seq, device)
        batch = self.batch
        if batch.tables.shape[1] != cache.blocks_per_seq:
            raise RuntimeError("the pools' pages per request changed under a running batch")
        if batch.capacity < len(batch.rows) + len(new):
            batch.grow(spec.batch_bucket(len(batch.rows) + len(new)))
        first = len(batch.rows)
        batch.rows.extend(new)
        for j, r in enumerate(new):
            i = first + j
            r.seq_len = len(r.prompt)
            r.acceptance = spec.policy.history(B - 1)
            self._grow(i, r, r.seq_len)
            batch.seq_lens[i] = r.seq_len
            batch.active[i] = True
            batch.state_slots[i] = cache.state_slot(r.index)
            a = r.args
            batch.do_sample[i], batch.temperature[i], batch.top_k[i], batch.top_p[i] = (
                a.do_sample, a.temperature, a.top_k, a.top_p)
            batch.seeds[i] = r.sampling_seed() if a.do_sample else 0
        first_tokens = []
        for start, stop in prefill_groups([len(r.prompt) - r.cached for r in new]):
            first_tokens += self._prefill_rows(new[start:stop], first + start)
        for r in new:  # their prompts' pages hold their K/V now
            cache.register(r.index, r.prompt)
        for i in range(first + len(new) - 1, first - 1, -1):
            r = batch.rows[i]
            if self._emit(r, first_tokens[i - first]):
                if spec.tp is not None and r.error is not None and r.finish_reason is None:
                    r.cancelled = True  # failed here only: it leaves every rank at the next agreement
                    continue
                batch.remove(i)
                self._finish(r)

    def _prefill_rows(self, group: list[_Request], first: int) -> list[int]:
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
            sampling = spec.sampling_inputs(batch.do_sample[rows], batch.temperature[rows], batch.top_k[rows],
                                            batch.top_p[rows], batch.seeds[rows])
        tables = batch.tables[rows, :pages]
        state_slots = batch.state_slots[rows] if cache.has_states else None
        block = spec.prefill(ids, lens, tables, cache.target_pools, cache.draft_pool, sampling, state_slots, cached)
        batch.block[rows] = block
        return block[:, 0].tolist()

    def _step(self) -> None:
        """One speculative step of the running rows: the policy picks its ``K`` (how many of the proposed drafts
        it verifies) and whether it proposes the next block; one call of ``forward``, one host read."""
        spec, batch, cache = self.spec, self.batch, self.cache
        rows = batch.rows
        sampled = any(r.args.do_sample for r in rows)
        bucket = spec.batch_bucket(len(rows))
        view = StepView(bucket, list(rows), spec.context_bucket(self._longest(spec.verify_len)), sampled)
        plan = spec.policy.choose(view)
        if spec.tp is not None:  # every rank runs rank 0's choice (each times its own steps)
            k, propose = spec.tp.gather([plan.k, int(plan.propose)])[0]
            plan = dataclasses.replace(plan, k=k, propose=bool(propose))
        drafted = all(r.drafted for r in rows)
        K = plan.k if drafted else 0  # a row whose last step did not propose has only its bonus
        bucket, step_inputs = self._step_inputs(K)
        view.pages = step_inputs[2].shape[1]
        sampling = (self._sampling(bucket),) if sampled else ()
        states = {"state_slots": batch.state_slots[:bucket]} if cache.has_states else {}
        drafts = any(r.args.output_drafts for r in rows)
        verified = batch.block[:bucket, 1:K + 1].tolist() if drafts else None
        first_draft = batch.block[:bucket, 1].clone() if K == 0 and drafted else None
        variant = (bucket, K, plan.propose, sampled, step_inputs[2].shape[1] if not spec.compiled else 0)
        events = len(spec.compiled_steps.events) if spec.compiled else 0
        start = time.perf_counter()
        tokens, num_accepted, next_block = spec.step(*step_inputs, *sampling, **states, propose=plan.propose)
        token_list = tokens.tolist()  # the step's one host read (it waits for the step)
        seconds = time.perf_counter() - start
        if variant not in self._timed or (spec.compiled and len(spec.compiled_steps.events) != events):
            seconds = None  # a first call, or one that compiled or loaded a graph: not the step's cost
        self._timed.add(variant)
        agreed = ((first_draft == tokens[:, 0]).tolist() if first_draft is not None else [None] * bucket)
        batch.block[:bucket, : next_block.shape[1]] = next_block
        for r in rows:
            r.drafted = plan.propose
        batch.seq_lens[:bucket] += num_accepted + batch.active[:bucket]
        accepted = []
        for row in token_list[: len(rows)]:
            accepted.append((row.index(-1) - 1 if -1 in row else K) if K > 0 else None)
        spec.policy.observe(view, K, plan.propose, seconds, accepted, agreed[: len(rows)])
        tokens = token_list
        tp = spec.tp is not None
        for i in range(len(rows) - 1, -1, -1):  # backwards: a finished row is replaced by the last one
            r, row = rows[i], tokens[i]
            a = accepted[i] or 0
            r.stats.record(K, a)
            if verified is not None:
                r.drafts.append(verified[i])
            r.seq_len += a + 1
            for t in row[: a + 1] if r.error is None else ():
                if self._emit(r, t):
                    break
            if tp and r.error is not None and r.finish_reason is None:
                r.cancelled = True  # failed here only (its streamer): it leaves every rank at the next agreement
            elif r.finish_reason is not None or r.error is not None:
                batch.remove(i)
                self._finish(r)

    def _longest(self, verify_len: int) -> int:
        return max(r.seq_len for r in self.batch.rows) + verify_len

    def _step_inputs(self, K: int | None = None) -> tuple[int, tuple]:
        """``(bucket, forward's inputs)`` for the running rows verifying ``K`` drafts (default: the most the policy
        may verify): the smallest batch bucket that holds them and the pages that hold every row's verify block
        (``spec.context_bucket``; KV blocks allocated as needed)."""
        spec, batch, cache = self.spec, self.batch, self.cache
        K = spec.num_speculative_tokens if K is None else K
        bucket = spec.batch_bucket(len(batch.rows))
        for i, r in enumerate(batch.rows):
            self._grow(i, r, r.seq_len + K + 1)
        pages = spec.context_bucket(self._longest(K + 1))
        # Every step input has row-major strides: a compiled step's guards (and a saved graph's) match on strides too.
        return bucket, (_dense(batch.block[:bucket, : K + 1]), batch.seq_lens[:bucket],
                        _dense(batch.tables[:bucket, :pages]), batch.active[:bucket], cache.target_pools,
                        cache.draft_pool)

    def _grow(self, i: int, r: _Request, num_tokens: int) -> None:
        """Allocate KV blocks so row ``i`` (request ``r``) covers ``num_tokens`` positions (capped at capacity)."""
        spec, batch, cache = self.spec, self.batch, self.cache
        if r.pages * spec.page_size < min(num_tokens, spec.max_seq_len):
            cache.ensure(r.index, num_tokens)
            owned = cache.blocks(r.index)
            batch.tables[i, r.pages : len(owned)] = torch.tensor(owned[r.pages :], dtype=torch.long)
            r.pages = len(owned)

    def _sampling(self, bucket: int):
        """The step's ``SamplingInputs`` for the first ``bucket`` rows."""
        batch = self.batch
        return self.spec.sampling_inputs(batch.do_sample[:bucket], batch.temperature[:bucket], batch.top_k[:bucket],
                                         batch.top_p[:bucket], batch.seeds[:bucket])

    def _emit(self, r: _Request, token: int) -> bool:
        """Append ``token`` to ``r`` and hand it out; True when ``r`` is finished: an eos token or a stop string
        (``"stop"``), ``max_new_tokens`` or capacity (``"length"``), or its streamer raised (``r.error``)."""
        args, max_seq_len = r.args, self.spec.max_seq_len
        r.new.append(token)
        r.handle._put(token)
        if args.streamer is not None:
            try:
                args.streamer.put(torch.tensor([token]))
            except Exception as e:  # the caller's streamer: this request fails, nobody else
                r.error = e
                return True
        if token in args.eos_token_ids:
            r.finish_reason = "stop"
        elif args.stop_strings and ends_with_stop_string(args.tokenizer, r.new, args.stop_strings):
            r.finish_reason = "stop"
        elif len(r.new) >= args.max_new_tokens or len(r.prompt) + len(r.new) >= max_seq_len:
            r.finish_reason = "length"
        return r.finish_reason is not None


PREFILL_OVERHEAD_TOKENS = 64


def _digest(r: _Request) -> int:
    """What must be the same for one request on every rank: its prompt, generation arguments and seed."""
    from .distributed import digest

    a = r.args
    return digest(repr((r.prompt, a.max_new_tokens, a.do_sample, a.temperature, a.top_k, a.top_p,
                        sorted(a.eos_token_ids), a.stop_strings, r.sampling_seed() if r.generator else None)))


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


def ends_with_stop_string(tokenizer, tokens: list[int], stop_strings: tuple[str, ...]) -> bool:
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
