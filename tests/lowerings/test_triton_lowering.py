"""The Triton kernels as lowerings: registration, the CUDA lowering table, tracing with fake CUDA tensors, and
Inductor compiling the lowered ops."""

import os

import pytest
import torch

from triton_support import (  # noqa: F401
    DEVICE, DTYPES, _assert_close, _attention_inputs, _attention_reference, _on, _ref_dtype, _rope, _to_ref, triton,
)

from dflash_compile.lowerings import ops  # noqa: E402, F401
from dflash_compile.lowerings.triton import block_attention as block_attention_mod  # noqa: E402, F401
from dflash_compile.lowerings.triton import cuda_lowerings, register_cuda_kernels  # noqa: E402, F401
from dflash_compile.lowerings.triton.block_attention import block_attention  # noqa: E402, F401
from dflash_compile.lowerings.triton.fused_kv_proj import fused_kv_proj  # noqa: E402, F401
from dflash_compile.lowerings.triton.paged_kv_write import paged_kv_write  # noqa: E402, F401


# ------------------------------------------------------------------------------------------------ registration
def test_register_cuda_kernels_is_idempotent():
    register_cuda_kernels()
    register_cuda_kernels()
    if DEVICE != "cuda":
        return
    gen = torch.Generator().manual_seed(2)
    inputs = _attention_inputs(2, 2, 2, 3, 64, 4, 3, True, torch.float16, gen)
    args = dict(causal=False, window=0, scale=0.125)
    expected = _attention_reference(inputs, torch.float16, **args)
    _assert_close(ops.block_attention(**_on(inputs, DEVICE), **args), expected, 5e-3, 5e-3)


# ---------------------------------------------------------------------------------------------- lowering table
def test_cuda_lowerings_cover_every_op_with_the_public_functions():
    table = cuda_lowerings()
    assert table == {
        torch.ops.dflash.fused_kv_proj.default: fused_kv_proj,
        torch.ops.dflash.paged_kv_write.default: paged_kv_write,
        torch.ops.dflash.block_attention.default: block_attention,
    }


# Run in a fresh interpreter without TRITON_INTERPRET (this module runs the interpreter): fake CUDA tensors need
# no GPU, and make_fx records the wrap_triton launches. The HOPs' mutation analysis compiles each kernel to TTIR
# for the active driver's target; with no GPU there is no driver, so a stand-in names an sm_90 target (without
# it the analysis gives up and assumes every input is written: correct, but Inductor would clone the pool).
_FAKE_CUDA_PRELUDE = """
import json
import torch
import triton
from triton.backends.compiler import GPUTarget
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from dflash_compile.lowerings import ops  # noqa: F401  (defines the ops)


class _TargetOnlyDriver:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


if not torch.cuda.is_available():
    triton.runtime.driver.set_active(_TargetOnlyDriver())
"""

_FAKE_CUDA_TRACE = _FAKE_CUDA_PRELUDE + """
from dflash_compile.lowerings.triton import cuda_lowerings



# Tensor indexing (``t[0]``) of a fake CUDA tensor needs a CUDA build of torch: select() does not.
def step(ctx, weight, k_norm_weight, cos, sin, k_pool, v_pool, slots, q, block_table, ctx_lens, q_positions):
    k, v = torch.ops.dflash.fused_kv_proj(ctx, weight, k_norm_weight, cos, sin, 1e-6)  # [L, N, Hkv, D]
    torch.ops.dflash.paged_kv_write(k_pool, slots, k)
    torch.ops.dflash.paged_kv_write(v_pool, slots, v)
    k_block, v_block = (x.select(0, 0).transpose(0, 1).unsqueeze(0) for x in (k, v))  # layer 0: [1, Hkv, N, D]
    out = torch.ops.dflash.block_attention(
        q, k_pool.select(0, 0), v_pool.select(0, 0), block_table, ctx_lens, q_positions, k_block, v_block,
        4, True, 0, 0.125,
    )
    return out, k_pool.sum()  # reads the pools after the writes


L, N, Hkv, D, H, G, S = 2, 3, 2, 64, 32, 2, 40
with FakeTensorMode():
    c = lambda *shape, dtype=torch.float16: torch.empty(*shape, device="cuda", dtype=dtype)
    args = (
        c(N, H), c(2 * L * Hkv * D, H), c(L, D), c(N, D), c(N, D), c(L, S, Hkv, D), c(L, S, Hkv, D),
        c(N, dtype=torch.long), c(1, Hkv * G, N, D), c(1, 5, dtype=torch.long), c(1, dtype=torch.long),
        c(1, N, dtype=torch.long),
    )
ops_gm = make_fx(step, pre_dispatch=True, tracing_mode="fake")(*args)
lowered = make_fx(ops_gm, decomposition_table=cuda_lowerings(), pre_dispatch=True, tracing_mode="fake")(*args)
functional = make_fx(torch.func.functionalize(lowered, remove="mutations_and_views"), tracing_mode="fake")(*args)
targets = lambda gm: [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
print(json.dumps(dict(
    ops=targets(ops_gm),
    lowered=targets(lowered),
    clones=[n.kwargs["tensors_to_clone"] for n in functional.graph.nodes if "tensors_to_clone" in n.kwargs],
)))
"""


