"""Each step's K: the goodput controller on synthetic cost and acceptance tables, vLLM's batch-size schedule, and
the step itself with K changing at every step (greedy identity, acceptance replayed from first principles, the
sampling law, no recompiles after warm-up)."""

import random

import pytest
import torch

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper
from dflash_compile.runtime.speculation import (
    AcceptanceHistory, BatchSizeSchedule, FixedK, GoodputPolicy, Plan, StepView, context_bin,
    default_ks, expected_accepted,
)
from oracle_draft import SWITCHING, CyclePolicy, check_drafting, oracle_pair
from tiny_models import random_prompts, small_target, tiny_target

PAD = 0


class _Row:
    """What the controller reads of a request: its acceptance history."""

    def __init__(self, acceptance):
        self.acceptance = acceptance


def _history(rate, size=7, n=100):
    return AcceptanceHistory(size, tries=[float(n)] * size, hits=[float(n * rate)] * size)


def _policy(rate, cost, bucket=8, pages=16, sampled=False, **kw):
    """A controller whose pooled history has per-position rate ``rate`` and whose every graph at this bucket and
    context was timed: ``cost(K, proposes)`` seconds."""
    policy = GoodputPolicy(**kw)
    ks = policy.ks(8)
    policy.pooled = _history(rate)
    for k in ks:
        for propose in {k > 0, True}:
            for _ in range(3):
                policy.costs.add((bucket, k, propose, sampled, context_bin(pages)), cost(k, propose))
    return policy, ks


def _view(rows, bucket=8, pages=16, sampled=False):
    return StepView(bucket, rows, pages, sampled)


def test_default_ks():
    assert default_ks(8) == (0, 1, 2, 4, 7)
    assert default_ks(16) == (0, 1, 2, 4, 8, 15)
    assert default_ks(2) == (0, 1)


