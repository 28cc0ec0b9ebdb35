"""One wrapper, many callers: concurrent generate() calls share one continuous batch and each gets exactly its solo
output; the request API (submit / iterate / result / cancel); verifying fewer drafts than the drafter proposes
(num_speculative_tokens); vLLM's speculative_config."""

import os
import threading
import time
from concurrent.futures import CancelledError

import pytest
import torch

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper
from oracle_draft import check_drafting, oracle_pair
from tiny_models import VOCAB, tiny_target

PAD = VOCAB - 2
NEW = 12


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 2, (n,), generator=g).tolist() for n in lengths]


def _pair(**kw):
    target = tiny_target("qwen3")
    draft = DFlashDraftModel.from_target(target, num_layers=2, block_size=4, target_layer_ids=[1, 3], seed=0)
    # a fixed K: sampled callers then get their solo output exactly (under auto, their steps' K depend on the batch)
    kw = {**dict(speculation="fixed", max_batch_size=3, max_seq_len=64, page_size=8), **kw}
    return target, DFlashSpecWrapper(target, draft, **kw)


def _wait_idle(spec, timeout=30.0):
    end = time.monotonic() + timeout
    while not spec.scheduler.idle():
        assert time.monotonic() < end, "the scheduler did not go idle"
        time.sleep(0.01)


def _all_free(spec):
    cache = spec.kv_cache()
    return cache.num_free_blocks == cache.num_blocks and cache.num_free_state_slots == (
        spec.max_batch_size if cache.has_states else 0)


def _calls():
    """Eight callers: greedy and seeded sampling mixed, different lengths and limits."""
    prompts = _prompts([3, 9, 17, 5, 12, 7, 20, 4])
    calls = []
    for i, p in enumerate(prompts):
        kw = dict(max_new_tokens=NEW - i % 3)
        if i % 2:
            kw.update(do_sample=True, temperature=0.8, top_k=20, seed=100 + i)
        calls.append((p, kw))
    return calls


