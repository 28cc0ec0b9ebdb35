"""Lossless speculative sampling: the acceptance rule exactly, the sampling warpers against HF's, and the law of
sampled DFlash output against the target's own law (chi-square), with a broken rule shown to fail the test."""


import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import dflash_compile.spec_wrapper as spec_wrapper
from dflash_compile import DFlashDraftModel, DFlashSpecWrapper
from dflash_compile.rejection import greedy_accept, process_logits, sample_from, speculative_accept
from tiny_models import tiny_target


def _accept(drafts, p_draft, p_target, u_accept, u_bonus):
    return speculative_accept(
        torch.tensor([drafts]), torch.tensor([p_draft]), torch.tensor([p_target]),
        torch.tensor([u_accept]), torch.tensor([u_bonus]),
    )


# ------------------------------------------------------------------ the acceptance rule, exactly
def test_accept_probability_is_min_one_ratio():
    p_draft = [[0.5, 0.25, 0.25]]
    p_target = [[0.2, 0.4, 0.4], [1 / 3, 1 / 3, 1 / 3]]
    # p_target / p_draft = 0.4 for token 0: accepted iff u < 0.4
    for u, accepted in [(0.0, 1), (0.39, 1), (0.41, 0), (0.99, 0)]:
        tokens, n = _accept([0], p_draft, p_target, [u], 0.0)
        assert n.tolist() == [accepted]
        if accepted:
            assert tokens[0, 0] == 0
    # ratio >= 1 (token 1: 0.4 / 0.25): always accepted
    for u in (0.0, 0.5, 0.999999):
        assert _accept([1], p_draft, p_target, [u], 0.0)[1].tolist() == [1]


def test_residual_distribution_on_rejection():
    p_draft = [[0.5, 0.25, 0.25]]
    p_target = [[0.2, 0.4, 0.4], [1.0, 0.0, 0.0]]
    # rejected draft 0 -> residual max(p_t - p_d, 0) = [0, 0.15, 0.15] -> normalised [0, 0.5, 0.5]
    for u_bonus, expected in [(0.0, 1), (0.49, 1), (0.51, 2), (0.999, 2)]:
        tokens, n = _accept([0], p_draft, p_target, [0.9], u_bonus)
        assert n.tolist() == [0]
        assert tokens.tolist() == [[expected, -1]]


def test_bonus_after_full_acceptance_comes_from_target():
    p_draft = [[0.5, 0.5, 0.0], [0.0, 1.0, 0.0]]
    p_target = [[0.5, 0.5, 0.0], [0.0, 1.0, 0.0], [0.1, 0.2, 0.7]]
    for u_bonus, expected in [(0.0, 0), (0.05, 0), (0.15, 1), (0.29, 1), (0.31, 2), (0.99, 2)]:
        tokens, n = _accept([1, 1], p_draft, p_target, [0.99, 0.99], u_bonus)
        assert n.tolist() == [2]
        assert tokens.tolist() == [[1, 1, expected]]


def test_degenerate_cases():
    # p_draft = 0 where p_target > 0: accepted (min(1, p_t / 0) = 1), whatever the uniform
    tokens, n = _accept([2], [[0.5, 0.5, 0.0]], [[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]], [0.999], 0.5)
    assert n.tolist() == [1] and tokens.tolist() == [[2, 1]]
    # p_target = 0 where p_draft > 0: always rejected, and the residual never picks it
    for u in (0.0, 0.5, 0.99):
        tokens, n = _accept([0], [[1.0, 0.0, 0.0]], [[0.0, 0.3, 0.7], [1.0, 0.0, 0.0]], [0.0], u)
        assert n.tolist() == [0] and tokens[0, 0] in (1, 2)
    # identical distributions: always accepted
    g = torch.Generator().manual_seed(0)
    p = torch.rand(64, 5, 11, generator=g).softmax(-1)
    drafts = sample_from(p[:, :4], torch.rand(64, 4, generator=g))
    u = torch.rand(64, 4, generator=g)
    u[0] = 0.999999
    tokens, n = speculative_accept(drafts, p[:, :4], p, u, torch.rand(64, generator=g))
    assert n.tolist() == [4] * 64
    assert torch.equal(tokens[:, :4], drafts)