def test_expected_accepted_is_the_prefix_product_sum():
    assert expected_accepted([0.5, 0.5, 0.5], 0) == 0
    assert expected_accepted([0.5, 0.5, 0.5], 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_accepted([1.0] * 7, 7) == 7
    assert expected_accepted([0.9, 0.0, 1.0], 3) == pytest.approx(0.9)


def test_acceptance_history_counts_conditional_tries():
    h = AcceptanceHistory(4, decay=1.0)
    h.record(3, 1)  # draft 1 accepted, draft 2 rejected, draft 3 never reached
    h.record(2, 2)
    h.record_first(False)
    assert h.tries == [3, 2, 0, 0] and h.hits == [2, 1, 0, 0]
    assert h.rates([0.5] * 4, weight=1.0) == [2.5 / 4, 1.5 / 3, 0.5, 0.5]
    assert h.rates([0.25] * 4, weight=2.0)[3] == 0.25  # nothing measured there: the prior
    h.decay = 0.5
    h.record(1, 0)
    assert h.tries[:2] == [2.5, 1.0] and h.hits[:2] == [1.0, 0.5]  # older steps count for less


def test_zero_acceptance_chooses_plain_decoding():
    policy, ks = _policy(0.0, lambda k, p: 1.0 + 0.05 * k + 0.2 * p)
    rows = [_Row(_history(0.0)) for _ in range(8)]
    assert policy.choose(_view(rows)) == Plan(0, False)


def test_full_acceptance_and_flat_cost_choose_the_largest_k():
    policy, ks = _policy(1.0, lambda k, p: 1.0)
    rows = [_Row(_history(1.0)) for _ in range(8)]
    assert policy.choose(_view(rows)) == Plan(max(ks), True)


def test_growing_cost_chooses_the_goodput_argmax():
    # rate 0.8 per position, cost 1 + K/4: tokens/cost is 1.0, 1.44, 1.63, 1.68, 1.51 for K = 0, 1, 2, 4, 7
    policy, ks = _policy(0.8, lambda k, p: 1.0 + 0.25 * k)
    rows = [_Row(_history(0.8)) for _ in range(8)]
    goodput = {k: (1 + sum(0.8 ** j for j in range(1, k + 1))) / (1 + 0.25 * k) for k in ks}
    assert max(goodput, key=goodput.get) == 4
    assert policy.choose(_view(rows)) == Plan(4, True)
    assert policy.last_goodput == pytest.approx({k: 8 * g for k, g in goodput.items()}, rel=2e-3)  # prior-shrunk


def test_each_request_uses_its_own_history():
    cost = lambda k, p: 1.0 + 0.25 * k  # noqa: E731
    policy, _ = _policy(0.5, cost)
    assert policy.choose(_view([_Row(_history(1.0))])).k == 7  # pooled is 0.5, this request accepts everything
    policy, _ = _policy(0.5, cost)
    assert policy.choose(_view([_Row(_history(0.0))])).k == 0


def test_unmeasured_k_is_explored_only_while_it_could_pay():
    policy = GoodputPolicy()
    policy.ks(8)
    policy.pooled = _history(0.0)
    rows = [_Row(_history(0.0)) for _ in range(4)]
    view = _view(rows, bucket=4)
    assert policy.choose(view).k == 0  # nothing timed: K = 0 first (ties go to the smaller K)
    for _ in range(3):
        policy.costs.add((4, 0, False, False, context_bin(16)), 1.0)
    # every other K's best case is K = 0's cost with its tokens: with acceptance 0, no better, never explored
    for _ in range(50):
        assert policy.choose(view).k == 0
    policy = GoodputPolicy()
    policy.ks(8)
    policy.pooled = _history(0.9)
    rows = [_Row(_history(0.9)) for _ in range(4)]
    policy.costs.add((4, 0, False, False, context_bin(16)), 1.0)
    wanted = [policy.choose(_view(rows, bucket=4)).k for _ in range(8)]
    assert wanted[0] == 7 and wanted[4:] == [7] * 4  # optimistic: the untimed K with the most tokens is tried


def test_switches_are_bounded_under_noise():
    rng = random.Random(0)
    policy = GoodputPolicy()
    ks = policy.ks(8)
    policy.pooled = _history(0.7)
    rows = [_Row(_history(0.7)) for _ in range(8)]
    wanted = []
    for step in range(1000):
        for k in ks:  # costs whose noise makes the best K flip every few steps
            policy.costs.add((8, k, k > 0, False, context_bin(16)), (1 + 0.15 * k) * rng.uniform(0.7, 1.3))
        for r in rows:
            r.acceptance = _history(rng.uniform(0.5, 0.9))
        wanted.append(policy.choose(_view(rows)).k)
    switches = [i for i in range(1, len(wanted)) if wanted[i] != wanted[i - 1]]
    assert len(switches) == policy.switches and len(switches) > 5  # the noise does move it
    for start in range(0, 900):
        assert sum(start <= i < start + 100 for i in switches) <= 100 // policy.dwell


def test_plain_decoding_probes_acceptance_with_a_proposal():
    policy, _ = _policy(0.0, lambda k, p: 1.0 + 0.05 * k + 0.2 * p, probe_every=5)
    rows = [_Row(_history(0.0)) for _ in range(8)]
    plans = [policy.choose(_view(rows)) for _ in range(20)]
    assert [p.k for p in plans] == [0] * 20
    assert [i for i, p in enumerate(plans) if p.propose] == [4, 9, 14, 19]
    # what a probe tells it: the first draft agreed with the target every time -> speculation pays again
    for _ in range(30):
        policy.observe(_view(rows), 0, False, None, [None] * 8, [True] * 8)
    assert policy.choose(_view(rows)).k > 0


def test_probes_thin_out_while_speculation_is_far_from_paying():
    # batch 8 on SmolLM2 (ms): plain 55, a probe (the proposing graph) 124, K 1 118, K 2 162, K 4 208, K 7 308
    ms = {(0, False): 55, (0, True): 124, (1, True): 118, (2, True): 162, (4, True): 208, (7, True): 308}
    policy, _ = _policy(0.45, lambda k, p: ms[k, p] / 1e3, max_probe_every=64)
    rows = [_Row(_history(0.45)) for _ in range(8)]
    plans = [policy.choose(_view(rows)) for _ in range(400)]
    assert {p.k for p in plans} == {0}
    probes = [i for i, p in enumerate(plans) if p.propose]
    assert probes[:3] == [15, 47, 111] and set(b - a for a, b in zip(probes[2:], probes[3:])) == {64}  # 16, 32, 64
    # the first drafts start agreeing: the next probe sees speculation pay again, and the probes come every 16
    for _ in range(40):
        policy.observe(_view(rows), 0, False, None, [None] * 8, [True] * 8)
    for r in rows:
        r.acceptance = _history(0.95)
    later = [policy.choose(_view(rows)) for _ in range(80)]
    assert any(p.k > 0 for p in later)
    assert policy.probe_gap == policy.probe_every


def test_probes_keep_their_pace_while_speculation_is_close():
    policy, _ = _policy(0.5, lambda k, p: 1.0 + 0.4 * k + 0.2 * p, probe_every=8)  # K 1: 0.94x plain
    rows = [_Row(_history(0.5)) for _ in range(8)]
    plans = [policy.choose(_view(rows)) for _ in range(64)]
    assert {p.k for p in plans} == {0} and [i for i, p in enumerate(plans) if p.propose] == list(range(7, 64, 8))
    with pytest.raises(ValueError, match="max_probe_every"):
        GoodputPolicy(probe_every=16, max_probe_every=8)
    with pytest.raises(ValueError, match="far must be"):
        GoodputPolicy(far=1.5)


def test_each_bucket_keeps_its_own_k_and_probe_pace():
    """A queue at 8 rows where speculation does not pay drains to one row where it does, and the next queue starts
    at 8 rows again: that batch starts at K = 0 (not the K wanted at one row) and keeps its thinned-out probes."""
    ms = {(0, False): 4.2, (0, True): 13.7, (1, True): 13.3, (2, True): 14.9, (4, True): 18.3, (7, True): 23.4}
    policy, ks = _policy(0.6, lambda k, p: ms[k, p] / 1e3, max_probe_every=64)  # the tiny pair at batch 8
    for k in ks:
        for propose in {k > 0, True}:
            for _ in range(3):
                policy.costs.add((1, k, propose, False, context_bin(16)), (1.0 + 0.1 * k + 0.2 * propose) / 1e3)
    eight = [_Row(_history(0.6)) for _ in range(8)]
    first = [policy.choose(_view(eight)) for _ in range(200)]
    assert {p.k for p in first} == {0} and policy.probe_gap == 64  # 16, 32, 64: speculation far from paying
    one = [policy.choose(_view(eight[:1], bucket=1)) for _ in range(2)]  # the queue's last steps: fewer than dwell
    assert all(p.k > 0 for p in one) and policy.probe_gap == policy.probe_every  # one row: speculation pays
    again = [policy.choose(_view(eight)) for _ in range(60)]
    # K = 0 from the first step, and the next probe 64 plain steps after the last one at 8 rows (step 175 of 200)
    assert {p.k for p in again} == {0} and [i for i, p in enumerate(again) if p.propose] == [39]


# ------------------------------------------------------------------ vLLM's schedule
def test_batch_size_schedule_follows_vllm():
    s = BatchSizeSchedule({"1-2": 7, "4-8": 2, "16": 0}, 5)
    assert [s.k_for(b) for b in (1, 2, 3, 4, 8, 9, 16, 40)] == [5, 5, 5, 2, 2, 2, 0, 0]  # clamped, gaps inherit
    assert s.ks(8) == (0, 2, 5)
    assert BatchSizeSchedule({"3-4": 1}, 7).k_for(2) == 7  # below every range: num_speculative_tokens
    for bad, match in [({}, "non-empty"), ({"a-b": 1}, "range"), ({"4-2": 1}, "empty"), ({"1-4": -1}, "K must"),
                       ({"1-4": 1, "3-5": 2}, "overlap")]:
        with pytest.raises(ValueError, match=match):
            BatchSizeSchedule(bad, 7)


def test_batch_size_schedule_drives_generate(tmp_path):
    target = tiny_target("qwen3")
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4, target_layer_ids=[1, 3], seed=0)
    draft.save_pretrained(tmp_path)
    spec = DFlashSpecWrapper.from_speculative_config(target, {
        "method": "dflash", "model": str(tmp_path), "num_speculative_tokens": 3,
        "num_speculative_tokens_per_batch_size": {"1": 3, "2-4": 0}}, max_batch_size=4, max_seq_len=64)
    assert spec.speculative_ks == (0, 3) and spec.step_graphs() == [(0, False), (0, True), (3, True)]
    prompts = random_prompts([4, 6, 5], 3)
    refs = [target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=12)[0, len(p):].tolist()
            for p in prompts]
    out = spec.generate(prompts, max_new_tokens=12, pad_token_id=PAD, return_dict_in_generate=True)
    assert out.step_ks[0][0] == 0 and set(out.step_ks[0]) == {0}  # three live rows: K = 0
    for i, p in enumerate(prompts):
        assert out.sequences[i, out.prompt_width:out.prompt_width + 12].tolist() == refs[i]
    alone = spec.generate([prompts[0]], max_new_tokens=12, return_dict_in_generate=True)
    assert set(alone.step_ks[0]) == {3}


