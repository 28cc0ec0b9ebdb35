"""dflash-serve under faults: the bad-request table, clients that disconnect, and Prometheus metrics that move."""

from __future__ import annotations

import time

import pytest

from serve_support import (  # noqa: F401  (served, tok: fixtures)
    httpx, MAX_SEQ_LEN, MODEL, openai, PROMPTS, served, tok, _all_free, _sample, _wait_idle,
)


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
