"""The CPU kernels' fake (meta) implementations against their real outputs, through ``torch.library.opcheck``: sizes,
strides and dtypes equal, the schema's aliasing true, the op traceable by AOTAutograd with dynamic shapes. Compiled
graphs that call nested compile regions run without Inductor's runtime size and stride asserts
(``backends.REGION_CPU_INDUCTOR_OPTIONS``): these checks are what stand in for them."""

import pytest
import torch

from dflash_compile.lowerings.cpu import row_linear
from tests.lowerings.test_cpu_kernels import _case

pytestmark = pytest.mark.skipif(not row_linear.load(), reason="the CPU kernels cannot be built here (no compiler)")
# test_autograd_registration needs inputs that require grad, and the kernels have no derivative
CHECKS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


def _codes_weight(n, k, g):
    """Values d * q on blocks of 32 (GGUF Q8_0's form): the kernel keeps a codes copy of such a weight."""
    d = (torch.rand(n, k // 32, 1, generator=g) / 2 + 0.5).half().float() / 64  # fp16 scales, none subnormal
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
    q[..., 0] = 127  # a block's largest magnitude is 127 codes of its scale, as the file's quantiser makes it
    return (d * q).view(n, k)


@pytest.mark.parametrize("lead", [(1,), (3,), (2, 4), (1, 1, 8), (130,)])  # 130 rows: at::linear's
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("codes", [False, True])
def test_row_linear_fake_matches_the_kernel(lead, bias, codes):
    g = torch.Generator().manual_seed(len(lead) + lead[-1])
    w = _codes_weight(40, 64, g) if codes else torch.randn(40, 64, generator=g)
    x = torch.randn(*lead, 64, generator=g)
    b = torch.randn(40, generator=g) if bias else None
    if codes:
        torch.ops.dflash_cpu.row_linear(x[..., :1, :], w, b)
        assert "codes" in torch.ops.dflash_cpu.row_linear_packed_form(w)
    with torch.no_grad():
        torch.library.opcheck(torch.ops.dflash_cpu.row_linear.default, (x, w), {"bias": b}, test_utils=CHECKS)


def test_row_linear_fake_matches_on_a_strided_input():
    x = torch.randn(6, 2, 64).transpose(0, 1)  # not contiguous: the kernel copies it, the output is contiguous
    w = torch.randn(24, 64)
    with torch.no_grad():
        torch.library.opcheck(torch.ops.dflash_cpu.row_linear.default, (x, w), {"bias": None}, test_utils=CHECKS)


@pytest.mark.parametrize("T,gqa,with_block,causal", [(1, 2, False, True), (4, 1, True, False), (8, 4, False, True)])
def test_block_attention_fake_matches_the_kernel(T, gqa, with_block, causal):
    q, k_pool, v_pool, table, ctx_lens, q_pos, kb, vb = _case(T, 4, gqa, with_block, torch.float32, pool_lead=causal)
    args = (q, k_pool, v_pool, table, ctx_lens, q_pos, kb, vb, 4, causal, 0, 0.25, 0)
    torch.library.opcheck(torch.ops.dflash_cpu.block_attention.default, args, test_utils=CHECKS)