def test_speculation_argument_errors():
    target = tiny_target("qwen3")
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4, target_layer_ids=[1, 3], seed=0)
    with pytest.raises(ValueError, match="speculation="):
        DFlashSpecWrapper(target, draft, speculation="sometimes")
    with pytest.raises(ValueError, match="outside"):
        DFlashSpecWrapper(target, draft, speculation=GoodputPolicy(ks=(0, 5)))
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        DFlashSpecWrapper(target, draft, 4)
    assert DFlashSpecWrapper(target, draft).speculative_ks == (0, 1, 2, 3)  # auto by default
    assert DFlashSpecWrapper(target, draft, 2).speculative_ks == (2,)  # a K given: fixed
    assert DFlashSpecWrapper(target, draft, 2, speculation="auto").speculative_ks == (0, 1, 2)
    assert DFlashSpecWrapper(target, draft, 0).step_graphs() == [(0, False)]  # plain decoding


# ------------------------------------------------------------------ the step with K switching
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_k_changing_every_step_is_lossless_and_replays(family):
    target = small_target(family)
    prompts = random_prompts([5, 13, 2, 9], 1)
    draft, fulls = oracle_pair(target, prompts, 40, 96, num_layers=2, block_size=8, target_layer_ids=[0, 1], seed=0)
    spec = DFlashSpecWrapper(target, draft, speculation=CyclePolicy(SWITCHING), max_batch_size=4, max_seq_len=96,
                             page_size=8)
    out = spec.generate(prompts, max_new_tokens=40, pad_token_id=PAD, return_dict_in_generate=True,
                        output_drafts=True)
    for i, (p, full) in enumerate(zip(prompts, fulls)):
        assert out.sequences[i, out.prompt_width:].tolist() == full[len(p):len(p) + 40]
    steps = out.step_ks[0]
    assert steps == (SWITCHING * 10)[: len(steps)] and len(steps) > len(SWITCHING)  # every K, in this order
    accepted, forced = check_drafting(draft, prompts, fulls, out)
    assert forced >= 10 and 0 < accepted < out.num_draft_tokens, (accepted, forced, out.num_draft_tokens)


