"""The shortcut in Inductor's CPU tiling analysis (``tiling_analysis.py``): polynomial indices skip ``sympy.simplify``,
the generated code is the same as without it, and Inductor is left as it was when the shortcut closes. The step
graphs compile through it in every compiled test (``backends._inductor``)."""

from __future__ import annotations

import re

import torch
from torch._dynamo.utils import counters
from torch._inductor import sizevars
from torch._inductor.utils import fresh_cache, run_and_get_code

from dflash_compile import tiling_analysis


def f(x, y, table):
    # affine indices over dynamic sizes (a transposed read, a broadcast), a reduction, and indices with floor
    # division and modulus (a paged gather: row // 4, row % 4), which keep Inductor's own analysis
    a = (x.transpose(0, 1) * y[:, None]).sin()
    rows = torch.arange(x.shape[0])
    slots = table[rows // 4] * 4 + rows % 4
    return a.sum(0), (x[slots] * 2).relu(), (a.t() + x).cumsum(-1)


INPUTS = (torch.randn(12, 20), torch.randn(20), torch.tensor([2, 0, 1]))


def _generated(shortcut: bool) -> tuple[list[str], list[torch.Tensor], int]:
    torch._dynamo.reset()
    counters.clear()
    sizevars.stride_at_vec_range.cache_clear()  # Inductor's memo of the analysis, process-wide
    tiling_analysis._simplify_index_in_vec_range.cache_clear()
    fn = torch.compile(f, backend="inductor", dynamic=True, options={"cpp_wrapper": False})
    with fresh_cache(), tiling_analysis.exact_shortcut(shortcut):
        outs, codes = run_and_get_code(fn, *INPUTS)
    # the generated modules, without the first line's graph counter (``# AOT ID: ['<n>_inference']``)
    codes = [re.sub(r"^# AOT ID: .*\n", "", code) for code in codes]
    return codes, outs, counters["dflash_inductor"]["tiling_indices_kept"]


def test_polynomial_indices_skip_simplify_and_the_code_is_inductors():
    own_codes, own_outs, own_kept = _generated(shortcut=False)
    codes, outs, kept = _generated(shortcut=True)
    assert own_kept == 0 and kept > 0
    assert codes == own_codes  # the same kernels, tiled the same way, and the same wrapper
    for a, b, ref in zip(outs, own_outs, f(*INPUTS)):
        torch.testing.assert_close(a, ref)
        torch.testing.assert_close(b, ref)
    assert sizevars.simplify_index_in_vec_range is tiling_analysis._inductors  # restored on exit


def test_a_non_polynomial_index_takes_inductors_path():
    import sympy
    from torch.utils._sympy.functions import FloorDiv, ModularIndexing

    x0, x1, s = sympy.symbols("x0 x1 s0", integer=True, nonnegative=True)
    counters.clear()
    affine = 64 * s * x0 + x1 + 32
    assert tiling_analysis._simplify_index_in_vec_range(affine, x1, 8) is affine
    paged = 64 * s * FloorDiv(x1, 64) + ModularIndexing(x1, 1, 64)
    assert (tiling_analysis._simplify_index_in_vec_range(paged, x1, 8)
            == tiling_analysis._inductors.__wrapped__(paged, x1, 8))
    assert counters["dflash_inductor"]["tiling_indices_kept"] == 1
