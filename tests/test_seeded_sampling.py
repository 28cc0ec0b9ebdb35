"""The same seed gives the same text: a seeded sampled request's tokens are a function of its seed, its positions
and the target's distribution only, whatever K each step verifies (0, 1, 7, switching, or chosen by ``auto``),
whoever shares the batch (greedy and sampled rows, joining and leaving at other steps), eager or compiled. (Two
gloo ranks: tests/test_tensor_parallel.py; the server under two loads: tests/test_serve_api.py.)"""

import threading
import time

import pytest

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper
from oracle_draft import SWITCHING, CyclePolicy
from tiny_models import VOCAB, random_prompts, tiny_target

NEW = 24
KW = dict(max_new_tokens=NEW, do_sample=True, temperature=0.9, top_k=20)
PROMPT = random_prompts([9], seed=5)[0]


@pytest.fixture(scope="module")
def pair():
    target = tiny_target("qwen3")
    draft = DFlashDraftModel.from_target(target, num_layers=2, block_size=8, target_layer_ids=[1, 3], seed=0,
                                         mask_token_id=VOCAB - 1)
    return target, draft


def _alone(target, draft, seed=11, **wrapper):
    with DFlashSpecWrapper(target, draft, max_batch_size=8, max_seq_len=128, **wrapper) as spec:
        h = spec.submit(PROMPT, seed=seed, **KW)
        return h.result().tokens, h.stats.step_ks


@pytest.fixture(scope="module")
def reference(pair):
    tokens, ks = _alone(*pair, num_speculative_tokens=0)  # plain sampling through the same pools
    assert len(tokens) == NEW and set(ks) == {0}
    return tokens


def test_same_tokens_for_every_k(pair, reference):
    target, draft = pair
    assert _alone(target, draft, seed=12, num_speculative_tokens=0)[0] != reference  # the seed matters
    for k in (1, 7):
        tokens, ks = _alone(target, draft, num_speculative_tokens=k)
        assert tokens == reference and set(ks) == {k}, k
    tokens, ks = _alone(target, draft, speculation=CyclePolicy(SWITCHING))
    assert tokens == reference and len(set(ks)) >= 4, ks
    tokens, ks = _alone(target, draft)  # speculation="auto": each step's K from this machine's timings
    assert tokens == reference, ks


def _running(spec) -> int:
    batch = spec.scheduler.batch
    return 0 if batch is None else len(batch.rows)


def test_same_tokens_in_a_busy_batch_under_auto(pair, reference):
    target, draft = pair
    others = random_prompts([3, 30, 14, 7, 21, 5], seed=6)
    with DFlashSpecWrapper(target, draft, max_batch_size=8, max_seq_len=128) as spec:
        results, start = {}, threading.Barrier(len(others))

        def caller(i, prompt):
            kw = dict(max_new_tokens=5 + 7 * i)  # rows leave the batch at other steps
            if i % 2:
                kw.update(do_sample=True, temperature=1.1, top_p=0.9, seed=100 + i)
            start.wait()
            results[i] = spec.submit(prompt, **kw).result().tokens

        threads = [threading.Thread(target=caller, args=(i, p)) for i, p in enumerate(others)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while _running(spec) < 3:  # join a batch already running: not in its first row
            assert time.monotonic() < deadline, "the other callers' requests never ran"
            time.sleep(0.001)
        h = spec.submit(PROMPT, seed=11, **KW)
        mine = h.result().tokens
        for t in threads:
            t.join()
    assert mine == reference, h.stats.step_ks
    assert sorted(len(v) for v in results.values()) == [5 + 7 * i for i in range(len(others))]


@pytest.mark.parametrize("buckets", [(2,), (2, 4)], ids=["static-batch", "dynamic-batch"])
def test_same_tokens_compiled(pair, reference, buckets):
    # (2, 4): one graph for both buckets, its batch a dynamic size (StepKeys.open_batch), run at 3 rows in bucket 4
    target, draft = pair
    others = random_prompts([12, 7][: max(buckets) - 1], seed=8)
    with DFlashSpecWrapper(target, draft, num_speculative_tokens=3, max_batch_size=max(buckets), max_seq_len=128,
                           batch_buckets=buckets) as spec:
        spec.compile(backend="dflash", fullgraph=True)
        handles = [spec.submit(p, seed=seed, **KW) for p, seed in zip([PROMPT] + others, (11, 3, 5))]
        tokens = handles[0].result().tokens
        assert all(len(h.result().tokens) == NEW for h in handles)
        keys = {key for key, how, _ in spec.compiled_steps.events if how == "compiled"}
        assert keys and all((key.batch is None) == (len(buckets) > 1) for key in keys), keys
    assert tokens == reference
