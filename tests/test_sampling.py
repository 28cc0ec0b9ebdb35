"""Lossless sampling with position-keyed noise: the noise (i.i.d. Gumbel, a function of seed, position and token
only, compiled = eager), the Gumbel-max draw, the acceptance rule, the warpers against HF's, and the law of sampled
DFlash output against the target's own law (chi-square), with a broken draw shown to fail the test."""
import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import dflash_compile.step.step as step_module
from dflash_compile import DFlashDraftModel, DFlashSpecWrapper
from dflash_compile.step.rejection import greedy_accept, noise_bits, position_noise, process_logits, sample_at_positions
from tiny_models import tiny_target


# ------------------------------------------------------------------ position-keyed noise and sampling
def test_position_noise_is_iid_gumbel_and_a_function_of_its_key():
    seeds = torch.tensor([11, 2**40 + 11, 12])
    positions = torch.tensor([[5, 6, 7, 900], [5, 6, 7, 900], [5, 6, 7, 900]])
    g = position_noise(seeds, positions, 20000)
    assert g.shape == (3, 4, 20000) and g.dtype == torch.float32 and bool(torch.isfinite(g).all())
    # Gumbel(0, 1): mean = Euler's gamma, variance pi^2 / 6; its CDF exp(-exp(-g)) uniform
    assert abs(g.mean().item() - 0.5772) < 0.01 and abs(g.var().item() - 1.6449) < 0.02
    u = torch.exp(-torch.exp(-g.double())).flatten()
    hist = torch.histc(u, 20, 0, 1) / u.numel()
    assert float((hist - 0.05).abs().max()) < 0.002
    # independent across positions, seeds (also ones that differ only in their upper 32 bits) and tokens
    flat = g.reshape(12, -1)
    corr = torch.corrcoef(flat)
    assert float((corr - torch.eye(12)).abs().max()) < 0.05
    assert abs(torch.corrcoef(torch.stack([g[0, 0, :-1], g[0, 0, 1:]]))[0, 1].item()) < 0.05
    # the same key gives the same noise in any arrangement: another row order, a slice, another batch
    again = position_noise(seeds.flip(0), positions.flip(0)[:, [3, 1]], 20000)
    assert torch.equal(again, g.flip(0)[:, [3, 1]])
    assert torch.equal(position_noise(seeds[1:2], positions[1:2, 2:3], 20000), g[1:2, 2:3])


def test_compiled_noise_equals_eager():
    """The bits bit for bit; the Gumbel transform to the last bits of its logarithms' kernels."""
    seeds = torch.tensor([3, 2**61 + 5])
    positions = torch.tensor([[0, 1, 2], [40, 41, 4000]])
    bits = torch.compile(noise_bits, backend="inductor", fullgraph=True)
    assert torch.equal(bits(seeds, positions, 1000), noise_bits(seeds, positions, 1000))
    noise = torch.compile(position_noise, backend="inductor", fullgraph=True)
    torch.testing.assert_close(noise(seeds, positions, 1000), position_noise(seeds, positions, 1000), rtol=1e-6, atol=1e-6)


def test_sample_at_positions_draws_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    n = 40000
    scores = probs.log().expand(1, n, 5).contiguous()  # one request, n positions
    x = sample_at_positions(scores, torch.tensor([7]), torch.arange(n)[None])
    counts = torch.bincount(x.flatten(), minlength=5).double()
    assert counts[4] == 0  # -inf (probability 0) is never drawn
    assert _chi_square_p(counts[:4], probs[:4].double() * n) > 1e-3
    # one allowed token: always that one, whatever the noise
    only = torch.full((2, 50, 9), float("-inf"))
    only[..., 6] = 0.0
    assert bool((sample_at_positions(only, torch.tensor([1, 2]), torch.arange(50).expand(2, 50)) == 6).all())


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


def _noise_without_position(scores, seeds, positions):
    """A broken draw: the noise keyed by the seed alone, one value per token for every position of a request (each
    token is still drawn from its own conditional, but the draws of a request's positions are coupled)."""
    return (scores.float() + position_noise(seeds, positions * 0, scores.shape[-1])).argmax(-1)


@pytest.mark.parametrize(
    "law,rule", [("top_k", "position_noise"), ("top_k", "noise_without_position"), ("top_p_bonus", "position_noise")]
)
def test_sampled_law_matches_target(law, rule, one_thread, monkeypatch):
    temperature, top_k, top_p, block_size = LAWS[law]
    target, draft = _peaked_pair(block_size)
    exact = _exact_law(target, temperature, top_k, top_p)
    assert float(exact.max()) > 0.05 and abs(float(exact.sum()) - 1) < 1e-6
    if top_p < 1:  # the nucleus cuts real mass: a step that ignored top_p would sample another law
        assert float((_exact_law(target, temperature, top_k, 1.0) * (exact == 0)).sum()) > 0.05
    if rule == "noise_without_position":
        monkeypatch.setattr(step_module, "sample_at_positions", _noise_without_position)
    counts, out = _sampled_counts(target, draft, temperature, top_k, top_p)
    p = _chi_square_p(counts, exact * N)
    print(f"{law}/{rule}: chi-square p-value {p:.3g}, acceptance length {out.acceptance_length:.2f}, "
          f"per position {out.num_accepted_tokens_per_pos}")
    # the test exercises acceptance and rejection alike (and, with one draft per step, the bonus after it)
    assert 0 < out.num_accepted_tokens < out.num_draft_tokens
    if block_size == 2:
        assert sum(s.num_accepted_tokens_per_pos[0] > 0 for s in out.per_request) > N // 10
    if rule == "position_noise":
        assert p > 1e-3
    else:
        assert p < 1e-6  # the test can fail: noise shared by a request's positions does not keep the target's law
    if (law, rule) == ("top_k", "position_noise"):
        # drafts drawn with the noise the target draws with: 1.65 here, 1.16 with independent draft noise
        assert out.acceptance_length > 1.4


# ------------------------------------------------------------------ reproducibility, greedy rows, compile
def _pair():
    target = tiny_target("qwen3")
    draft = DFlashDraftModel.from_target(target, num_layers=2, block_size=4, target_layer_ids=[1, 3], seed=0)
    # a fixed K (a seeded request reproduces under any K: tests/test_seeded_sampling.py)
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


def test_sampled_law_with_a_reduced_draft_vocabulary(one_thread):
    """The drafter's own head over 5 of the 8 tokens: drafts never name the other 3, and the law is still the target's."""
    temperature, top_k, top_p, block_size = LAWS["top_k"]
    target, _ = _peaked_pair(block_size)
    draft = DFlashDraftModel.from_target(target, num_layers=2, block_size=block_size, target_layer_ids=[1, 3], seed=0,
                                         draft_vocab=[0, 2, 3, 5, 7], mask_token_id=V - 1)
    counts, out = _sampled_counts(target, draft, temperature, top_k, top_p)
    p = _chi_square_p(counts, _exact_law(target, temperature, top_k, top_p) * N)
    print(f"reduced draft vocabulary: chi-square p-value {p:.3g}, acceptance length {out.acceptance_length:.2f}")
    assert 0 < out.num_accepted_tokens < out.num_draft_tokens and p > 1e-3
