"""One C++ build per graph (``cpp_units.py``): the kernels Inductor generates under its Python wrapper are built
together as one translation unit inside ``one_unit_per_graph``, give what eager gives, leave other compiles alone,
and fall back to Inductor's own builds, said once, when the unit cannot be built. The step graphs that use it are
checked in ``tests/test_compiled_generate.py::test_compiled_regions_equal_eager``."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.codecache import CppPythonBindingsCodeCache
from torch._inductor.utils import fresh_cache, run_and_get_code

from dflash_compile import cpp_units


def f(x, y, n: torch.Tensor):
    a = torch.softmax(x, -1) * y  # a kernel before the matmul (an extern call), others after it
    h = a @ y.t()
    b = (h.sum(0) + n[: h.shape[1]].to(h.dtype)).relu()  # a reduction with an int64 input
    return (h * 2).cumsum(-1)[:, :3], b, torch.sort(h, -1).values.max(), (x > 0).to(torch.int64).sum()


def _compile(dynamic: bool, units: bool):
    torch._dynamo.reset()
    counters.clear()
    per_kernel = []
    inductor_build = CppPythonBindingsCodeCache.load_pybinding_async
    fn = torch.compile(f, backend="inductor", dynamic=dynamic, options={"cpp_wrapper": False})
    args = [(torch.randn(rows, 24), torch.randn(rows, 24), torch.arange(24)) for rows in (5, 9)]

    def counting(*a, **k):
        per_kernel.append(1)
        return inductor_build(*a, **k)

    with fresh_cache(), cpp_units.one_unit_per_graph(units), pytest.MonkeyPatch.context() as mp:
        mp.setattr(CppPythonBindingsCodeCache, "load_pybinding_async", counting)
        outs, codes = [], []
        for a in args:
            out, code = run_and_get_code(fn, *a)
            outs.append(out)
            codes += code
    for a, out in zip(args, outs):
        for got, want in zip(out, f(*a)):
            torch.testing.assert_close(got, want)
    kernels = sum(c.count("async_compile.cpp_pybinding(") for c in codes)
    assert len(codes) == counters["stats"]["unique_graphs"]
    return kernels, len(per_kernel), dict(counters["dflash"]), codes


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_a_graphs_kernels_build_as_one_unit_and_compute_what_eager_does(dynamic):
    kernels, inductor_builds, c, codes = _compile(dynamic, units=True)
    assert kernels >= 3 * len(codes) and inductor_builds == 0
    assert c == {"cpp_units": len(codes), "cpp_unit_kernels": kernels}  # one build per graph
    if dynamic:  # sizes reach the kernels as int64 arguments
        assert any("'const int64_t'" in code for code in codes)


def test_outside_the_context_inductor_builds_each_kernel():
    kernels, inductor_builds, c, _ = _compile(dynamic=True, units=False)
    assert inductor_builds == kernels >= 3 and c == {}


def test_a_unit_that_fails_to_build_falls_back_to_inductors_builds_said_once(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no compiler today")

    monkeypatch.setattr(cpp_units._UnitCache, "load", broken)
    monkeypatch.setattr(cpp_units, "_said", set())
    with caplog.at_level(logging.WARNING, logger="dflash_compile.cpp_units"):
        kernels, inductor_builds, c, codes = _compile(dynamic=False, units=True)
    assert inductor_builds == kernels and c == {"cpp_units_failed": len(codes)}
    said = [r.getMessage() for r in caplog.records if "as one unit failed" in r.getMessage()]
    assert len(said) == 1 and "no compiler today" in said[0]


KERNEL = '''#include <torch/csrc/inductor/cpp_prefix.h>
extern "C"  void  kernel(const float* in_ptr0, float* out_ptr0, const int64_t ks0)
{
    for(int64_t x0=0; x0<ks0; x0+=1) { out_ptr0[x0] = in_ptr0[x0] * 2.0f; }
}
'''


def test_only_kernels_it_recognises_go_into_a_unit():
    types = ["const float*", "float*", "const int64_t"]
    assert cpp_units.batchable(types, KERNEL)
    assert not cpp_units.batchable(types + ["const bool"], KERNEL)  # a scalar type the binding does not convert
    assert not cpp_units.batchable(types, KERNEL.replace("{", "{\n#define TWO 2\n", 1))  # would leak into the next
    assert not cpp_units.batchable(types, KERNEL + KERNEL.split("\n", 1)[1].replace("kernel(", "kernel2("))
    assert not cpp_units.batchable(types, KERNEL.replace('extern "C"', ""))


def test_a_unit_holds_each_kernel_in_its_own_namespace_once_included():
    src = cpp_units.unit_source([(["const float*", "float*", "const int64_t"], KERNEL)] * 2)
    assert src.count("#include <torch/csrc/inductor/cpp_prefix.h>") == 1
    assert src.count('extern "C"') == 0 and "namespace dflash_k0 {" in src and "namespace dflash_k1 {" in src
    assert 'dflash_k1::kernel(static_cast<float*>(dflash_tensor_data(PyTuple_GET_ITEM(args, 0)))' in src
    assert "dflash_scalar<int64_t>(args, 2, PyLong_AsLongLong)" in src


def test_a_saved_region_graph_loads_its_unit_in_another_process_without_building(tmp_path):
    """A step graph with regions (Python wrapper) saved by one process and loaded by another: the loading process
    runs the module's ``cpp_pybinding`` calls again, gets the same unit, finds it built (no compiler run, no
    per-kernel build) and gives the same tokens."""
    import json
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    from test_compile_cache import _new_tokens, _pair, _reference
    from tiny_models import random_prompts

    torch._dynamo.reset()
    counters.clear()
    target, spec = _pair()
    spec.compile(backend="dflash", cache_dir=tmp_path / "c", regions=True)
    prompt = random_prompts([9], 2)[0]
    tokens = _new_tokens(spec, prompt, 12)
    assert tokens == _reference(target, prompt, 12)
    assert counters["dflash"]["cpp_units"] == 1 and counters["dflash"]["region_calls"] > 1
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import torch
        from torch._dynamo.utils import counters
        from torch._inductor import cpp_builder
        from torch._inductor.codecache import CppPythonBindingsCodeCache
        from test_compile_cache import _pair, _new_tokens
        builds, per_kernel = [], []
        build = cpp_builder.CppBuilder.build
        cpp_builder.CppBuilder.build = (
            lambda self, *a, **k: builds.append(self.get_target_file_path()) or build(self, *a, **k))
        one = CppPythonBindingsCodeCache.load_pybinding_async
        CppPythonBindingsCodeCache.load_pybinding_async = lambda *a, **k: per_kernel.append(1) or one(*a, **k)
        target, spec = _pair()
        spec.compile(backend="dflash", cache_dir={str(tmp_path / "c")!r}, regions=True)
        tokens = _new_tokens(spec, {prompt!r}, 12)
        print(json.dumps([tokens, [how for _, how, _ in spec.compiled_steps.events], builds, len(per_kernel),
                          dict(counters["dflash"])]))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    got, hows, built, per_kernel, dflash = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == tokens and hows == ["loaded"]
    assert built == [] and per_kernel == 0 and dflash.get("cpp_units") == 1, (built, per_kernel, dflash)