def test_greedy_accept_values():
    # target_tokens[:, i] is the target's argmax after block position i; draft i (proposed for position i + 1) must
    # equal target_tokens[:, i]. Rows: all right, none right, the first two right, right again after a miss (the
    # prefix stops at the first miss), only the last right.
    drafts = torch.tensor([[5, 6, 7], [9, 6, 7], [5, 6, 9], [5, 9, 7], [9, 9, 7]])
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    tokens, n = greedy_accept(drafts, target)
    assert n.tolist() == [3, 0, 2, 1, 0]
    assert tokens.tolist() == [
        [5, 6, 7, 8], [5, -1, -1, -1], [5, 6, 7, -1], [5, 6, -1, -1], [5, -1, -1, -1],
    ]
    # Drafts equal to the target's tokens one place later (an off-by-one in the comparison) are wrong drafts.
    tokens, n = greedy_accept(torch.tensor([[6, 7, 8]]), torch.tensor([[5, 6, 7, 8]]))
    assert n.tolist() == [0] and tokens.tolist() == [[5, -1, -1, -1]]
    # K = 1, and a batch where the rows' bonus tokens differ
    tokens, n = greedy_accept(torch.tensor([[3], [4]]), torch.tensor([[3, 1], [2, 0]]))
    assert n.tolist() == [1, 0] and tokens.tolist() == [[3, 1], [2, -1]]


def test_speculative_accept_with_uniform_probs_is_greedy_accept_of_the_drafts():
    # Draft and target distributions equal: every draft is accepted, and the bonus is drawn from the target at
    # position K with u_bonus = 0 (the first token of nonzero mass): what greedy_accept gives when the target's
    # tokens are the drafts followed by 0.
    drafts = torch.tensor([[3, 1, 4], [1, 5, 9]])
    p = torch.full((2, 4, 10), 0.1)
    tokens, n = speculative_accept(drafts, p[:, :3], p, torch.zeros(2, 3), torch.zeros(2))
    ref, ref_n = greedy_accept(drafts, torch.cat([drafts, torch.zeros(2, 1, dtype=torch.long)], 1))
    assert n.tolist() == ref_n.tolist() == [3, 3]
    assert tokens.tolist() == ref.tolist() == [[3, 1, 4, 0], [1, 5, 9, 0]]


def test_sample_from_is_inverse_cdf():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]])
    for u, expected in [(0.0, 1), (0.2499, 1), (0.2501, 3), (0.999999, 3)]:
        assert sample_from(probs, torch.tensor([u])).tolist() == [expected]
    assert sample_from(probs * 3, torch.tensor([0.3])).tolist() == [3]  # unnormalised mass works the same


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.5), (0.6, 8, 0.9), (1.0, 50, 0.01), (2.0, 1, 1.0), (0.9, 200, 0.99),
])
def test_process_logits_matches_hf_warpers(temperature, top_k, top_p):
    logits = torch.randn(6, 3, 40, generator=torch.Generator().manual_seed(top_k)) * 3
    logits[0, 0, :5] = logits[0, 0, 5]  # ties at the top-k boundary are kept (HF)
    ref = logits.clone().view(-1, 40)
    if temperature != 1.0:
        ref = TemperatureLogitsWarper(temperature)(None, ref)
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    full = lambda v: torch.full((6,), v)  # noqa: E731
    got = process_logits(logits, full(temperature), full(top_k).long(), full(top_p)).view(-1, 40)
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    torch.testing.assert_close(got[~torch.isinf(got)], ref[~torch.isinf(ref)])
    # per-row parameters: row 1 differs from the others
    params = [full(temperature), full(top_k).long(), full(top_p)]
    params[0][1], params[1][1], params[2][1] = 1.0, 0, 1.0
    got = process_logits(logits, *params)
    torch.testing.assert_close(got[1], logits[1])


