"""dflash-serve under load: 64 clients and 512 requests, the queue bound (429), a tokenizer without a chat template
and an API key."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from serve_support import (  # noqa: F401  (served, tok: fixtures)
    Engine, httpx, LiveServer, MODEL, openai, PROMPTS, served, solo, tok, _all_free, _pair, _sample, _wait_idle,
)


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
