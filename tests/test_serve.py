"""dflash-serve: a live server on 127.0.0.1 (an ephemeral port, uvicorn in a thread) over a tiny random Qwen3 target
and drafter with the shipped pair's byte-level tokenizer, driven by the official ``openai`` client: completions and
chat, streamed and not, greedy text equal to ``target.generate``'s; stop strings; a bounded load test with clients
that disconnect mid-stream; the bad-request table; the queue bound (429); Prometheus metrics; the command line."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("starlette", reason="the serve extra is not installed (pip install -e '.[dev]')")
pytest.importorskip("uvicorn", reason="the serve extra is not installed (pip install -e '.[dev]')")
pytest.importorskip("prometheus_client", reason="the serve extra is not installed (pip install -e '.[dev]')")
openai = pytest.importorskip("openai", reason="the dev extra is not installed (pip install -e '.[dev]')")
httpx = pytest.importorskip("httpx", reason="the dev extra is not installed (pip install -e '.[dev]')")

import uvicorn  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper  # noqa: E402
from dflash_compile.assets import tiny_pair_paths  # noqa: E402
from dflash_compile.serve.app import create_app  # noqa: E402
from dflash_compile.serve import cli  # noqa: E402
from dflash_compile.serve.cli import bind, url  # noqa: E402
from dflash_compile.serve.engine import Detokenizer, Engine  # noqa: E402
from tiny_models import tiny_target  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny"
MAX_SEQ_LEN = 256
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
PROMPTS = [
    "def fib(n):\n", "import os\n\n\ndef read(path):", "class Stack:\n    def push(self, x):", "x = [",
    "# a comment about sorting\n", "for i in range(10):\n    print(", "return", "with open(name) as f:\n",
    "def add(a, b):\n    return a +", "lambda", "async def main():\n    await", "try:\n    pass\nexcept",
    "@property\ndef", "while True:", "if __name__ == '__main__':\n    main()", "print('hello, world')",
]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(tiny_pair_paths()[0])


def _models(tok):
    target = tiny_target("qwen3", vocab_size=len(tok), num_hidden_layers=2, max_position_embeddings=1024)
    return target, DFlashDraftModel.from_target(target, num_layers=1, block_size=4, seed=0)


def _pair(tok, **wrapper):
    target, draft = _models(tok)
    # a fixed K, so that the tests that count steps know what each one verifies
    wrapper = {"max_seq_len": MAX_SEQ_LEN, "page_size": 8, **wrapper}
    return target, DFlashSpecWrapper(target, draft, 3, **wrapper)


class LiveServer:
    """uvicorn serving ``create_app(engine)`` in a thread, on 127.0.0.1 at a free port."""

    def __init__(self, engine, **app):
        self.engine = engine
        sock = bind("127.0.0.1", 0)
        self.url = url(sock)
        self.server = uvicorn.Server(uvicorn.Config(create_app(engine, **app), log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs=dict(sockets=[sock]), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60, **kw)

    def metrics(self) -> dict:
        """``{(name, labels as a sorted tuple): value}`` of every sample ``/metrics`` gives."""
        text = httpx.get(self.url + "/metrics").text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)


def _sample(metrics: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted({"model_name": MODEL, **labels}.items())))
    return metrics.get(key, 0.0)


def _wait_idle(spec, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not spec.scheduler.idle():
        assert time.monotonic() < deadline, "the scheduler did not go idle"
        time.sleep(0.01)


def _all_free(spec) -> bool:
    cache = spec.scheduler.cache
    return cache is None or (cache.num_free_blocks == cache.num_blocks and cache.num_free_state_slots == (
        spec.max_batch_size if cache.has_states else 0))


@pytest.fixture(scope="module")
def served(tok):
    target, spec = _pair(tok, max_batch_size=16, prefix_caching=True)  # as dflash-serve runs by default
    engine = Engine(spec, tok, MODEL, max_queued=64, chat_template=CHAT_TEMPLATE)
    server = LiveServer(engine)
    server.target, server.spec, server.tok = target, spec, tok
    server.solo_cache = {}
    yield server
    server.stop()
    _wait_idle(spec)
    spec.close()


def solo(server, ids: list[int], n: int) -> tuple[list[int], str]:
    """``target.generate``'s greedy tokens after ``ids`` (``n`` of them) and their text; run while the server is idle
    (the wrapper's hooks record its own forwards only, but a step and a plain generate must not overlap)."""
    key = (tuple(ids), n)
    if key not in server.solo_cache:
        _wait_idle(server.spec)
        out = server.target.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
        server.solo_cache[key] = out[0, len(ids):].tolist()
    tokens = server.solo_cache[key]
    return tokens, server.tok.decode(tokens, skip_special_tokens=True)


def _chat_ids(tok, messages):
    text = tok.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False).input_ids


