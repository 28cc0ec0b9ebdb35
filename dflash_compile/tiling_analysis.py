"""A shortcut in Inductor's CPU tiling analysis, exact for the indices it takes.

To choose which loop of a CPU kernel to vectorise, Inductor computes each memory access's stride along each loop
variable (``torch._inductor.codegen.cpp.CppKernelProxy._select_tiling_indices`` ->
``sizevars.stride_at_vec_range``). It first rewrites the index for a vector-length range of the variable
(``simplify_index_in_vec_range``: floor divisions and moduli of the variable by a multiple of the vector length
become free symbols) and then runs ``sympy.simplify`` over the result, 20-50 ms a call on this project's machine
even for an affine index such as ``64*x1 + x3 + 32``, and a graph with dynamic sizes has hundreds of distinct
indices (the tiny pair's every-K graph: 234 calls, 4.4 s of a 40 s compile).

A polynomial index (sums and products of loop variables, sizes and constants: no floor division, modulus or other
function) has nothing to rewrite, and simplifying it cannot change the stride computed from it: ``stride_at``
simplifies ``index(var + 1) - index(var)`` itself, a polynomial in both cases, equal as a polynomial whether or
not the index was simplified first. So while :func:`exact_shortcut` is open such an index is returned as it is;
every other index takes Inductor's own path. Only the analysis is shortened: Inductor generates code from the
original index (``tests/test_tiling_analysis.py`` compiles a graph with and without the shortcut and compares the
generated modules, their C++ included).
"""

from __future__ import annotations

import contextlib
import functools

from torch._dynamo.utils import counters
from torch._inductor import sizevars

_inductors = sizevars.simplify_index_in_vec_range


@functools.lru_cache
def _simplify_index_in_vec_range(index, var, vec_length: int):
    if index.is_polynomial():  # no floor division, modulus or other function of the sizes
        counters["dflash_inductor"]["tiling_indices_kept"] += 1
        return index
    return _inductors(index, var, vec_length)


@contextlib.contextmanager
def exact_shortcut(enabled: bool = True):
    """While open (process-wide: Inductor reads the function from its module), polynomial indices skip
    ``sympy.simplify`` in Inductor's vector-range stride analysis (counted: ``counters["dflash_inductor"]
    ["tiling_indices_kept"]``)."""
    if not enabled or sizevars.simplify_index_in_vec_range is _simplify_index_in_vec_range:
        yield
        return
    sizevars.simplify_index_in_vec_range = _simplify_index_in_vec_range
    try:
        yield
    finally:
        sizevars.simplify_index_in_vec_range = _inductors