def _in_threads(fn, n):
    results, errors = [None] * n, [None] * n

    def run(i):
        try:
            results[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    return results, errors


def test_concurrent_callers_get_their_solo_outputs_twice():
    target, spec = _pair()
    calls = _calls()
    solo = [spec.generate([p], **kw)[0, len(p):].tolist() for p, kw in calls]
    for i in (0, 2, 4):  # greedy solo is the target's own greedy output
        p, kw = calls[i]
        assert solo[i] == target.generate(torch.tensor([p]), do_sample=False, **kw)[0, len(p):].tolist()
    for _ in range(2):  # more callers (8) than rows (3): they queue, join as rows free up, and share steps
        results, errors = _in_threads(lambda i: spec.generate([calls[i][0]], **calls[i][1])[0].tolist(), len(calls))
        assert errors == [None] * len(calls)
        assert [r[len(p):] for r, (p, _) in zip(results, calls)] == solo
        _wait_idle(spec)
        assert _all_free(spec)


def test_batched_call_and_single_calls_from_threads_mix():
    _, spec = _pair(max_batch_size=4)
    prompts = _prompts([6, 11, 3, 15])
    solo = [spec.generate([p], max_new_tokens=NEW)[0, len(p):].tolist() for p in prompts]
    batch_out = {}

    def batched():
        out = spec.generate(prompts[:2], max_new_tokens=NEW, pad_token_id=PAD, return_dict_in_generate=True)
        batch_out["rows"] = [out.sequences[i, out.prompt_width:].tolist() for i in range(2)]

    t = threading.Thread(target=batched)
    t.start()
    singles = [spec.generate([p], max_new_tokens=NEW)[0, len(p):].tolist() for p in prompts[2:]]
    t.join(timeout=300)
    assert batch_out["rows"] == solo[:2] and singles == solo[2:]


class _Collect:
    def __init__(self, fail_after=None):
        self.tokens, self.ended, self.fail_after = [], False, fail_after

    def put(self, value):
        if self.fail_after is not None and len(self.tokens) >= self.fail_after:
            raise RuntimeError("the streamer's client went away")
        self.tokens.extend(value.flatten().tolist())

    def end(self):
        self.ended = True


def test_streamers_see_only_their_own_tokens_and_a_failing_one_fails_alone():
    _, spec = _pair()
    prompts = _prompts([4, 10, 7, 13])
    solo = [spec.generate([p], max_new_tokens=NEW)[0, len(p):].tolist() for p in prompts]
    streamers = [_Collect(), _Collect(fail_after=len(prompts[1]) + 3), _Collect(), _Collect()]
    results, errors = _in_threads(
        lambda i: spec.generate([prompts[i]], max_new_tokens=NEW, streamer=streamers[i])[0, len(prompts[i]):].tolist(),
        4,
    )
    assert isinstance(errors[1], RuntimeError) and "went away" in str(errors[1])
    for i in (0, 2, 3):
        assert errors[i] is None and results[i] == solo[i]
        assert streamers[i].tokens == prompts[i] + solo[i] and streamers[i].ended  # the prompt, then its own tokens
    _wait_idle(spec)
    assert _all_free(spec)


def test_a_bad_argument_fails_its_caller_before_any_work():
    _, spec = _pair()
    prompts = _prompts([5, 8])
    solo = spec.generate([prompts[0]], max_new_tokens=NEW)[0].tolist()

    def call(i):
        if i == 1:
            return spec.generate([prompts[1]], max_new_tokens=NEW, do_sample=True, temperature=-1.0)
        return spec.generate([prompts[0]], max_new_tokens=NEW)[0].tolist()

    results, errors = _in_threads(call, 2)
    assert isinstance(errors[1], ValueError) and results[0] == solo


def test_submit_iterates_tokens_as_accepted_and_cancel_frees_blocks():
    target, spec = _pair()
    p = _prompts([6])[0]
    handle = spec.submit(p, max_new_tokens=NEW)
    ended = threading.Event()
    handle.add_done_callback(lambda h: ended.set() if h is handle else None)
    handle.add_done_callback(lambda h: 1 / 0)  # logged, never raised into the scheduler
    streamed = list(handle)
    result = handle.result()
    assert streamed == result.tokens == target.generate(torch.tensor([p]), do_sample=False,
                                                         max_new_tokens=NEW)[0, len(p):].tolist()
    assert result.finish_reason == "length" and result.stats.num_drafts > 0
    assert ended.wait(10) and handle.stats is result.stats and handle.cached_tokens == 0

    long = spec.submit(p, max_new_tokens=60)
    short = spec.submit(_prompts([9], seed=1)[0], max_new_tokens=NEW)
    it = iter(long)
    first = [next(it) for _ in range(3)]  # it is running
    long.cancel()
    with pytest.raises(CancelledError):
        long.result(timeout=60)
    assert len(first) == 3 and len(short.result(timeout=60).tokens) == NEW  # the other request is unaffected
    _wait_idle(spec)
    assert _all_free(spec)
    with pytest.raises(ValueError, match="one prompt"):
        spec.submit([[1, 2], [3, 4]], max_new_tokens=2)
    spec.close()


def test_a_request_cancelled_while_queued_ends_its_streamer():
    _, spec = _pair(max_batch_size=1)

    class Streamer:
        ended = 0

        def put(self, value):
            pass

        def end(self):
            self.ended += 1

    running = spec.submit(_prompts([5])[0], max_new_tokens=60)
    next(iter(running))  # the batch (of one) is full: the next request waits
    streamer = Streamer()
    queued = spec.submit(_prompts([7])[0], max_new_tokens=4, streamer=streamer)
    queued.cancel()
    running.cancel()
    for handle in (running, queued):
        with pytest.raises(CancelledError):
            handle.result(timeout=60)
    assert streamer.ended == 1  # as for a request cancelled while it runs
    seen = []
    queued.add_done_callback(seen.append)  # done already: called at once
    assert seen == [queued] and running.stats.num_drafts > 0  # counters readable after a cancel
    _wait_idle(spec)
    assert _all_free(spec)
    spec.close()


def test_close_refuses_while_requests_run():
    _, spec = _pair()
    handle = spec.submit(_prompts([5])[0], max_new_tokens=60)
    next(iter(handle))
    if not handle.done():
        with pytest.raises(RuntimeError, match="still running"):
            spec.close()
    handle.cancel()
    with pytest.raises(CancelledError):
        handle.result(timeout=60)
    _wait_idle(spec)
    spec.close()


def test_in_flight_counts_a_request_being_admitted_once():
    """While joining requests are prefilled they are the batch's rows already: counted there, not also as joining
    (other callers size the graphs they ready by it)."""
    _, spec = _pair()
    seen = []
    prefill = spec.dflash_step.prefill

    def counting(*args, **kwargs):
        seen.append(spec.scheduler.in_flight())
        return prefill(*args, **kwargs)

    spec.dflash_step.prefill = counting
    prompts = _prompts([5, 6])  # lengths alike: one prefill group
    prompts, _, args, generators = spec._requests(prompts, None, None, None, None, None, False,
                                                  dict(max_new_tokens=4, pad_token_id=PAD))
    handles = spec.scheduler.submit_together(prompts, args, generators)
    for h in handles:
        h.result(timeout=60)
    assert seen == [2]
    _wait_idle(spec)
    assert spec.scheduler.in_flight() == 0
    spec.close()


# ------------------------------------------------------------------ num_speculative_tokens < block_size - 1
@pytest.mark.parametrize("K", [1, 2])
def test_fewer_verified_drafts_are_lossless_and_counted(K):
    target = tiny_target("qwen3")
    prompts = _prompts([5, 14, 9])
    draft, fulls = oracle_pair(target, prompts, NEW, 64, num_layers=2, block_size=4, target_layer_ids=[1, 3], seed=0)
    spec = DFlashSpecWrapper(target, draft, K, max_batch_size=4, max_seq_len=64, page_size=8)
    out = spec.generate(prompts, max_new_tokens=NEW, pad_token_id=PAD, return_dict_in_generate=True,
                        output_drafts=True)
    refs = [f[len(p):len(p) + NEW] for p, f in zip(prompts, fulls)]
    assert [out.sequences[i, out.prompt_width:].tolist() for i in range(3)] == refs
    assert all(len(d) == K for row in out.drafts for d in row)  # only the first K drafts are verified
    assert len(out.num_accepted_tokens_per_pos) == K and out.num_draft_tokens == K * out.num_drafts
    accepted, forced = check_drafting(draft, prompts, fulls, out)
    assert 0 < accepted <= K * out.num_drafts and forced > 0
    torch._dynamo.reset()
    # the starting bucket's graph; the steps after rows finish run eagerly (a graph per smaller bucket is the same
    # code at another batch size)
    spec.compile(backend="dflash", fullgraph=True, on_miss="eager")
    spec.precompile([len(prompts)], progress=False)
    again = spec.generate(prompts, max_new_tokens=NEW, pad_token_id=PAD, return_dict_in_generate=True,
                          output_drafts=True)
    assert torch.equal(again.sequences, out.sequences) and again.drafts == out.drafts


def test_num_speculative_tokens_bounds():
    target = tiny_target("qwen3")
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4)
    for bad in (4, -1, 1.5, True):
        with pytest.raises(ValueError, match="0 <= num_speculative_tokens <= 3"):
            DFlashSpecWrapper(target, draft, bad)
    assert DFlashSpecWrapper(target, draft).num_speculative_tokens == 3  # auto: at most block_size - 1
    assert DFlashSpecWrapper(target, draft, 0).speculative_ks == (0,)  # plain decoding


