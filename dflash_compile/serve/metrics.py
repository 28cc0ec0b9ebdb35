"""Prometheus metrics of one served model, named as vLLM names them (``<prefix>:<vLLM name>``).

Each server has its own registry (no process-global state): ``Metrics(...).exposition()`` is the text format
``GET /metrics`` returns. The speculative-decoding counters are the wrapper's own per-request counters
(``DFlashStats``: ``num_drafts``, ``num_draft_tokens``, ``num_accepted_tokens``, ``num_accepted_tokens_per_pos``),
added when a request finishes; the acceptance length is ``1 + accepted / drafts``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

DEFAULT_PREFIX = "dflash"
# Seconds. Latencies of a CPU server span milliseconds (a token) to minutes (a long request behind a queue).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class Metrics:
    """The counters, gauges and histograms of one served model (label ``model_name``); called on the event loop."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, prefix: str = DEFAULT_PREFIX):
        self.registry = r = CollectorRegistry()
        p, labels = prefix, ["model_name"]
        self._prefix = prefix

        def counter(name, doc, extra=()):
            return Counter(f"{p}:{name}", doc, labels + list(extra), registry=r)

        def histogram(name, doc, buckets):
            return Histogram(f"{p}:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        gauges = {name: Gauge(f"{p}:{name}", doc, labels, registry=r) for name, doc in (
            ("num_requests_running", "Requests that have their first token and are generating."),
            ("num_requests_waiting", "Requests accepted and waiting for their first token (queued or prefilling)."),
            ("kv_cache_usage_perc", "Share of the KV blocks held by requests (1 = all)."),
        )}
        self._running = gauges["num_requests_running"].labels(model_name)
        self._waiting = gauges["num_requests_waiting"].labels(model_name)
        self._kv_usage = gauges["kv_cache_usage_perc"].labels(model_name)
        self._success = counter("request_success", "Finished requests, by finish reason (stop, length, abort: the "
                                                   "client left).", ["finished_reason"])
        self._failure = counter("request_failure", "Requests that failed in the model (HTTP 500).").labels(model_name)
        self._rejected = counter("request_rejected", "Requests refused before any model work, by HTTP status.",
                                 ["status"])
        self._prompt_tokens = counter("prompt_tokens", "Prefilled prompt tokens.").labels(model_name)
        self._generation_tokens = counter("generation_tokens", "Generated tokens.").labels(model_name)
        self._drafts = counter("spec_decode_num_drafts", "Steps that verified drafts.").labels(model_name)
        self._draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.").labels(model_name)
        self._accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.").labels(model_name)
        self._accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                         "Draft tokens accepted, by draft position (0: the first draft).",
                                         ["position"])
        self._ttft = histogram("time_to_first_token_seconds", "Arrival to the first token.", _TTFT_BUCKETS)
        self._itl = histogram("inter_token_latency_seconds", "Time between a request's steps, shared among the "
                                                             "tokens the later step gave it.", _ITL_BUCKETS)
        self._e2e = histogram("e2e_request_latency_seconds", "Arrival to the last token (finished requests).",
                              _E2E_BUCKETS)
        self._request_prompt = histogram("request_prompt_tokens", "Prompt tokens per finished request.",
                                         _TOKEN_BUCKETS)
        self._request_generation = histogram("request_generation_tokens", "Generated tokens per finished request.",
                                             _TOKEN_BUCKETS)
        self.model_name = model_name

    def watch_kv_cache(self, spec) -> None:
        """``kv_cache_usage_perc`` reads the wrapper's pools when scraped (0 before the first request)."""

        def usage() -> float:
            cache = spec.scheduler.cache
            return 1.0 - cache.num_free_blocks / cache.num_blocks if cache is not None and cache.num_blocks else 0.0

        self._kv_usage.set_function(usage)
        self.registry.register(_PrefixCacheCollector(spec, self._prefix, self.model_name))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def submitted(self) -> None:
        self._waiting.inc()

    def first_token(self, seconds: float, prompt_tokens: int) -> None:
        self._waiting.dec()
        self._running.inc()
        self._ttft.observe(seconds)
        self._prompt_tokens.inc(prompt_tokens)

    def inter_token(self, seconds: float, tokens: int) -> None:
        for _ in range(tokens):
            self._itl.observe(seconds / tokens)

    def generated(self, tokens: int) -> None:
        self._generation_tokens.inc(tokens)

    def finished(self, reason: str, seconds: float, started: bool, prompt_tokens: int, tokens: int) -> None:
        (self._running if started else self._waiting).dec()
        self._success.labels(self.model_name, reason).inc()
        if reason != "abort":
            self._e2e.observe(seconds)
            self._request_prompt.observe(prompt_tokens)
            self._request_generation.observe(tokens)

    def failed(self, started: bool) -> None:
        (self._running if started else self._waiting).dec()
        self._failure.inc()

    def rejected(self, status: int) -> None:
        self._rejected.labels(self.model_name, str(status)).inc()

    def speculation(self, stats) -> None:
        self._drafts.inc(stats.num_drafts)
        self._draft_tokens.inc(stats.num_draft_tokens)
        self._accepted.inc(stats.num_accepted_tokens)
        for position, n in enumerate(stats.num_accepted_tokens_per_pos):
            self._accepted_per_pos.labels(self.model_name, str(position)).inc(n)


class _PrefixCacheCollector:
    """vLLM's prefix-cache counters (``prefix_cache_queries``, ``prefix_cache_hits``: prompt tokens looked up and
    found cached), read from the wrapper's pools when scraped."""

    def __init__(self, spec, prefix: str, model_name: str):
        self.spec, self.prefix, self.model_name = spec, prefix, model_name

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        stats = self.spec.prefix_cache_stats()
        for name, key, doc in (("prefix_cache_queries", "query_tokens", "Prompt tokens looked up in the prefix cache."),
                               ("prefix_cache_hits", "hit_tokens", "Prompt tokens found in the prefix cache (their "
                                                                  "prefill skipped).")):
            family = CounterMetricFamily(f"{self.prefix}:{name}", doc, labels=["model_name"])
            family.add_metric([self.model_name], stats[key])
            yield family
