"""dflash-serve's API through the official openai client: completions and chat, streamed and not, greedy text equal
to ``target.generate``'s; stop strings; seeded sampling under any load; models and health."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from serve_support import (  # noqa: F401  (served, tok: fixtures)
    CHAT_TEMPLATE, Detokenizer, DFlashSpecWrapper, Engine, httpx, LiveServer, MAX_SEQ_LEN, MODEL, PROMPTS,
    served, solo, tok, _all_free, _chat_ids, _models, _wait_idle,
)


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