# ------------------------------------------------------------------ vLLM's speculative_config
def test_from_speculative_config(tmp_path):
    target = tiny_target("qwen3")
    draft = DFlashDraftModel.from_target(target, num_layers=2, block_size=4, target_layer_ids=[1, 3], seed=0)
    draft.save_pretrained(tmp_path / "drafter")
    model = str(tmp_path / "drafter")
    spec = DFlashSpecWrapper.from_speculative_config(
        target, {"method": "dflash", "model": model, "num_speculative_tokens": 2}, max_batch_size=2)
    assert spec.num_speculative_tokens == 2 and spec.verify_len == 3
    p = _prompts([7])[0]
    assert spec.generate([p], max_new_tokens=NEW)[0, 7:].tolist() == target.generate(
        torch.tensor([p]), do_sample=False, max_new_tokens=NEW)[0, 7:].tolist()
    as_json = DFlashSpecWrapper.from_speculative_config(target, f'{{"method": "dflash", "model": "{model}"}}')
    assert as_json.num_speculative_tokens == 3  # block_size - 1 by default
    assert DFlashSpecWrapper.from_speculative_config(
        target, {"method": "dflash", "model": model, "max_model_len": 48}).max_seq_len == 48
    with pytest.raises(ValueError, match="method 'eagle3' is not supported"):
        DFlashSpecWrapper.from_speculative_config(target, {"method": "eagle3", "model": model})
    with pytest.raises(ValueError, match="not a drafter directory"):
        DFlashSpecWrapper.from_speculative_config(target, {"method": "dflash", "model": str(tmp_path / "nope")})
    with pytest.raises(ValueError, match="not a drafter directory"):
        DFlashSpecWrapper.from_speculative_config(target, {"method": "dflash"})
    for k in (-1, 4):
        with pytest.raises(ValueError, match="0 <= num_speculative_tokens <= 3"):
            DFlashSpecWrapper.from_speculative_config(
                target, {"method": "dflash", "model": model, "num_speculative_tokens": k})
    with pytest.raises(ValueError, match=r"keys \['draft_tensor_parallel_size'\] are not supported"):
        DFlashSpecWrapper.from_speculative_config(
            target, {"method": "dflash", "model": model, "draft_tensor_parallel_size": 1})