# ------------------------------------------------------------------ the law of sampled output
PROMPT = [1, 2, 3]
V = 8
N = 3000
# name -> (temperature, top_k, top_p, block_size). "top_p_bonus": one draft per step, so that x2 is often an accepted
# draft and x3 then the bonus token drawn after full acceptance.
LAWS = {"top_k": (0.8, 6, 1.0, 4), "top_p_bonus": (0.8, 0, 0.8, 2)}


def _peaked_pair(block_size):
    target = tiny_target("qwen3", vocab_size=V)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(8)  # a peaked next-token distribution
    draft = DFlashDraftModel.from_target(target, num_layers=2, block_size=block_size, target_layer_ids=[1, 3], seed=0)
    return target, draft


def _exact_law(target, temperature, top_k, top_p):
    """P(x1, x2, x3 | PROMPT) under the target's own processed conditionals (HF warpers, no cache)."""
    def cond(prefixes):
        with torch.no_grad():
            logits = target(torch.tensor(prefixes)).logits[:, -1]
        logits = TemperatureLogitsWarper(temperature)(None, logits)
        if top_k:
            logits = TopKLogitsWarper(top_k)(None, logits)
        if top_p < 1:
            logits = TopPLogitsWarper(top_p)(None, logits)
        return logits.softmax(-1).double()

    p1 = cond([PROMPT])[0]  # [V]
    p2 = cond([PROMPT + [a] for a in range(V)])  # [V, V]
    p3 = cond([PROMPT + [a, b] for a in range(V) for b in range(V)]).view(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3  # [V, V, V]


def _chi_square_p(observed, expected):
    """Pearson chi-square p-value; cells with expected count < 5 are pooled; mass where the law has none fails."""
    observed, expected = observed.flatten().double(), expected.flatten().double()
    if bool((observed[expected == 0] > 0).any()):
        return 0.0
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    chi2 = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), chi2 / 2))


def _sampled_counts(target, draft, temperature, top_k, top_p):
    spec = DFlashSpecWrapper(target, draft, speculation="fixed", max_batch_size=N, batch_buckets=(N,), max_seq_len=16)
    out = spec.generate([PROMPT] * N, max_new_tokens=3, do_sample=True, temperature=temperature, top_k=top_k,
                        top_p=top_p, seed=list(range(N)), pad_token_id=0, return_dict_in_generate=True)
    new = out.sequences[:, len(PROMPT):]
    counts = torch.zeros(V ** 3)
    counts.index_add_(0, new[:, 0] * V * V + new[:, 1] * V + new[:, 2], torch.ones(N))
    return counts, out


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny prefills: threads only add contention
    yield
    torch.set_num_threads(n)


def _exact_match_accept(drafts, draft_probs, target_probs, u_accept, u_bonus):
    """The reference's rule: keep drafts while they equal the target's greedy token, then sample from the target."""
    tokens, n = greedy_accept(drafts, target_probs.argmax(-1))
    at = n[:, None, None].expand(-1, 1, target_probs.shape[-1])
    nxt = sample_from(target_probs.gather(1, at)[:, 0], u_bonus)
    pos = torch.arange(tokens.shape[1])[None]
    return torch.where(pos == n[:, None], nxt[:, None], tokens), n