# ---------------------------------------------------------------------------------------------- text assembly
def test_detokenizer_pieces_add_up_to_decode(tok):
    """Random byte-level tokens (UTF-8 characters split across tokens, stray continuation bytes, special tokens) fed
    in random runs: the pieces always add up to ``decode(all, skip_special_tokens=True)``."""
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        tokens = torch.randint(0, len(tok), (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
        d = Detokenizer(tok)
        i = 0
        while i < len(tokens):
            step = int(torch.randint(1, 5, (1,), generator=g))
            before = d.text
            d.add(tokens[i:i + step], last=i + step >= len(tokens))
            assert d.text.startswith(before)
            i += step
        assert d.text == tok.decode(tokens, skip_special_tokens=True), trial


# ---------------------------------------------------------------------------------------------- greedy identity
@pytest.mark.parametrize("prompt", [PROMPTS[0], PROMPTS[2], "ünïcödé — ∑ 😀"])
def test_completion_greedy_equals_generate(served, prompt):
    client = served.client()
    ids = served.tok(prompt).input_ids
    tokens, text = solo(served, ids, 24)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert out.choices[0].text == text
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        len(ids), 24, len(ids) + 24)
    assert out.model == MODEL and out.object == "text_completion"

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices
    assert len({c.id for c in chunks}) == 1

    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0)  # token ids
    assert by_ids.choices[0].text == text
    _wait_idle(served.spec)
    assert _all_free(served.spec)


def test_chat_greedy_equals_generate(served):
    client = served.client()
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def fib(n):"}]
    ids = _chat_ids(served.tok, messages)
    _, text = solo(served, ids, 20)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert out.choices[0].message.content == text and out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == "length" and out.usage.prompt_tokens == len(ids)
    assert out.object == "chat.completion"

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=20,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" for c in chunks)

    parts = [{"role": "user", "content": [{"type": "text", "text": "def "}, {"type": "text", "text": "fib(n):"}]}]
    _, parts_text = solo(served, _chat_ids(served.tok, [{"role": "user", "content": "def fib(n):"}]), 8)
    out = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=8, temperature=0)
    assert out.choices[0].message.content == parts_text


def test_chat_without_max_tokens_runs_to_capacity(served):
    messages = [{"role": "user", "content": "x = ["}]
    ids = _chat_ids(served.tok, messages)
    out = served.client().chat.completions.create(model=MODEL, messages=messages, temperature=0)
    assert out.usage.completion_tokens == MAX_SEQ_LEN - len(ids)
    assert out.choices[0].message.content == solo(served, ids, MAX_SEQ_LEN - len(ids))[1]


def test_stop_strings_cut_the_text(served):
    client = served.client()
    prompt = PROMPTS[1]
    _, text = solo(served, served.tok(prompt).input_ids, 30)
    assert len(text) > 12, text
    stop = text[6:9]  # its first occurrence may be earlier
    cut = text[:text.index(stop)]
    for stops in (stop, [stop, "never in there"]):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=stops)
        assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=stops,
                                                stream=True))
        assert "".join(c.choices[0].text for c in chunks) == cut
        assert chunks[-1].choices[0].finish_reason == "stop"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop="never in there")
    assert out.choices[0].text == text and out.choices[0].finish_reason == "length"
    _wait_idle(served.spec)
    assert _all_free(served.spec)


