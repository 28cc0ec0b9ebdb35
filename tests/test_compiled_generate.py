"""Compiled generation with the dflash backends equals eager — the output, and the drafting: the same drafts
verified at every step, the same acceptance per position, the same τ — with all passes fired and one graph per
bucket. The drafter is partly right by construction (``oracle_draft``), so acceptance is partial and exercised at
every position, and the drafts it does not force are the compiled drafter's own, which see its injected context."""

import pytest
import torch
from torch._dynamo.utils import counters

from dflash_compile import DFlashSpecWrapper
from dflash_compile.passes import PASS_NAMES
from oracle_draft import check_drafting, oracle_pair
from tiny_models import FAMILIES, VOCAB, random_prompts, small_target

PAD = VOCAB - 2
MAX_NEW = 10
MAX_SEQ = 64
RUNS = {1: ([7], 1), 3: ([2, 23, 11], 3), 8: ([5, 31, 2, 14, 9, 26, 3, 18], 8), "again": ([2, 23, 11], 99)}


def _run(spec, prompts):
    return spec.generate(prompts, max_new_tokens=MAX_NEW, pad_token_id=PAD, return_dict_in_generate=True,
                         output_drafts=True)


def _drafting(out):
    """Everything a run says about drafting."""
    return (out.drafts, [(s.num_drafts, s.num_accepted_tokens, s.num_accepted_tokens_per_pos) for s in out.per_request],
            out.num_accepted_tokens_per_pos, out.acceptance_length)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_pair(request):
    target = small_target(request.param)
    prompts = {k: random_prompts(*v) for k, v in RUNS.items()}
    draft, fulls = oracle_pair(target, [p for ps in prompts.values() for p in ps], MAX_NEW, MAX_SEQ,
                               num_layers=2, block_size=4, target_layer_ids=[0, 1], seed=0)
    kw = dict(speculation="fixed", max_batch_size=8, batch_buckets=(1, 8), max_seq_len=MAX_SEQ, page_size=8)
    eager = DFlashSpecWrapper(target, draft, **kw)
    expected = {k: _run(eager, p) for k, p in prompts.items()}
    accepted = forced = 0
    fulls = iter(fulls)
    for k, p in prompts.items():  # eager drafting is what the oracle says it is
        a, f = check_drafting(draft, p, [next(fulls) for _ in p], expected[k])
        accepted, forced = accepted + a, forced + f
    drafted = sum(o.num_draft_tokens for o in expected.values())
    assert 0 < forced <= accepted < drafted, (forced, accepted, drafted)
    return request.param, target, draft, kw, prompts, expected


def test_compiled_equals_eager(family_pair):
    _compiled_equals_eager(family_pair, "dflash")


# dflash_neuron off a Neuron device: the same passes with static context keys and the reference lowerings; two
# families (sliding windows and q/k norms) cover what it does differently, each compile costs a minute here
@pytest.mark.parametrize("family_pair", ["gemma3", "qwen3"], indirect=True)
def test_compiled_equals_eager_dflash_neuron(family_pair):
    _compiled_equals_eager(family_pair, "dflash_neuron")


# The target's layers as nested compile regions (the default for stacks of 16 layers and more: a real model's), with
# the passes inside them. Llama's layers call one subgraph and read one mask: its attention is block_attention.
# Gemma3's sliding and full layers trace to the same code and read different masks (inputs): the subgraph is split,
# a copy per mask, and each copy's attention is block_attention under its own rule.
@pytest.mark.parametrize("family_pair", ["gemma3", "llama"], indirect=True)
def test_compiled_regions_equal_eager(family_pair):
    _compiled_equals_eager(family_pair, "dflash", regions=True)


def _compiled_equals_eager(family_pair, backend, regions=False):
    family, target, draft, kw, prompts, expected = family_pair
    torch._dynamo.reset()
    counters.clear()
    spec = DFlashSpecWrapper(target, draft, **kw)
    spec.compile(backend=backend, fullgraph=True, regions=regions)
    for batch in (1, 3, 8):
        out = _run(spec, prompts[batch])
        assert torch.equal(out.sequences, expected[batch].sequences), (family, backend, batch)
        assert _drafting(out) == _drafting(expected[batch]), (family, backend, batch)
    assert counters["stats"]["unique_graphs"] == 2  # buckets 1 and 8: one graph each
    assert not counters["graph_break"]
    # Every pass fired in each of the two step graphs: the drafter's projection once, a scatter and an attention
    # per target layer, a scatter for the drafter and an attention per drafter layer.
    # Within a region a replacement counts once for all the layers that call it (the drafter's layers: one region).
    n_target = per_graph = len(target.model.layers)
    n_draft = draft_attention = len(draft.layers)
    if regions:
        per_graph, draft_attention = {"gemma3": 2}.get(family, 1), 1
        assert counters["dflash"].pop("region_calls") == 2 * (n_target + n_draft)
        assert counters["dflash"].pop("region_subgraphs") == 2 * (per_graph + 1)
        assert counters["dflash"].pop("region_splits", 0) == 2 * (per_graph - 1)
        # Inductor's Python wrapper (a graph calling regions): each graph's C++ kernels built as one unit
        assert counters["dflash"].pop("cpp_units") == 2 and counters["dflash"].pop("cpp_unit_kernels") > 2 * 2
    assert dict(counters["dflash"]) == {
        "fused_kv_proj": 2, "paged_kv_write": 2 * (per_graph + 1), "block_attention": 2 * (per_graph + draft_attention),
    }
    assert set(counters["dflash"]) == set(PASS_NAMES)
    again = _run(spec, prompts["again"])  # warm: new prompts, same buckets, no recompile (counted below)
    assert torch.equal(again.sequences, expected["again"].sequences)
    assert _drafting(again) == _drafting(expected["again"])
    assert counters["stats"]["unique_graphs"] == 2
