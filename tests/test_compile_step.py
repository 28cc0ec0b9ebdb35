"""The step is one graph per batch bucket (every context length): compiled once, never again, equal to eager."""

import pytest
import torch

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper
from tiny_models import FAMILIES, VOCAB, tiny_target

PAD = VOCAB - 2


class CountingBackend:
    def __init__(self):
        self.graphs = []  # the batch size of each compiled step graph

    def __call__(self, gm, example_inputs):  # the graph's own view of its inputs: a dynamic batch is a symbol
        values = [n.meta.get("example_value") for n in gm.graph.find_nodes(op="placeholder")]
        self.graphs.append(next(v.shape[0] for v in values if isinstance(v, torch.Tensor) and v.dim() == 2))
        return gm.forward


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 2, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_step_compiles_once_per_bucket(family):
    target = tiny_target(family)
    draft = DFlashDraftModel.from_target(target, num_layers=2, block_size=4, target_layer_ids=[1, 3], seed=0)
    spec = DFlashSpecWrapper(target, draft, speculation="fixed", max_batch_size=4, batch_buckets=(4,),
                             max_seq_len=96)
    first, second = _prompts([3, 17, 9], 0), _prompts([30, 2, 11, 6], 1)
    eager = [spec.generate(p, max_new_tokens=12, pad_token_id=PAD) for p in (first, second)]

    backend = CountingBackend()
    spec.compile(backend=backend, fullgraph=True)
    torch._dynamo.reset()
    assert torch.equal(spec.generate(first, max_new_tokens=12, pad_token_id=PAD), eager[0])
    assert backend.graphs == [4]
    assert torch.equal(spec.generate(second, max_new_tokens=12, pad_token_id=PAD), eager[1])  # warm
    assert backend.graphs == [4] and [how for _, how, _ in spec.compiled_steps.events] == ["compiled"]


def test_one_graph_for_one_row_and_one_for_every_bucket_from_two():
    """The batch is a dynamic size from 2 rows (``StepKeys.open_batch``): buckets 2 and 4 share a graph, whose
    batch dimension reaches the backend as a symbol; one row keeps a static graph. Every batch size from 1 to 4
    gives the eager step's tokens, with no graph compiled after the first two."""
    target = tiny_target("llama")
    draft = DFlashDraftModel.from_target(target, num_layers=2, block_size=4, target_layer_ids=[1, 3], seed=0)
    spec = DFlashSpecWrapper(target, draft, speculation="fixed", max_batch_size=4, batch_buckets=(1, 2, 4),
                             max_seq_len=96)
    prompts = _prompts([5, 8, 13, 4], 2)
    eager = [spec.generate(prompts[:n], max_new_tokens=6, pad_token_id=PAD) for n in (1, 2, 3, 4)]
    backend = CountingBackend()
    spec.compile(backend=backend, fullgraph=True)
    torch._dynamo.reset()
    keys = spec.compiled_steps.keys
    assert keys.open_batch and keys.key(2, 3, False, 4) == keys.key(4, 3, False, 4) != keys.key(1, 3, False, 4)
    for n in (1, 2, 3, 4):
        assert torch.equal(spec.generate(prompts[:n], max_new_tokens=6, pad_token_id=PAD), eager[n - 1])
    assert len(backend.graphs) == 2 and backend.graphs[0] == 1 and isinstance(backend.graphs[1], torch.SymInt)
    assert [how for _, how, _ in spec.compiled_steps.events] == ["compiled", "compiled"]


def test_a_single_bucket_from_two_rows_keeps_a_static_batch():
    target = tiny_target("llama")
    draft = DFlashDraftModel.from_target(target, num_layers=2, block_size=4, target_layer_ids=[1, 3], seed=0)
    spec = DFlashSpecWrapper(target, draft, speculation="fixed", max_batch_size=4, batch_buckets=(1, 4),
                             max_seq_len=96)
    backend = CountingBackend()
    spec.compile(backend=backend, fullgraph=True)
    torch._dynamo.reset()
    assert not spec.compiled_steps.keys.open_batch  # one bucket from 2 rows: nothing to share
    spec.generate(_prompts([5, 8, 13], 2), max_new_tokens=6, pad_token_id=PAD)
    assert backend.graphs == [1, 4]  # every bucket the batch may fall to, each static


def test_a_proposing_k0_step_runs_in_the_every_k_graph_and_accepts_nothing():
    """``K = 0`` with a proposal (the auto policy's probe) has no graph of its own: it runs the every-K graph with a
    block of 2 whose second token is -1. That step must be the one-token step: the same token, nothing accepted,
    the same next block (the placeholder's K/V land past the row's length, where the next step writes)."""
    from dflash_compile.runtime.generation import resolve_generation_args

    target = tiny_target("qwen3")
    draft = DFlashDraftModel.from_target(target, num_layers=2, block_size=4, target_layer_ids=[1, 3], seed=0)
    spec = DFlashSpecWrapper(target, draft, speculation="auto", max_batch_size=2, batch_buckets=(2,), max_seq_len=96)
    backend = CountingBackend()
    spec.compile(backend=backend, fullgraph=True)
    keys = spec.compiled_steps.keys
    assert keys.block_len(0, True) == 2 and keys.block_len(0, False) == 1 and keys.block_len(3, True) == 4
    assert keys.key(2, 3, False, 1, True) == keys.key(2, 3, False, 4, True)  # one graph for every proposing step
    assert len(keys.keys_for([2], False)) == 2  # that one and plain decoding

    args = resolve_generation_args(target, 12, dict(max_new_tokens=40))
    _, inputs = spec.scheduler.prefill_batch(_prompts([7, 12], 3), args, K=0, propose=True)
    block = inputs[0]
    assert block.shape[1] == 2 and (block[:, 1] == -1).all()
    one = (block[:, :1].clone(), *[t.clone() if isinstance(t, torch.Tensor) else t for t in inputs[1:4]])
    pools = [p.clone() for p in inputs[4]], inputs[5].clone()
    with torch.no_grad():
        tokens, accepted, next_block = spec.step(*inputs, propose=True)  # the compiled every-K graph
        ref_tokens, ref_accepted, ref_next = spec.dflash_step(*one, *pools)  # eager, one-token block
    assert backend.graphs == [2]
    assert accepted.tolist() == ref_accepted.tolist() == [0, 0]
    assert tokens[:, 0].tolist() == ref_tokens[:, 0].tolist() and (tokens[:, 1] == -1).all()
    assert torch.equal(next_block, ref_next)