def test_seeded_sampling_reproduces(served):
    client = served.client()
    kw = dict(model=MODEL, prompt=PROMPTS[3], max_tokens=16, temperature=0.9, top_p=0.95, seed=7)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    c = client.completions.create(**{**kw, "seed": 8})
    assert a.choices[0].text == b.choices[0].text
    assert a.usage.completion_tokens == 16 and c.usage.completion_tokens == 16
    d = client.completions.create(**kw, extra_body={"top_k": 5})
    assert d.usage.completion_tokens == 16


def test_seeded_text_is_the_same_under_any_load(tok):
    """The default speculation (``auto``: K from measured step times and the batch) behind the server: the same
    seeded request alone and among 7 concurrent others (greedy and sampled) returns the same text."""
    target, draft = _models(tok)
    spec = DFlashSpecWrapper(target, draft, max_batch_size=8, max_seq_len=MAX_SEQ_LEN, page_size=8)
    server = LiveServer(Engine(spec, tok, MODEL, max_queued=16, chat_template=CHAT_TEMPLATE))
    try:
        client = server.client()
        kw = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=24, temperature=0.9, seed=5, extra_body={"top_k": 20})
        alone = client.completions.create(**kw).choices[0].text

        def other(i):
            extra = dict(temperature=1.0, seed=50 + i) if i % 2 else dict(temperature=0)
            return server.client().completions.create(model=MODEL, prompt=PROMPTS[i % len(PROMPTS)],
                                                     max_tokens=8 + 5 * i, **extra)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            others = [pool.submit(other, i) for i in range(7)]
            busy = pool.submit(lambda: client.completions.create(**kw).choices[0].text).result()
            assert all(f.result().usage.completion_tokens == 8 + 5 * i for i, f in enumerate(others))
        assert busy == alone and len(alone) > 0
    finally:
        server.stop()
        _wait_idle(spec)
        spec.close()