@pytest.mark.parametrize("cycle,paths", [([1, 0, 2], {(1,), (1, 0)}), ([0, 2, 1], {(0, 2)})])
def test_sampling_law_with_k_switching(cycle, paths):
    # The prefill gives the first token, then [1, 0, 2]: one draft, then a plain step after it whenever that draft
    # was rejected; [0, 2, 1]: a plain step that proposes, then two drafts proposed by it.
    import test_sampling as ts

    temperature, top_k, top_p, block_size = ts.LAWS["top_k"]
    target, draft = ts._peaked_pair(block_size)
    exact = ts._exact_law(target, temperature, top_k, top_p)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        spec = DFlashSpecWrapper(target, draft, speculation=CyclePolicy(cycle), max_batch_size=ts.N,
                                 batch_buckets=(ts.N,), max_seq_len=16)
        out = spec.generate([ts.PROMPT] * ts.N, max_new_tokens=3, do_sample=True, temperature=temperature,
                            top_k=top_k, top_p=top_p, seed=list(range(ts.N)), pad_token_id=0,
                            return_dict_in_generate=True)
    finally:
        torch.set_num_threads(n)
    new = out.sequences[:, len(ts.PROMPT):]
    counts = torch.zeros(ts.V ** 3)
    counts.index_add_(0, new[:, 0] * ts.V * ts.V + new[:, 1] * ts.V + new[:, 2], torch.ones(ts.N))
    assert {tuple(k) for k in out.step_ks} == paths
    assert 0 < out.num_accepted_tokens < out.num_draft_tokens
    assert ts._chi_square_p(counts, exact * ts.N) > 1e-3


