"""The NKI kernels stay inside the Python subset the NKI compiler front end accepts.

``nki.simulate`` and the test shim run a kernel as ordinary Python, so a list comprehension, a generator
expression, ``zip`` or ``enumerate`` in a kernel passes every numerical test and fails only in ``neuronx-cc``.
This checks the kernel functions statically (``tests/nki_shim/subset.py``), with or without the SDK.
"""

import importlib
import pkgutil
import sys
import textwrap

import pytest

pytest.importorskip("numpy", reason="numpy is not installed (the NKI shim runs on it)")

import dflash_compile.lowerings.nki as nki_kernels  # noqa: E402
from nki_shim import subset  # noqa: E402

KERNEL_MODULES = sorted(
    info.name for info in pkgutil.iter_modules(nki_kernels.__path__) if not info.name.startswith("_")
)


def test_every_kernel_module_is_found():
    assert KERNEL_MODULES == ["block_attention", "fused_kv_proj", "paged_kv_write"]


@pytest.mark.parametrize("name", KERNEL_MODULES)
def test_kernels_stay_inside_the_nki_subset(name):
    module = importlib.import_module(f"{nki_kernels.__name__}.{name}")
    checked = subset.kernel_functions(module)
    assert f"_{name}_kernel" in checked
    assert subset.check_module(module) == []


def test_helpers_called_by_kernels_are_checked():
    module = importlib.import_module(f"{nki_kernels.__name__}.block_attention")
    assert subset.kernel_functions(module) == ["_block_attention_kernel", "_attend", "_restrict"]
    module = importlib.import_module(f"{nki_kernels.__name__}.fused_kv_proj")
    assert subset.kernel_functions(module) == ["_fused_kv_proj_kernel", "_norm_rope"]


_BAD_SOURCE = '''
import math

nl = nisa = None


def _helper(xs):
    return [x for x in xs]


def _host_side(xs):  # not called by a kernel: ordinary Python is fine here
    return sorted(x for x in xs)


def _bad_kernel(a, n):
    P = nl.tile_size.pmax
    chunks = [(i, min(n, i + P)) for i in range(0, n, P)]
    widest = max(b - a for a, b in chunks)
    squares = {i: i * i for i in range(n)}
    uniq = {i for i in range(n)}
    f = lambda v: v + 1
    for c, (lo, hi) in enumerate(chunks):
        pass
    for lo, x in zip(chunks, squares):
        pass
    for t in chunks:
        pass
    m = math.ceil(n / P)
    s = sum(squares)
    t = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=t, value=float(abs(divmod(n, 2)[0])))
    a.ap(pattern=[[1, 1]], offset=0).broadcast(0, 2)
    rows = []
    rows.append(t)
    _helper(rows)
    return t
'''


@pytest.fixture
def bad_module(tmp_path, monkeypatch):
    (tmp_path / "nki_subset_bad.py").write_text(textwrap.dedent(_BAD_SOURCE))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("nki_subset_bad")
    yield module
    sys.modules.pop("nki_subset_bad", None)


def test_checker_rejects_what_the_nki_front_end_rejects(bad_module):
    assert subset.kernel_functions(bad_module) == ["_bad_kernel", "_helper"]
    problems = "\n".join(subset.check_module(bad_module))
    for expected in [
        "nki_subset_bad.py:17 in _bad_kernel(): list comprehension",
        "nki_subset_bad.py:18 in _bad_kernel(): generator expression",
        "nki_subset_bad.py:19 in _bad_kernel(): dict comprehension",
        "nki_subset_bad.py:20 in _bad_kernel(): set comprehension",
        "nki_subset_bad.py:21 in _bad_kernel(): lambda",
        "nki_subset_bad.py:22 in _bad_kernel(): call of enumerate()",
        "nki_subset_bad.py:24 in _bad_kernel(): call of zip()",
        "nki_subset_bad.py:26 in _bad_kernel(): for loop over chunks",
        "nki_subset_bad.py:28 in _bad_kernel(): call of math.ceil(), not NKI API",
        "nki_subset_bad.py:29 in _bad_kernel(): call of sum()",
        "nki_subset_bad.py:8 in _helper(): list comprehension",
    ]:
        assert expected in problems
    # NKI built-ins, nl/nisa API, methods of values and the module's helpers are accepted; host code is not read
    for accepted in ["min(", "max(", "abs(", "divmod(", "float(", "range(", "nl.ndarray", "nisa.memset", ".ap(",
                     ".broadcast(", ".append(", "_helper()", "sorted", "_host_side"]:
        assert f"call of {accepted}" not in problems
    assert problems.count("\n") + 1 == 13  # the 11 above, plus the zip and enumerate loops' iterables


def test_shim_jit_rejects_a_kernel_outside_the_subset(bad_module):
    import nki_shim

    with pytest.raises(subset.NkiSubsetError, match="list comprehension"):
        nki_shim.jit(bad_module._bad_kernel)
    with pytest.raises(subset.NkiSubsetError, match="generator expression"):
        nki_shim.simulate(bad_module._bad_kernel)
    with pytest.raises(subset.NkiSubsetError, match="call of sorted"):
        nki_shim.jit(bad_module._host_side)  # whatever is jitted is checked, whatever its name


def test_checker_accepts_kernels_built_in_closures():
    import nki_shim

    def local_kernel(xs):  # the shim's own tests build kernels like this; nki.jit wants top-level functions
        return [x for x in xs]

    kernel = nki_shim.jit(local_kernel)  # not refused: a closure's source is not checked (only module kernels are)
    assert kernel.fn is local_kernel and kernel.__name__ == "local_kernel"
    assert nki_shim.jit(kernel) is kernel  # jitting a kernel again is the same kernel