def test_models_and_health(served):
    models = served.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].max_model_len == MAX_SEQ_LEN
    r = httpx.get(served.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


# ---------------------------------------------------------------------------------------------- faults
def _bad_cases(tok):
    over = [5] * MAX_SEQ_LEN
    c, ch = "/v1/completions", "/v1/chat/completions"
    ok, msg = {"model": MODEL, "prompt": "def f():"}, [{"role": "user", "content": "hi"}]
    return [  # (name, route, body, status, error type, param)
        ("negative max_tokens", c, {**ok, "max_tokens": -1}, 400, "invalid_request_error", "max_tokens"),
        ("zero max_tokens", c, {**ok, "max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
        ("huge max_tokens", c, {**ok, "max_tokens": 10**9}, 400, "invalid_request_error", "max_tokens"),
        ("max_tokens past capacity", c, {**ok, "max_tokens": MAX_SEQ_LEN}, 400, "invalid_request_error", "max_tokens"),
        ("max_tokens a string", c, {**ok, "max_tokens": "8"}, 400, "invalid_request_error", "max_tokens"),
        ("max_tokens a float", c, {**ok, "max_tokens": 2.5}, 400, "invalid_request_error", "max_tokens"),
        ("prompt ids at capacity", c, {**ok, "prompt": over}, 400, "invalid_request_error", "prompt"),
        ("prompt text over capacity", c, {**ok, "prompt": "word " * 4 * MAX_SEQ_LEN}, 400, "invalid_request_error",
         "prompt"),
        ("prompt token id outside the vocabulary", c, {**ok, "prompt": [1, len(tok) + 10]}, 400,
         "invalid_request_error", "prompt"),
        ("prompt missing", c, {"model": MODEL}, 400, "invalid_request_error", "prompt"),
        ("prompt a number", c, {**ok, "prompt": 5}, 400, "invalid_request_error", "prompt"),
        ("prompt empty", c, {**ok, "prompt": ""}, 400, "invalid_request_error", "prompt"),
        ("several prompts", c, {**ok, "prompt": ["a", "b"]}, 400, "invalid_request_error", "prompt"),
        ("malformed JSON", c, b'{"model": "tiny", "prompt": ', 400, "invalid_request_error", None),
        ("empty body", c, b"", 400, "invalid_request_error", None),
        ("JSON array body", c, b"[1, 2]", 400, "invalid_request_error", None),
        ("unknown model", c, {**ok, "model": "gpt-17"}, 404, "invalid_request_error", "model"),
        ("model a number", c, {**ok, "model": 3}, 400, "invalid_request_error", "model"),
        ("n = 2", c, {**ok, "n": 2}, 400, "invalid_request_error", "n"),
        ("temperature a string", c, {**ok, "temperature": "hot"}, 400, "invalid_request_error", "temperature"),
        ("temperature negative", c, {**ok, "temperature": -0.5}, 400, "invalid_request_error", "temperature"),
        ("top_p zero", c, {**ok, "top_p": 0}, 400, "invalid_request_error", "top_p"),
        ("top_p above one", c, {**ok, "top_p": 1.5}, 400, "invalid_request_error", "top_p"),
        ("top_k below -1", c, {**ok, "top_k": -2}, 400, "invalid_request_error", "top_k"),
        ("seed a string", c, {**ok, "seed": "7"}, 400, "invalid_request_error", "seed"),
        ("stream a string", c, {**ok, "stream": "yes"}, 400, "invalid_request_error", "stream"),
        ("stream_options without stream", c, {**ok, "stream_options": {"include_usage": True}}, 400,
         "invalid_request_error", "stream_options"),
        ("stop a number", c, {**ok, "stop": 5}, 400, "invalid_request_error", "stop"),
        ("stop an empty string", c, {**ok, "stop": [""]}, 400, "invalid_request_error", "stop"),
        ("unknown field", c, {**ok, "repetition_penalty": 1.2}, 400, "invalid_request_error", "repetition_penalty"),
        ("logprobs", c, {**ok, "logprobs": 2}, 400, "invalid_request_error", "logprobs"),
        ("echo", c, {**ok, "echo": True}, 400, "invalid_request_error", "echo"),
        ("presence_penalty", c, {**ok, "presence_penalty": 0.5}, 400, "invalid_request_error", "presence_penalty"),
        ("messages missing", ch, {"model": MODEL}, 400, "invalid_request_error", "messages"),
        ("messages empty", ch, {"model": MODEL, "messages": []}, 400, "invalid_request_error", "messages"),
        ("message without content", ch, {"model": MODEL, "messages": [{"role": "user"}]}, 400,
         "invalid_request_error", "messages[0].content"),
        ("message with an image", ch, {"model": MODEL, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "invalid_request_error", "messages[0].content"),
        ("chat prompt field", ch, {"model": MODEL, "messages": msg, "prompt": "x"}, 400, "invalid_request_error",
         "prompt"),
        ("chat tools", ch, {"model": MODEL, "messages": msg, "tools": [{"type": "function"}]}, 400,
         "invalid_request_error", "tools"),
        ("chat logprobs", ch, {"model": MODEL, "messages": msg, "logprobs": True}, 400, "invalid_request_error",
         "logprobs"),
        ("chat JSON output", ch, {"model": MODEL, "messages": msg, "response_format": {"type": "json_object"}}, 400,
         "invalid_request_error", "response_format"),
        ("chat huge max_completion_tokens", ch, {"model": MODEL, "messages": msg, "max_completion_tokens": 10**6},
         400, "invalid_request_error", "max_completion_tokens"),
        ("unknown route", "/v1/embeddings", ok, 404, "invalid_request_error", None),
    ]


def test_bad_requests_table(served):
    """Each bad request: its status and OpenAI error body; the server serves a good request after all of them."""
    cases = _bad_cases(served.tok)
    before = served.metrics()
    with httpx.Client(base_url=served.url, timeout=30) as http:
        for name, route, body, status, kind, param in cases:
            r = http.post(route, content=body) if isinstance(body, bytes) else http.post(route, json=body)
            assert r.status_code == status, (name, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, name
            assert (error["type"], error["param"]) == (kind, param), (name, error)
            assert error["message"], name
        r = http.get("/v1/completions")
        assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
        assert http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}).status_code == 200
    with pytest.raises(openai.BadRequestError) as e:  # the client maps them as for OpenAI's API
        served.client().completions.create(model=MODEL, prompt="x", max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        served.client().completions.create(model="gpt-17", prompt="x")
    after = served.metrics()
    rejected = sum(1 for c in cases if c[1].startswith("/v1/c") and c[3] == 400) + 1
    assert _sample(after, "dflash:request_rejected_total", status="400") - _sample(
        before, "dflash:request_rejected_total", status="400") == rejected
    _wait_idle(served.spec)
    assert _all_free(served.spec)


def test_disconnects_cancel_their_requests(served):
    """A client that leaves mid-stream, and one that stops waiting for a whole response: both requests are
    cancelled (finish reason ``abort``) long before their ``max_tokens``, and their blocks are freed."""
    before = served.metrics()
    ids = served.tok(PROMPTS[4]).input_ids
    n = MAX_SEQ_LEN - len(ids)
    stream = served.client().completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=n, temperature=0,
                                                stream=True)
    next(iter(stream))
    stream.close()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.url + "/v1/completions", json=dict(model=MODEL, prompt=PROMPTS[4], max_tokens=n),
                   timeout=httpx.Timeout(5, read=0.05))
    deadline = time.monotonic() + 30
    while _sample(served.metrics(), "dflash:request_success_total", finished_reason="abort") - _sample(
            before, "dflash:request_success_total", finished_reason="abort") < 2:
        assert time.monotonic() < deadline, "the disconnected requests were not aborted"
        time.sleep(0.02)
    _wait_idle(served.spec)
    assert _all_free(served.spec)
    after = served.metrics()
    generated = _sample(after, "dflash:generation_tokens_total") - _sample(before, "dflash:generation_tokens_total")
    assert generated < 2 * n
    assert _sample(after, "dflash:num_requests_running") == _sample(after, "dflash:num_requests_waiting") == 0


def test_metrics_parse_and_move(served):
    before = served.metrics()
    out = served.client().completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=12, temperature=0)
    list(served.client().completions.create(model=MODEL, prompt=PROMPTS[6], max_tokens=12, temperature=0,
                                            stream=True))
    after = served.metrics()

    def moved(name, **labels):
        return _sample(after, name, **labels) - _sample(before, name, **labels)

    assert moved("dflash:request_success_total", finished_reason="length") == 2
    assert moved("dflash:generation_tokens_total") == 24
    assert moved("dflash:prompt_tokens_total") == out.usage.prompt_tokens + len(served.tok(PROMPTS[6]).input_ids)
    assert moved("dflash:time_to_first_token_seconds_count") == 2
    assert moved("dflash:e2e_request_latency_seconds_count") == 2
    assert moved("dflash:inter_token_latency_seconds_count") == 22  # every token after each request's first
    assert moved("dflash:request_generation_tokens_count") == 2
    drafts = moved("dflash:spec_decode_num_drafts_total")
    assert drafts > 0 and moved("dflash:spec_decode_num_draft_tokens_total") == 3 * drafts
    accepted = moved("dflash:spec_decode_num_accepted_tokens_total")
    assert accepted == sum(moved("dflash:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
                           for p in range(3))
    assert 0 <= _sample(after, "dflash:kv_cache_usage_perc") <= 1
    for gauge in ("dflash:num_requests_running", "dflash:num_requests_waiting"):
        assert (gauge, (("model_name", MODEL),)) in after
    assert moved("dflash:prefix_cache_queries_total") == out.usage.prompt_tokens + len(served.tok(PROMPTS[6]).input_ids)
    stats = served.spec.prefix_cache_stats()
    assert _sample(after, "dflash:prefix_cache_hits_total") == stats["hit_tokens"]
    text = httpx.get(served.url + "/metrics").text
    assert "# TYPE dflash:time_to_first_token_seconds histogram" in text
    assert "# TYPE dflash:spec_decode_num_drafts_total counter" in text


def test_load_64_clients_512_requests(served):
    """64 concurrent clients send 512 requests; one in ten leaves after two chunks of its stream. Every other
    request gets exactly its solo greedy text (streamed: no chunk lost or repeated); /health answers throughout;
    at the end nothing is in flight and every KV block is free."""
    tok = served.tok
    ids = [tok(p).input_ids for p in PROMPTS]
    texts = {(i, n): solo(served, ids[i], n)[1] for i in range(len(PROMPTS)) for n in (6, 12)}
    before = served.metrics()
    clients, requests = 64, 512
    results: dict[int, tuple[str, str | None]] = {}
    health: list[float] = []

    async def one(client, i):
        p, n = i % len(PROMPTS), (6, 12)[i % 2]
        if i % 10 == 0:  # leaves mid-stream
            stream = await client.completions.create(model=MODEL, prompt=PROMPTS[p], max_tokens=60, temperature=0,
                                                     stream=True)
            got = 0
            async for _ in stream:
                got += 1
                if got == 2:
                    break
            await stream.close()
            return
        if i % 3 == 0:
            out = await client.completions.create(model=MODEL, prompt=PROMPTS[p], max_tokens=n, temperature=0)
            results[i] = (out.choices[0].text, out.choices[0].finish_reason)
            return
        pieces, finish = [], []
        stream = await client.completions.create(model=MODEL, prompt=PROMPTS[p], max_tokens=n, temperature=0,
                                                 stream=True)
        async for chunk in stream:
            pieces.append(chunk.choices[0].text)
            finish.append(chunk.choices[0].finish_reason)
        assert finish[-1] == "length" and not any(finish[:-1]), (i, finish)
        results[i] = ("".join(pieces), finish[-1])

    async def worker(client, w, done):
        async with client:
            for i in range(w, requests, clients):
                await one(client, i)
        done.append(w)

    async def watch_health(done):
        async with httpx.AsyncClient(base_url=served.url, timeout=10) as http:
            while len(done) < clients:
                start = time.monotonic()
                r = await http.get("/health")
                assert r.status_code == 200
                health.append(time.monotonic() - start)
                await asyncio.sleep(0.05)

    async def main():
        done: list[int] = []
        # one client (and connection pool) each, made before the clock starts (each loads its TLS context)
        pool = [openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)
                for _ in range(clients)]
        nonlocal start
        start = time.monotonic()
        await asyncio.gather(watch_health(done), *(worker(c, w, done) for w, c in enumerate(pool)))

    start = 0.0
    asyncio.run(main())
    wall = time.monotonic() - start
    expected = {i for i in range(requests) if i % 10}
    assert set(results) == expected
    wrong = [i for i in expected if results[i] != (texts[(i % len(PROMPTS), (6, 12)[i % 2])], "length")]
    assert not wrong, [(i, results[i]) for i in wrong[:3]]
    assert len(health) >= 3 and max(health) < 5.0, (len(health), max(health))
    _wait_idle(served.spec)
    assert _all_free(served.spec)
    after = served.metrics()
    assert _sample(after, "dflash:num_requests_running") == _sample(after, "dflash:num_requests_waiting") == 0
    finished = sum(_sample(after, "dflash:request_success_total", finished_reason=r) - _sample(
        before, "dflash:request_success_total", finished_reason=r) for r in ("stop", "length", "abort"))
    assert finished == requests
    health.sort()
    print(f"load: {requests} requests from {clients} clients in {wall:.1f} s; /health {len(health)} answers, "
          f"p50 {health[len(health) // 2] * 1e3:.0f} ms, max {health[-1] * 1e3:.0f} ms")


# ---------------------------------------------------------------------------------------------- other servers
def test_queue_bound_answers_429(tok):
    """One running and one queued request fill a server with --max-batch-size 1 --max-queued 1: a third gets 429
    with Retry-After, and is served once they leave."""
    _, spec = _pair(tok, max_batch_size=1, max_seq_len=1024)  # long requests: they outlast the third one
    server = LiveServer(Engine(spec, tok, MODEL, max_queued=1))
    try:
        client = server.client()
        ids = tok(PROMPTS[0]).input_ids
        streams = [client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1024 - len(ids),
                                             temperature=0, stream=True) for _ in range(2)]
        next(iter(streams[0]))
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == "queue_full"
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        for s in streams:
            s.close()
        deadline = time.monotonic() + 30
        while True:
            r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
            if r.status_code == 200:
                break
            assert r.status_code == 429 and time.monotonic() < deadline
            time.sleep(0.05)
        assert _sample(server.metrics(), "dflash:request_rejected_total", status="429") >= 2
        _wait_idle(spec)
        assert _all_free(spec)
    finally:
        server.stop()
        _wait_idle(spec)
        spec.close()