def test_cuda_lowerings_trace_with_fake_cuda_tensors():
    """make_fx with the table turns every dflash op into Triton HOPs without a GPU; each writes only its outputs."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _FAKE_CUDA_TRACE], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "assuming every input is mutated" not in proc.stderr, proc.stderr[-3000:]
    graphs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sum(t.startswith("dflash.") for t in graphs["ops"]) == 4
    assert not [t for t in graphs["lowered"] if "dflash" in t]
    assert graphs["lowered"].count("triton_kernel_wrapper_mutation") == 4
    # fused_kv_proj writes K and V, paged_kv_write only the pool (twice), block_attention only its output
    assert graphs["clones"] == [["k_ptr", "v_ptr"], ["pool_ptr"], ["pool_ptr"], ["out_ptr"]]


_FAKE_CUDA_SPLIT_TRACE = _FAKE_CUDA_PRELUDE + """
from dflash_compile.lowerings.triton import block_attention as ba
B, Hkv, G, T, D, ps, NB = 1, 2, 2, 16, 128, 16, 256  # 4 programs, 4096 context positions: split
plan = ba.plan(B, Hkv * G, Hkv, T, D, torch.float16, NB * ps)
with FakeTensorMode():
    c = lambda *shape, dtype=torch.float16: torch.empty(*shape, device="cuda", dtype=dtype)
    args = (c(B, Hkv * G, T, D), c(NB * ps, Hkv, D), c(NB * ps, Hkv, D), c(B, NB, dtype=torch.long),
            c(B, dtype=torch.long), c(B, T, dtype=torch.long), c(B, Hkv, T, D), c(B, Hkv, T, D))
f = lambda *a: ba.block_attention(*a, ps, False, 0, D**-0.5)
gm = make_fx(f, pre_dispatch=True, tracing_mode="fake")(*args)
targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
print(json.dumps(dict(splits=plan.num_splits, targets=targets)))
"""


def test_block_attention_split_traces_with_fake_cuda_tensors():
    """The split path (attention kernel + combine kernel, fp32 workspace) traces into two Triton HOPs."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _FAKE_CUDA_SPLIT_TRACE], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["splits"] > 1
    assert report["targets"].count("triton_kernel_wrapper_mutation") == 2, report["targets"]


def _lowering_cases():
    gen = torch.Generator().manual_seed(12)
    dtype = torch.float16
    L, N, Hkv, D, H = 2, 3, 2, 64, 48
    ctx = torch.randn(N, H, generator=gen).to(dtype)
    weight = (torch.randn(2 * L * Hkv * D, H, generator=gen) / H**0.5).to(dtype)
    k_norm_weight = (torch.rand(L, D, generator=gen) + 0.5).to(dtype)
    cos, sin = (t.to(dtype) for t in _rope(N, D, gen))
    attention = _attention_inputs(3, 2, 2, 5, 64, 4, 6, True, dtype, gen)
    pool = torch.randn(2, 23, Hkv, D, generator=gen).to(dtype)
    slots = torch.tensor([5, -1, 0, -10, 12])
    values = torch.randn(2, len(slots), Hkv, D, generator=gen).to(dtype)
    return {
        "fused_kv_proj": (
            lambda *a: torch.ops.dflash.fused_kv_proj(*a, 1e-6), [ctx, weight, k_norm_weight, cos, sin]
        ),
        "paged_kv_write": (_write_then_read, [pool, slots, values]),
        "block_attention": (
            lambda *a: torch.ops.dflash.block_attention(*a, 4, True, 3, 0.125),
            [attention[k] for k in ("q", "k_pool", "v_pool", "block_table", "ctx_lens", "q_positions")]
            + [attention["k_block"], attention["v_block"]],
        ),
    }


def _write_then_read(pool, slots, values):
    torch.ops.dflash.paged_kv_write(pool, slots, values)
    return pool.float().sum(-1)  # [*lead, num_slots, Hkv]: must see the writes


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device: Inductor compiles the traced Triton kernels for it (the fake-CUDA trace test "
    "covers the tracing without one)",
)
@pytest.mark.parametrize("op", ["fused_kv_proj", "paged_kv_write", "block_attention"])
def test_cuda_lowering_compiles_with_inductor(op):
    """dynamo graph -> the table (make_fx) -> Inductor, as the backend does: Triton HOPs, no dflash op, same values."""
    from torch._inductor.compile_fx import compile_fx
    from torch.fx.experimental.proxy_tensor import make_fx

    fn, args = _lowering_cases()[op]
    expected_args = [a.float() if a.is_floating_point() else a.clone() for a in args]  # fp32 reference, on CPU
    expected = fn(*expected_args)
    lowered = []

    def backend(gm, example_inputs):
        with torch._guards.tracing(None):
            gm = make_fx(gm, decomposition_table=cuda_lowerings(), pre_dispatch=True, tracing_mode="fake")(
                *example_inputs
            )
        lowered.append(gm)
        return compile_fx(gm, example_inputs)

    cuda_args = [a.to("cuda") for a in args]
    actual = torch.compile(fn, backend=backend, fullgraph=True)(*cuda_args)
    targets = [str(n.target) for gm in lowered for n in gm.graph.nodes if n.op == "call_function"]
    assert "triton_kernel_wrapper_mutation" in targets
    assert not [t for t in targets if "dflash" in t]
    as_tuple = lambda x: x if isinstance(x, tuple) else (x,)  # noqa: E731
    for a, e in zip(as_tuple(actual), as_tuple(expected), strict=True):
        _assert_close(a, e, 5e-3, 5e-3)
    if op == "paged_kv_write":
        _assert_close(cuda_args[0], expected_args[0], 0, 0)  # the pool itself was written
