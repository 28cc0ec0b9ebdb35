"""Shared by the dflash-serve tests: a live server (uvicorn in a thread, 127.0.0.1, an ephemeral port) over a tiny
random Qwen3 target and drafter with the shipped pair's byte-level tokenizer, the official ``openai`` client, and the
greedy references. Importing it skips the importing test module when the serve or dev extra is missing."""

from __future__ import annotations

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
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402, F401  (re-exported for the tests)

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper  # noqa: E402
from dflash_compile.assets import tiny_pair_paths  # noqa: E402
from dflash_compile.serve.app import create_app  # noqa: E402
from dflash_compile.serve import cli  # noqa: E402, F401  (re-exported for the tests)
from dflash_compile.serve.cli import bind, url  # noqa: E402
from dflash_compile.serve.engine import Detokenizer, Engine  # noqa: E402, F401  (Detokenizer: re-exported)
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
