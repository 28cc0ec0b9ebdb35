"""A saved graph loads without importing Inductor's lowering (runtime/deferred_imports.py).

Both tests run their loading side in a fresh interpreter: the test process has imported all of Inductor long ago,
and with the modules imported the window changes nothing.
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from dflash_compile.runtime.deferred_imports import DEFERRED

HEAVY = ("torch._inductor.lowering", "torch._inductor.select_algorithm", "torch._inductor.decomposition",
         "torch._inductor.graph", "torch._inductor.codegen.memory_planning")


def _run(script: str, cwd) -> list:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                         timeout=600, cwd=cwd)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_stand_ins_answer_generated_code_and_import_the_real_module_on_first_use(tmp_path):
    got = _run(f"""
        import json, sys
        import torch
        from dflash_compile.runtime.deferred_imports import DEFERRED, Deferred, deferred_imports
        heavy = {HEAVY!r}
        before = [m for m in heavy if m in sys.modules]
        with deferred_imports():
            # what Inductor's generated modules and a saved graph's post-compile import
            from torch._inductor.select_algorithm import extern_kernels
            from torch._inductor.codegen.memory_planning import _align as align
            from torch._inductor.graph import GraphLowering
            from torch._inductor.decomposition import select_decomp_table
            hook = GraphLowering.save_output_code
            inside = [m for m in heavy if type(sys.modules.get(m)).__name__ == "module"]
            kinds = [type(x).__name__ for x in (extern_kernels, align, GraphLowering, select_decomp_table)]
            # another thread (a background compile importing Inductor meanwhile) reads the real class
            import threading
            other = []
            t = threading.Thread(target=lambda: other.append(
                isinstance(__import__("torch._inductor.graph", fromlist=["GraphLowering"]).GraphLowering, type)))
            t.start(); t.join()
        left = [m for m in DEFERRED if type(sys.modules.get(m)).__name__ == "StandIn"]  # the stand-ins are gone
        aligned = align(13)  # first use: the real module is imported and its function called
        import torch._inductor.codegen.memory_planning as mp
        real = [aligned == mp._align(13), sys.modules["torch._inductor.codegen.memory_planning"] is mp]
        import torch._inductor.graph as g  # the real class's attributes from now on
        g.GraphLowering.save_output_code = print
        real.append(GraphLowering.save_output_code is print)
        real.append(callable(extern_kernels.__class__))
        real.append(len(select_decomp_table()) > 100)
        print(json.dumps([before, inside, kinds, hook, left, real + other]))
    """, tmp_path)
    before, inside, kinds, hook, left, real = got
    assert before == [] and inside == [], (before, inside)
    assert len(real) == 6
    assert kinds == ["Deferred"] * 4 and hook is None
    assert left == [] and all(real), (left, real)


def test_a_saved_graph_loads_and_runs_in_a_fresh_process_without_inductors_lowering(tmp_path):
    """Inline (C++ wrapper) and region (Python wrapper) graphs saved by this process, loaded by another: the same
    tokens, greedy and sampled, and none of the modules the stand-ins defer was imported."""
    from test_compile_cache import _new_tokens, _pair, _reference
    from tiny_models import random_prompts

    torch._dynamo.reset()
    prompt = random_prompts([9], 3)[0]
    want = {}
    for regions in (False, True):
        target, spec = _pair()
        spec.compile(backend="dflash", cache_dir=tmp_path / f"c{regions}", regions=regions)
        greedy = _new_tokens(spec, prompt, 10)
        assert greedy == _reference(target, prompt, 10)
        sampled = spec.generate([prompt], max_new_tokens=10, do_sample=True, seed=3)[0, len(prompt):].tolist()
        want[str(regions)] = [greedy, sampled]
    got = _run(f"""
        import json, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_compile_cache import _pair, _new_tokens
        out, hows = {{}}, []
        for regions in (False, True):
            target, spec = _pair()
            spec.compile(backend="dflash", cache_dir={str(tmp_path)!r} + f"/c{{regions}}", regions=regions)
            greedy = _new_tokens(spec, {prompt!r}, 10)
            sampled = spec.generate([{prompt!r}], max_new_tokens=10, do_sample=True, seed=3)[0, {len(prompt)}:]
            out[str(regions)] = [greedy, sampled.tolist()]
            hows += [how for _, how, _ in spec.compiled_steps.events]
        print(json.dumps([out, hows, [m for m in {HEAVY!r} if m in sys.modules]]))
    """, tmp_path)
    out, hows, imported = got
    assert out == want
    assert set(hows) == {"loaded"}, hows
    assert imported == [], imported
    assert set(DEFERRED) <= set(HEAVY)
