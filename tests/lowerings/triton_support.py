"""Shared by the Triton kernel tests: without a CUDA device the kernels run in the Triton interpreter on CPU tensors
(``TRITON_INTERPRET=1`` is set here, before the first ``import triton``; importing this module skips the importing
test module when triton is missing or was imported too early); with one they are compiled. Tolerances and helpers."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first ``import triton``
triton = pytest.importorskip("triton", reason="triton is not installed")

if not torch.cuda.is_available():
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(triton.language.zeros, InterpretedFunction):  # triton's own @jit helpers were compiled
        pytest.skip(
            "triton was imported (e.g. by torch._dynamo) before TRITON_INTERPRET=1 was set; run this file first, "
            "on its own, or with TRITON_INTERPRET=1 in the environment",
            allow_module_level=True,
        )


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# bf16 is checked against the fp32 reference of the same (upcast) inputs; the interpreter also truncates
# fp32 -> bf16 instead of rounding, which the bf16 tolerance covers.
DTYPES = [
    pytest.param(torch.float32, 2e-5, 2e-5, id="fp32"),
    pytest.param(torch.float16, 5e-3, 5e-3, id="fp16"),
    pytest.param(torch.bfloat16, 3e-2, 3e-2, id="bf16"),
]


def _ref_dtype(dtype):
    return torch.float32 if dtype == torch.bfloat16 else dtype


def _to_ref(x, dtype):
    floating = isinstance(x, torch.Tensor) and x.is_floating_point()
    return x.to(_ref_dtype(dtype)) if floating else x


def _assert_close(actual, expected, atol, rtol):
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)

from dflash_compile.lowerings import ops  # noqa: E402  (after TRITON_INTERPRET is set)



def _attention_inputs(B, Hkv, G, T, D, page_size, NB, with_block, dtype, gen):
    num_pages = B * NB + 3  # spare pages nobody owns
    num_slots = num_pages * page_size
    k_pool = torch.randn(num_slots, Hkv, D, generator=gen).to(dtype)
    v_pool = torch.randn(num_slots, Hkv, D, generator=gen).to(dtype)
    block_table = torch.randperm(num_pages, generator=gen)[: B * NB].view(B, NB)
    ctx_lens = torch.randint(0, NB * page_size + 1, (B,), generator=gen)
    ctx_lens[0] = 0  # a row without context
    if B > 2:
        ctx_lens[-1] = NB * page_size  # a full row
    base = (ctx_lens - torch.randint(0, 7, (B,), generator=gen)).clamp(min=0)  # queries may overlap the context
    q_positions = base[:, None] + torch.arange(T)
    q = torch.randn(B, Hkv * G, T, D, generator=gen).to(dtype)
    k_block = torch.randn(B, Hkv, T, D, generator=gen).to(dtype) if with_block else None
    v_block = torch.randn(B, Hkv, T, D, generator=gen).to(dtype) if with_block else None
    return dict(
        q=q, k_pool=k_pool, v_pool=v_pool, block_table=block_table, ctx_lens=ctx_lens, q_positions=q_positions,
        k_block=k_block, v_block=v_block, page_size=page_size,
    )


def _attention_reference(inputs, dtype, causal, window, scale, chunk=0):
    ref_inputs = {k: _to_ref(v, dtype) for k, v in inputs.items()}
    return ops._block_attention_reference(**ref_inputs, causal=causal, window=window, scale=scale, chunk=chunk)


def _on(inputs, device):
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def _rope(N, D, gen):
    angles = torch.rand(N, D // 2, generator=gen) * 10
    return torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
