"""The wrapper behind the server: prompts in, text out, on the wrapper's own scheduler thread.

``Engine`` turns a checked request into token ids (the tokenizer, its chat template), refuses what the pair cannot
take (a prompt over the capacity, ``max_tokens`` past it, token ids outside the vocabulary) and what the queue
cannot hold (429), and submits the rest with ``spec.submit``. Each ``Generation`` receives its tokens through a
streamer the wrapper's driver thread calls: ``put`` hands each token to the event loop with
``loop.call_soon_threadsafe``, so nothing on the event loop ever waits for the model. Tokens that arrive together
(one step) are decoded together into a text delta; text is cut at the first stop string.
"""

from __future__ import annotations

import asyncio
import time

from .metrics import Metrics
from .protocol import APIError, ParsedRequest, SamplingParams, invalid

_END = object()


class Engine:
    """One served pair: ``spec`` (a ``DFlashSpecWrapper``), its tokenizer and chat template, and the admission bound:
    at most ``spec.max_batch_size + max_queued`` requests in flight, one more is answered 429."""

    def __init__(self, spec, tokenizer, model_name: str, *, max_queued: int, chat_template: str | None = None,
                 metrics: Metrics | None = None):
        if max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {max_queued}")
        if spec.tp is not None:  # every rank would have to submit the same requests in the same order
            raise ValueError("serving a tensor-parallel (multi-rank) target is not supported")
        self.spec, self.tokenizer, self.model_name = spec, tokenizer, model_name
        self.max_queued = max_queued
        self.chat_template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
        self.metrics = metrics or Metrics(model_name)
        self.metrics.watch_kv_cache(spec)
        self.live: set[Generation] = set()

    @property
    def max_model_len(self) -> int:
        return self.spec.max_seq_len

    @property
    def capacity(self) -> int:
        """Requests in flight before one more is refused: the running batch and the queue behind it."""
        return self.spec.max_batch_size + self.max_queued

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model '{model}' does not exist: this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def prompt_ids(self, request: ParsedRequest) -> list[int]:
        """The request's prompt as token ids (chat: rendered with the chat template), checked against the pair."""
        if request.chat:
            if not self.chat_template:
                raise invalid("messages", f"the model '{self.model_name}' has no chat template (its tokenizer "
                                          f"defines none): use /v1/completions, or start the server with "
                                          f"--chat-template FILE", code="no_chat_template")
            try:
                text = self.tokenizer.apply_chat_template(request.messages, chat_template=self.chat_template,
                                                          tokenize=False, add_generation_prompt=True)
            except Exception as e:  # the template's own checks (roles, order) raise from jinja
                raise invalid("messages", f"the chat template cannot render these messages: {e}") from None
            ids = self.tokenizer(text, add_special_tokens=False).input_ids
            where = "messages"
        elif isinstance(request.prompt, str):
            ids, where = self.tokenizer(request.prompt).input_ids, "prompt"
        else:
            ids, where = request.prompt, "prompt"
            vocab = self.spec.draft.config.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise invalid("prompt", f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if not ids:
            raise invalid(where, "the prompt is empty once tokenized")
        if len(ids) >= self.max_model_len:
            raise invalid(where, f"this model's maximum context length is {self.max_model_len} tokens and at least "
                                 f"one must be generated; the prompt has {len(ids)}", code="context_length_exceeded")
        return ids

    def max_new_tokens(self, request: ParsedRequest, prompt_len: int) -> int:
        room, params = self.max_model_len - prompt_len, request.params
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise invalid(request.max_tokens_field,
                          f"this model's maximum context length is {self.max_model_len} tokens; "
                          f"{prompt_len + params.max_tokens} were requested ({prompt_len} in the prompt, "
                          f"{params.max_tokens} to generate)", code="context_length_exceeded")
        return params.max_tokens

    def start(self, request: ParsedRequest, arrival: float) -> Generation:
        """Check ``request`` against the pair and the queue, then submit it (it joins the batch at the next step)."""
        prompt = self.prompt_ids(request)
        max_new = self.max_new_tokens(request, len(prompt))
        if len(self.live) >= self.capacity:
            raise APIError(429, f"the server is at capacity ({self.spec.max_batch_size} running, {self.max_queued} "
                                f"queued): retry later", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"})
        try:
            return Generation(self, prompt, request.params, max_new, arrival)
        except (ValueError, TypeError) as e:  # submit's own checks (the pair's, HF's generation arguments)
            raise invalid(None, str(e)) from None

    def cancel_all(self) -> None:
        for g in list(self.live):
            g.close()


class _Feed:
    """The streamer the wrapper's driver thread calls: tokens (and the end) go to the event loop's queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self._prompt = True

    def put(self, value) -> None:
        if self._prompt:  # submit pushes the prompt first, as HF streamers expect
            self._prompt = False
            return
        self.loop.call_soon_threadsafe(self.queue.put_nowait, int(value))

    def end(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, _END)


class Detokenizer:
    """The text of a growing token list, extended piece by piece so that the pieces add up to
    ``tokenizer.decode(tokens, skip_special_tokens=True)``: each new piece decodes a window from the last clean
    boundary, and text that may still change (a UTF-8 character split across tokens) waits for the next token."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""
        self._start = 0  # the window's first token
        self._read = 0  # tokens whose text is in ``text``

    def add(self, tokens: list[int], last: bool = False) -> None:
        self.tokens += tokens
        seen = self._decode(self.tokens[self._start:self._read])
        window = self._decode(self.tokens[self._start:])
        if len(window) > len(seen) and (last or not window.endswith("\ufffd")):
            self.text += window[len(seen):]
            self._start, self._read = self._read, len(self.tokens)

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True) if tokens else ""


class Generation:
    """One request in flight. ``deltas()`` yields ``(text, finish_reason)`` pairs as tokens arrive (the finish
    reason only on the last: ``"stop"`` for an eos token or a stop string, ``"length"`` for ``max_tokens``);
    ``close()`` cancels it when it has not finished (a client that left), freeing its blocks at the next step."""

    def __init__(self, engine: Engine, prompt: list[int], params: SamplingParams, max_new_tokens: int, arrival: float):
        self.engine, self.prompt, self.params, self.arrival = engine, prompt, params, arrival
        self.text = Detokenizer(engine.tokenizer)
        self.sent = 0  # characters of text handed out
        self.finish_reason: str | None = None
        self.first_token_at: float | None = None
        self._last_at = 0.0
        self._closed = False
        self._feed = _Feed(asyncio.get_running_loop())
        stops = dict(stop_strings=list(params.stop), tokenizer=engine.tokenizer) if params.stop else {}
        self.handle = engine.spec.submit(prompt, streamer=self._feed, **params.generate_kwargs(max_new_tokens), **stops)
        engine.live.add(self)
        engine.metrics.submitted()

    @property
    def num_tokens(self) -> int:
        return len(self.text.tokens)

    async def deltas(self):
        stop = self.params.stop
        hold = max(map(len, stop)) - 1 if stop else 0  # text that may be the start of a stop string waits
        while self.finish_reason is None:
            items = [await self._feed.queue.get()]
            while not self._feed.queue.empty():  # the rest of the step's tokens
                items.append(self._feed.queue.get_nowait())
            if self._closed:  # cancelled meanwhile (close())
                return
            ended = items[-1] is _END
            tokens = items[:-1] if ended else items
            if tokens:
                self._arrived(len(tokens))
            self.text.add(tokens, last=ended)
            text = self.text.text
            # A stop string not in the text handed out so far starts at ``sent`` or later (``hold`` kept it back).
            cut = min((i for i in (text.find(s, self.sent) for s in stop) if i >= 0), default=-1)
            reason = await self._outcome() if ended else None
            if cut >= 0:
                reason = "stop"
                if not ended:
                    self.handle.cancel()  # the wrapper stops there itself; this covers a decode it judged otherwise
            end = cut if cut >= 0 else (len(text) if ended else max(len(text) - hold, self.sent))
            delta, self.sent = text[self.sent:end], end
            if reason is not None:
                self._finish(reason)
            if delta or reason is not None:
                yield delta, reason

    async def _outcome(self) -> str:
        """The finish reason, once the driver has finished the request (it ends the streamer just before)."""
        h = self.handle
        try:
            result = h.result(0) if h.done() else await asyncio.to_thread(h.result)
        except BaseException:
            self._close_failed()
            raise
        self.engine.metrics.speculation(result.stats)
        return result.finish_reason

    def _arrived(self, n: int) -> None:
        """``n`` tokens arrived together (one step): the first token's latency, or the gap since the last step
        shared among them."""
        now = time.monotonic()
        m = self.engine.metrics
        if self.first_token_at is None:
            self.first_token_at = now
            m.first_token(now - self.arrival, len(self.prompt))
            m.inter_token(0.0, n - 1)  # later steps' tokens drained with the first one
        else:
            m.inter_token(now - self._last_at, n)
        self._last_at = now
        m.generated(n)

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        if not self._closed:
            self._closed = True
            self.engine.live.discard(self)
            self.engine.metrics.finished(reason, time.monotonic() - self.arrival, self.first_token_at is not None,
                                         len(self.prompt), self.num_tokens)

    def _close_failed(self) -> None:
        if not self._closed:
            self._closed = True
            self.engine.live.discard(self)
            self.engine.metrics.failed(self.first_token_at is not None)

    def close(self) -> None:
        """Cancel the request unless it finished (the client left or the server is stopping)."""
        if self._closed:
            return
        self.handle.cancel()
        self._finish("abort")
        self._feed.queue.put_nowait(_END)  # wakes ``deltas()``, which then returns