def test_the_driver_thread_uses_the_callers_thread_count():
    # torch.set_num_threads sets the calling thread's OpenMP team size only: the driver thread must adopt the
    # caller's, or a caller asking for 2 threads would have its steps run on 1.
    target, spec = _pair()
    seen = []
    step = spec.step

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return step(*args, **kwargs)

    spec.step = recording
    n = torch.get_num_threads()
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            seen.clear()
            spec.generate([[5, 6, 7]], max_new_tokens=6)
            assert seen and set(seen) == {threads}
    finally:
        torch.set_num_threads(n)


def test_the_submitting_thread_releases_its_idle_openmp_workers(monkeypatch):
    # Two OpenMP teams on as many cores make libgomp's workers sleep between regions (runtime/openmp.py): the
    # thread that hands its requests to the driver frees its own idle team (once per submit, on that thread).
    from dflash_compile.runtime import scheduler

    target, spec = _pair()
    callers = []
    monkeypatch.setattr(scheduler.openmp, "release_idle_team", lambda: callers.append(threading.current_thread()))
    spec.generate([[5, 6, 7]], max_new_tokens=4)
    assert callers == [threading.main_thread()]


_TEAM_SCRIPT = """
import os, time, torch
from dflash_compile.runtime import openmp
def tasks():
    return len(os.listdir("/proc/self/task"))
torch.set_num_threads(2)
a = torch.randn(1 << 20)
for _ in range(20):
    a.add_(1.0)  # a parallel region: the main thread's team of two
before = tasks()
released = openmp.release_idle_team()
deadline = time.time() + 5
while tasks() >= before and time.time() < deadline:
    time.sleep(0.01)
print(openmp._pause_all() is not None, released, before, tasks())
"""


def test_release_idle_team_frees_the_calling_threads_openmp_workers():
    import subprocess
    import sys

    if not torch.backends.openmp.is_available() or not os.path.isdir("/proc/self/task"):
        pytest.skip("needs torch built with OpenMP, on Linux")
    out = subprocess.run([sys.executable, "-c", _TEAM_SCRIPT], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "2"}).stdout.split()
    if out[0] != "True":
        pytest.skip("this torch's OpenMP runtime is not libgomp (it keeps no team per thread to release)")
    assert out[1] == "True"
    assert int(out[3]) == int(out[2]) - 1, out  # the one worker of the two-thread team is gone