def test_no_chat_template_and_api_key(tok, served):
    """A second server over the same wrapper: its tokenizer has no chat template (chat is a clear 400) and it needs an
    API key (401 without; /health and /metrics stay open)."""
    assert tok.chat_template is None
    server = LiveServer(Engine(served.spec, tok, MODEL, max_queued=4), api_key="s3cret")
    try:
        with pytest.raises(openai.AuthenticationError):
            server.client().completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert httpx.get(server.url + "/v1/models").status_code == 401
        assert httpx.get(server.url + "/health").status_code == 200
        assert httpx.get(server.url + "/metrics").status_code == 200
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["code"] == "no_chat_template" and "chat template" in e.value.body["message"]
        out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0)
        assert out.choices[0].text == solo(served, tok(PROMPTS[0]).input_ids, 5)[1]
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------------- the command line
@pytest.mark.parametrize("args, message", [
    (["--max-batch-size", "0"], "--max-batch-size must be an integer >= 1, got 0"),
    (["--max-queued", "-1"], "--max-queued must be an integer >= 0"),
    (["--port", "70000"], "--port must be in [0, 65535]"),
    (["--backend", "tvm"], "--backend must be one of"),
    (["--target", "no/such/dir", "--draft", "no/such/dir"], "--target no/such/dir: no such directory"),
    (["--draft", "."], "--draft / --speculative-config need --target"),
    (["--target", "."], "--target needs --draft or --speculative-config"),
    (["--target", ".", "--speculative-config", "{not json"], "--speculative-config is not JSON"),
    (["--chat-template", "no/such/file.jinja"], "--chat-template no/such/file.jinja: cannot read it"),
])
def test_cli_refuses_bad_arguments(args, message, capsys):
    """One line on stderr and exit status 2, before anything is loaded."""
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_cli_serves_a_saved_pair(tok, tmp_path):
    """``python -m dflash_compile.serve --target T --draft D --port 0``: prints its address, answers, and stops cleanly
    on SIGINT."""
    target, draft = _models(tok)
    target.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    draft.save_pretrained(tmp_path / "draft")
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "target")  # as the server loads it
    ids = tok(PROMPTS[0]).input_ids
    expected = tok.decode(target.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):],
                          skip_special_tokens=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "dflash_compile.serve", "--target", str(tmp_path / "target"),
                             "--draft", str(tmp_path / "draft"), "--port", "0", "--backend", "eager",
                             "--served-model-name", MODEL, "--max-model-len", str(MAX_SEQ_LEN),
                             "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "serving 'tiny'" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        base = line.split(" on ")[-1].strip()
        assert base.startswith("http://127.0.0.1:")
        assert httpx.get(base + "/health").status_code == 200
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
        assert out.choices[0].text == expected
        assert json.loads(httpx.get(base + "/v1/models").text)["data"][0]["max_model_len"] == MAX_SEQ_LEN
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
