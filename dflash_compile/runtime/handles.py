"""A request as the scheduler holds it (``Request``) and as its caller holds it (``RequestHandle``, ``RequestResult``).

The caller's thread reads tokens from the handle's queue and waits on its event; the scheduler's driver thread
writes them. Nothing else is shared between the two.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import CancelledError
from dataclasses import dataclass, field

import torch

from .generation import DFlashStats, GenerationArgs
from .speculation import AcceptanceHistory

log = logging.getLogger(__name__)

_END = object()


@dataclass
class Request:
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
    handle: "RequestHandle | None" = None
    acceptance: AcceptanceHistory | None = None  # per-position acceptance, for the speculation policy
    drafted: bool = True  # its row holds drafts: its prefill or last step proposed (else only the bonus is fresh)
    cancel_agreed: bool = False  # tensor-parallel: a cancel every rank has seen (``ranks.Lockstep``)
    _seed: int | None = None  # drawn by sampling_seed

    def sampling_seed(self) -> int:
        """The seed of this request's sampling noise (``rejection.position_noise``): drawn once from its generator,
        so the same generator state, or the same ``seed``, gives the same text."""
        if self._seed is None:
            self._seed = int(torch.randint(0, 2**62, (1,), generator=self.generator).item())
        return self._seed

    def emit(self, token: int, max_seq_len: int) -> bool:
        """Append ``token`` and hand it out; True when the request is finished: an eos token or a stop string
        (``"stop"``), ``max_new_tokens`` or capacity (``"length"``), or its streamer raised (``error``)."""
        args = self.args
        self.new.append(token)
        self.handle._put(token)
        if args.streamer is not None:
            try:
                args.streamer.put(torch.tensor([token]))
            except Exception as e:  # the caller's streamer: this request fails, nobody else
                self.error = e
                return True
        if token in args.eos_token_ids:
            self.finish_reason = "stop"
        elif args.stop_strings and ends_with_stop_string(args.tokenizer, self.new, args.stop_strings):
            self.finish_reason = "stop"
        elif len(self.new) >= args.max_new_tokens or len(self.prompt) + len(self.new) >= max_seq_len:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def end(self) -> None:
        """Done (finished, failed or cancelled): end its streamer, wake its caller."""
        if self.args.streamer is not None:
            try:
                self.args.streamer.end()
            except Exception as e:  # the caller's streamer: its request fails, nobody else
                self.error = self.error or e
        self.handle._finish()


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

    def __init__(self, request: Request):
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
