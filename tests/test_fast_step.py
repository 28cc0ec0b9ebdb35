"""The compiled step that pays for itself: no Python op and no host read inside it, context buckets, a bounded
number of graphs over a long generation, batched prefill, persistent batch state."""

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_compile import DFlashDraftModel, DFlashSpecWrapper
from dflash_compile.backends import dflash_backend, dflash_passes, lower
from dflash_compile.runtime.generation import resolve_generation_args
from dflash_compile.runtime.wrapper import _context_pages
from dflash_compile.runtime.scheduler import PREFILL_OVERHEAD_TOKENS, prefill_groups
from tiny_models import VOCAB, tiny_target

PAD = VOCAB - 2


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 2, (n,), generator=g).tolist() for n in lengths]


def _pair(family="qwen3", layers=2, **kw):
    target = tiny_target(family, num_hidden_layers=layers)
    draft = DFlashDraftModel.from_target(target, num_layers=2, block_size=4, target_layer_ids=[0, layers - 1], seed=0)
    kw.setdefault("speculation", "fixed")  # graph counts and step shapes below are those of one K
    return target, draft, DFlashSpecWrapper(target, draft, **kw)


def _reference(target, prompt, max_new):
    return target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new)[0, len(prompt):].tolist()


class _OpRecorder(TorchDispatchMode):
    """Every op that reaches the dispatcher while active, and every scalar read on the host (device, shape,
    value)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.name()] += 1
        out = func(*args, **(kwargs or {}))
        if func.name() == "aten::_local_scalar_dense":
            self.reads.append((args[0].device.type, args[0].dim(), out))
        return out


def test_compiled_cpu_step_runs_no_python_op_and_reads_nothing_on_the_host():
    # The recorder wraps what the dflash backend returns, so it sees every op the compiled step dispatches at run
    # time (Inductor's own C++ kernels do not dispatch at all). A Python-implemented custom op would show here as a
    # `dflash::` op, a host read as `aten::_local_scalar_dense`.
    target, draft, spec = _pair(max_batch_size=2, batch_buckets=(2,), max_seq_len=32, page_size=8)
    _, _, eager = _pair(max_batch_size=2, batch_buckets=(2,), max_seq_len=32, page_size=8)
    recorder, calls = _OpRecorder(), []

    sizes = set()

    def recording_backend(gm, example_inputs):
        compiled = dflash_backend(gm, example_inputs)

        def run(*args):
            calls.append(1)
            sizes.update(a for a in args if isinstance(a, int))  # the dynamic context size, a host int
            with recorder:
                return compiled(*args)

        return run

    torch._dynamo.reset()
    spec.compile(backend=recording_backend, fullgraph=True)
    prompts = _prompts([3, 11])
    out = spec.generate(prompts, max_new_tokens=10, pad_token_id=PAD)
    assert torch.equal(out, eager.generate(prompts, max_new_tokens=10, pad_token_id=PAD))
    assert calls, "the compiled step never ran"
    # beyond ATen, only the C++ kernels the CPU lowerings give fp32 linears and decoding attention
    # (dflash_cpu::row_linear and ::block_attention, TORCH_LIBRARY kernels: no Python runs for them)
    others = {op for op in recorder.ops if not op.startswith("aten::")}
    assert others <= {"dflash_cpu::row_linear", "dflash_cpu::block_attention"}, recorder.ops
    for op in others:  # its CPU kernel was registered from C++ (a Python kernel is registered from a .py file)
        cpu = [line for line in torch._C._dispatch_dump(op).splitlines() if line.startswith("CPU:")]
        assert cpu and ".cpp:" in cpu[0], torch._C._dispatch_dump(op)
    # The only scalar reads: Inductor's C++ wrapper boxes each host int input (the context pages) in a CPU tensor
    # and reads it back, once per step. Nothing the step computes is read.
    assert sizes and recorder.reads and all(
        device == "cpu" and dim == 0 and value in sizes for device, dim, value in recorder.reads), recorder.reads
    assert len(recorder.reads) <= 2 * len(calls)  # at most one per host int input (pages, a stride equal to it)
    assert "aten::item" not in recorder.ops


def test_lowered_cpu_graph_has_no_dflash_op():
    # The pre-Inductor graph keeps the ops (dumps, counters); the lowered one handed to Inductor has none left.
    _, _, spec = _pair(max_batch_size=2, batch_buckets=(2,), max_seq_len=32, page_size=8)
    seen = {}

    def capture(gm, example_inputs):
        passed = dflash_passes(gm, example_inputs)
        lowered = lower(passed, example_inputs)
        for name, g in (("passed", passed), ("lowered", lowered)):
            seen[name] = Counter(str(n.target) for n in g.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    spec.compile(backend=capture, fullgraph=True)
    spec.generate(_prompts([3, 5]), max_new_tokens=6, pad_token_id=PAD)
    dflash_ops = lambda census: {k: v for k, v in census.items() if k.startswith("dflash.")}  # noqa: E731
    assert dflash_ops(seen["passed"]) == {
        "dflash.block_attention.default": 4, "dflash.fused_kv_proj.default": 1, "dflash.paged_kv_write.default": 3,
    }
    assert dflash_ops(seen["lowered"]) == {}
    assert seen["lowered"]["aten.index_put_.default"] == 3  # the scatters, now plain in-place ATen
    for census in seen.values():
        assert not {"aten._local_scalar_dense.default", "aten.item.default"} & set(census)


def test_context_buckets():
    assert _context_pages(None, 2048, 16) == (8, 16, 32, 64, 128)  # 128, 256, 512, 1024, 2048 tokens
    assert _context_pages(None, 100, 16) == (7,)  # capacity below the first default bucket
    assert _context_pages((20, 64, 5000), 96, 16) == (2, 4, 6)  # rounded up to pages, capped, capacity added
    with pytest.raises(ValueError, match="positive token counts"):
        _context_pages((0, 16), 64, 16)
    _, _, spec = _pair(max_batch_size=2, max_seq_len=256, page_size=8, context_buckets=(32, 64))
    assert spec.context_buckets == (4, 8, 32)
    assert [spec.context_bucket(n) for n in (1, 32, 33, 64, 65, 256, 999)] == [4, 4, 8, 8, 32, 32, 32]


def test_step_attends_over_its_context_bucket_not_the_capacity():
    # The eager step too: its block table (and so every gather and mask) spans the bucket of the live rows.
    _, _, spec = _pair(max_batch_size=4, max_seq_len=512, page_size=8, context_buckets=(16, 64))
    args = resolve_generation_args(spec.target, 9, dict(max_new_tokens=50))
    bucket, inputs = spec.scheduler.prefill_batch(_prompts([5, 9, 3]), args)
    block, seq_lens, tables, active = inputs[:4]
    assert bucket == 4 and tables.shape == (4, 2)  # 9 + 4 positions -> the 16-token bucket: 2 pages of 8
    # rows longest first (prefill runs are of similar lengths), then the bucket's free row
    assert seq_lens.tolist() == [9, 5, 3, 0] and active.tolist() == [True, True, True, False]


def test_long_generation_compiles_a_bounded_number_of_graphs():
    target, draft, spec = _pair(max_batch_size=2, batch_buckets=(1, 2), max_seq_len=160, page_size=8,
                                context_buckets=(32, 64))
    _, _, eager = _pair(max_batch_size=2, batch_buckets=(1, 2), max_seq_len=160, page_size=8,
                        context_buckets=(32, 64))
    graphs = []

    def counting(gm, example_inputs):
        long2d = [t for t in example_inputs if isinstance(t, torch.Tensor) and t.dtype == torch.long and t.dim() == 2]
        graphs.append(max(tuple(t.shape) for t in long2d))  # the block table: [rows, pages] (the block is [rows, 4])
        return gm.forward

    torch._dynamo.reset()
    spec.compile(backend=counting, fullgraph=True)
    prompt = _prompts([6])[0]
    out = spec.generate([prompt], max_new_tokens=140)
    assert out[0, 6:].tolist() == _reference(target, prompt, 140)  # one row crossing every context bucket
    assert len(graphs) == 1  # one graph for batch bucket 1 and every context length
    again = spec.generate([_prompts([9], seed=1)[0]], max_new_tokens=140)  # warm: compiles nothing
    assert torch.equal(again, eager.generate([_prompts([9], seed=1)[0]], max_new_tokens=140))
    assert len(graphs) == 1 and [how for _, how, _ in spec.compiled_steps.events] == ["compiled"]


def test_prefill_groups_minimise_padding_plus_a_cost_per_forward():
    assert prefill_groups([13, 7, 4, 2]) == [(0, 4)]  # 26 padded tokens: less than a second forward costs
    assert prefill_groups([300, 10]) == [(0, 1), (1, 2)]  # 290 padded tokens: more than a second forward
    assert prefill_groups([180, 179, 174, 172, 157, 153, 148, 141, 127, 122, 116, 105, 85, 85, 74, 60]) == [
        (0, 4), (4, 8), (8, 12), (12, 16)]
    for lengths in ([5], [100] * 6, [200, 150, 150, 20, 20, 19], [64, 1, 1, 1]):
        runs = prefill_groups(lengths)
        assert runs[0][0] == 0 and runs[-1][1] == len(lengths) and all(a[1] == b[0] for a, b in zip(runs, runs[1:]))
        cost = lambda rs: sum(PREFILL_OVERHEAD_TOKENS + (e - b) * lengths[b] for b, e in rs)  # noqa: E731
        singles = [(i, i + 1) for i in range(len(lengths))]
        assert cost(runs) <= min(cost([(0, len(lengths))]), cost(singles))


def test_requests_arriving_together_are_prefilled_in_one_forward():
    target, _, spec = _pair(max_batch_size=4, max_seq_len=64, page_size=8)
    spec.kv_cache()  # allocating the pools runs the target once on one token (the layout probe)
    prefill_shapes = []
    handle = target.register_forward_pre_hook(
        lambda module, args, kwargs: prefill_shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    prompts = _prompts([4, 13, 7, 2, 9, 5])
    try:
        out = spec.generate(prompts, max_new_tokens=6, pad_token_id=PAD, return_dict_in_generate=True)
    finally:
        handle.remove()
    width = out.prompt_width
    assert [out.sequences[i, width:].tolist() for i in range(6)] == [_reference(target, p, 6) for p in prompts]
    # The first four arrive together: one [4, 13] left-padded prefill; the rest join as rows free up.
    assert prefill_shapes[0] == (4, 13)
    assert sum(1 for s in prefill_shapes if s[1] != spec.block_size) <= 3


def test_wrappers_over_different_targets_keep_their_own_graphs():
    # Two wrappers over different targets share forward's code object; each holds its own compiled steps (its keys'
    # guards checked once, at their first call): interleaved, each gets its own graphs, greedy and sampled, equal
    # to eager.
    pairs = [_pair("qwen3", max_batch_size=2, max_seq_len=64, page_size=8, context_buckets=(16,)),
             _pair("llama", layers=3, max_batch_size=2, max_seq_len=64, page_size=8, context_buckets=(16,))]
    prompts = _prompts([5, 12])
    kw = dict(max_new_tokens=24, pad_token_id=PAD)
    sampled = dict(kw, do_sample=True, temperature=0.8, seed=[3, 4])
    expected = [(spec.generate(prompts, **kw), spec.generate(prompts, **sampled)) for _, _, spec in pairs]
    torch._dynamo.reset()
    for _, _, spec in pairs:
        spec.compile(backend="eager", fullgraph=True)
    for _ in range(2):
        for (_, _, spec), (greedy, sample) in zip(pairs, expected):
            assert torch.equal(spec.generate(prompts, **kw), greedy)
            assert torch.equal(spec.generate(prompts, **sampled), sample)