@pytest.mark.parametrize(
    "law,rule", [("top_k", "speculative"), ("top_k", "exact_match"), ("top_p_bonus", "speculative")]
)
def test_sampled_law_matches_target(law, rule, one_thread, monkeypatch):
    temperature, top_k, top_p, block_size = LAWS[law]
    target, draft = _peaked_pair(block_size)
    exact = _exact_law(target, temperature, top_k, top_p)
    assert float(exact.max()) > 0.05 and abs(float(exact.sum()) - 1) < 1e-6
    if top_p < 1:  # the nucleus cuts real mass: a step that ignored top_p would sample another law
        assert float((_exact_law(target, temperature, top_k, 1.0) * (exact == 0)).sum()) > 0.05
    if rule == "exact_match":
        monkeypatch.setattr(spec_wrapper, "speculative_accept", _exact_match_accept)
    counts, out = _sampled_counts(target, draft, temperature, top_k, top_p)
    p = _chi_square_p(counts, exact * N)
    print(f"{law}/{rule}: chi-square p-value {p:.3g}, acceptance length {out.acceptance_length:.2f}, "
          f"per position {out.num_accepted_tokens_per_pos}")
    # the test exercises acceptance and rejection alike (and, with one draft per step, the bonus after it)
    assert 0 < out.num_accepted_tokens < out.num_draft_tokens
    if block_size == 2:
        assert sum(s.num_accepted_tokens_per_pos[0] > 0 for s in out.per_request) > N // 10
    if rule == "speculative":
        assert p > 1e-3
    else:
        assert p < 1e-6  # the test can fail: exact-match acceptance does not keep the target's law


# ------------------------------------------------------------------ reproducibility, greedy rows, compile
def _pair():
    target = tiny_target("qwen3")
    draft = DFlashDraftModel.from_target(target, num_layers=2, block_size=4, target_layer_ids=[1, 3], seed=0)
    # a fixed K: a seeded request reproduces whatever the batch around it (under auto, only given the same Ks)
    return target, DFlashSpecWrapper(target, draft, speculation="fixed", max_batch_size=4, max_seq_len=64)


def test_seeds_reproduce(one_thread):
    _, spec = _pair()
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    kw = dict(max_new_tokens=12, do_sample=True, temperature=1.2, top_p=0.95, pad_token_id=0)
    a = spec.generate(prompts, seed=[1, 2, 3], **kw)
    assert torch.equal(a, spec.generate(prompts, seed=[1, 2, 3], **kw))
    assert not torch.equal(a, spec.generate(prompts, seed=[4, 5, 6], **kw))
    # a request's output depends on its own seed only, not on the batch around it
    assert torch.equal(spec.generate([prompts[1]], seed=[2], **kw)[0, 2:], a[1, 4:])
    g = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    assert torch.equal(spec.generate(prompts, generator=g, **kw), a)
    one = spec.generate(prompts, seed=7, **kw)
    assert torch.equal(one, spec.generate(prompts, generator=torch.Generator().manual_seed(7), **kw))
    torch.manual_seed(3)
    b = spec.generate(prompts, **kw)
    torch.manual_seed(3)
    assert torch.equal(b, spec.generate(prompts, **kw))  # global RNG, like HF


def test_greedy_rows_in_the_sampling_graph_are_greedy(one_thread):
    target, spec = _pair()
    prompt = [5, 6, 7, 8]
    ref = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10)
    # A sampled request keeps the batch on the sampling graph; the greedy row in it must still be greedy.
    sampled = spec.submit([9, 3, 4], max_new_tokens=40, do_sample=True, temperature=0.5, top_k=3, top_p=0.5, seed=0)
    greedy = spec.submit(prompt, max_new_tokens=10)
    assert greedy.result().tokens == ref[0, len(prompt):].tolist()
    assert len(sampled.result().tokens) == 40  # >= 10 steps: the greedy row joined within one and ran alongside


def test_sampling_step_compiles_fullgraph(one_thread):
    _, spec = _pair()
    prompts = [[5, 6, 7], [8, 9]]
    kw = dict(max_new_tokens=8, do_sample=True, temperature=0.9, top_k=20, top_p=0.9, pad_token_id=0, seed=[1, 2])
    eager = spec.generate(prompts, **kw)
    spec.compile(backend="eager", fullgraph=True)
    torch._dynamo.reset()
    assert torch.equal(spec.generate(prompts, **kw), eager)