def test_auto_compiled_long_mixed_run_never_recompiles_after_warmup():
    target = tiny_target("qwen3")
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4, target_layer_ids=[1, 3], seed=0)
    spec = DFlashSpecWrapper(target, draft, speculation=GoodputPolicy(dwell=1, probe_every=3), max_batch_size=2,
                             batch_buckets=(2,), max_seq_len=128)
    spec.compile(backend="eager")
    report = spec.precompile(sampling="both", progress=False)
    # K 0 without proposing (plain decoding), and one graph for every proposing step (K 1, 2, 3, and K 0 with a
    # placeholder draft it never accepts); greedy and sampled
    assert len(spec.step_graphs()) == 5 and len(report) == 2 * 2
    warm = len(spec.compiled_steps.events)
    prompts = random_prompts([3, 7, 5, 9, 4, 6], 5)
    refs = [target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=60)[0, len(p):].tolist()
            for p in prompts]
    with torch.compiler.set_stance("fail_on_recompile"):
        handles = [spec.submit(p, max_new_tokens=60, do_sample=i % 2 == 1, seed=i) for i, p in enumerate(prompts)]
        results = [h.result() for h in handles]
    assert len(spec.compiled_steps.events) == warm  # nothing compiled or loaded after the warm-up
    for i, r in enumerate(results):
        assert len(r.tokens) == 60
        if i % 2 == 0:
            assert r.tokens == refs[i]
    used = {k for r in results for k in r.stats.step_ks}
    assert len(used) >= 2, used  # the controller did switch on this run


def test_fixed_k_policy_and_stats():
    target = tiny_target("qwen3")
    draft = DFlashDraftModel.from_target(target, num_layers=1, block_size=4, target_layer_ids=[1, 3], seed=0)
    spec = DFlashSpecWrapper(target, draft, speculation=FixedK(0), max_batch_size=2, max_seq_len=64)
    prompt = [3, 4, 5]
    ref = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10)[0, 3:].tolist()
    out = spec.generate([prompt], max_new_tokens=10, return_dict_in_generate=True)
    assert out.sequences[0, 3:].tolist() == ref
    assert out.step_ks == [[0] * 9] and out.num_drafts == 0 and out.acceptance_length == 1.0
