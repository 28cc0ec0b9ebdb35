"""Compiled greedy generation with the dflash backends equals eager, with all passes fired and one graph per bucket."""

import pytest
import torch
from torch._dynamo.utils import counters

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper
from dflash_compile.passes import PASS_NAMES
from tiny_models import FAMILIES, VOCAB, tiny_target

PAD = VOCAB - 2
MAX_NEW = 10
BATCHES = {1: [7], 3: [2, 23, 11], 8: [5, 31, 2, 14, 9, 26, 3, 18]}


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 2, (n,), generator=g).tolist() for n in lengths]


def _small_target(family):
    extra = {"layer_types": ["sliding_attention", "full_attention"]} if family == "gemma3" else {}
    return tiny_target(family, num_hidden_layers=2, **extra)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_pair(request):
    target = _small_target(request.param)
    draft = DFlashDraftModel.from_target(target, num_layers=2, block_size=4, target_layer_ids=[0, 1], seed=0)
    kw = dict(max_batch_size=8, batch_buckets=(1, 8), max_seq_len=64, page_size=8)
    eager = DFlashSpecWrapper(target, draft, **kw)
    expected = {b: eager.generate(_prompts(L, b), max_new_tokens=MAX_NEW, pad_token_id=PAD) for b, L in BATCHES.items()}
    expected["again"] = eager.generate(_prompts(BATCHES[3], 99), max_new_tokens=MAX_NEW, pad_token_id=PAD)
    return request.param, target, draft, kw, expected


@pytest.mark.parametrize("backend", ["dflash", "dflash_neuron"])
def test_compiled_equals_eager(family_pair, backend):
    family, target, draft, kw, expected = family_pair
    torch._dynamo.reset()
    counters.clear()
    spec = DFlashSpecWrapper(target, draft, **kw)
    spec.compile(backend=backend, fullgraph=True)
    for batch, lengths in BATCHES.items():
        out = spec.generate(_prompts(lengths, batch), max_new_tokens=MAX_NEW, pad_token_id=PAD)
        assert torch.equal(out, expected[batch]), (family, backend, batch)
    assert counters["stats"]["unique_graphs"] == 2  # buckets 1 and 8: one graph each
    assert not counters["graph_break"]
    # Every pass fired in each of the two step graphs: the drafter's projection once, a scatter and an attention
    # per target layer and per drafter.
    n_target = len(target.model.layers)
    assert dict(counters["dflash"]) == {
        "fused_kv_proj": 2, "paged_kv_write": 2 * (n_target + 1), "block_attention": 2 * (n_target + 2),
    }
    assert set(counters["dflash"]) == set(PASS_NAMES)
    with torch.compiler.set_stance("fail_on_recompile"):  # warm: new prompts, same buckets, no recompile
        again = spec.generate(_prompts(BATCHES[3], 99), max_new_tokens=MAX_NEW, pad_token_id=PAD)
    assert torch.equal(again, expected["again"])
    assert counters["stats"]["unique_graphs"] == 2
