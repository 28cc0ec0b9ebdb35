"""The package's import rules: the backend entry point loads nothing else, module-level imports form no circle, and
the layers point one way (models and the paged cache know nothing of the runtime; the compiler nothing of either)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "dflash_compile"


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(module_level: bool = True) -> dict[str, set[str]]:
    """Module -> the package modules it imports at module level, or anywhere (function-level imports too)."""
    graph = {}
    for path in ROOT.rglob("*.py"):
        name, is_pkg = _module(path), path.name == "__init__.py"
        here = name.split(".") if is_pkg else name.split(".")[:-1]
        deps = set()
        tree = ast.parse(path.read_text())
        for node in (tree.body if module_level else ast.walk(tree)):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
                if base.startswith("dflash_compile"):
                    # ``from .. import ops`` imports the module ops (the package is already there); else the module
                    deps.update(f"{base}.{a.name}" if (ROOT.parent / f"{base}.{a.name}".replace(".", "/")).with_suffix(
                        ".py").is_file() else base for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("dflash_compile"))
        graph[name] = deps
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def test_backends_entry_point_loads_neither_transformers_nor_the_wrapper():
    code = ("import sys, dflash_compile.backends; "
            "print(sorted(m for m in sys.modules if m.startswith('dflash_compile'))); "
            "print('transformers' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    loaded, transformers = r.stdout.split("\n")[:2]
    assert loaded == "['dflash_compile', 'dflash_compile.backends']" and transformers == "False", r.stdout


def test_public_names_load_on_first_use():
    code = ("import sys, dflash_compile as d; assert 'dflash_compile.runtime.wrapper' not in sys.modules; "
            "d.DFlashSpecWrapper; assert 'dflash_compile.runtime.wrapper' in sys.modules; print(sorted(d.__all__))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "DFlashSpecWrapper" in r.stdout and "validate_pair" in r.stdout


@pytest.mark.parametrize("module_level", [True, False], ids=["module_level", "lazy_imports_too"])
def test_no_import_circle(module_level):
    graph = _imports(module_level)
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                pytest.fail(f"import circle: {' -> '.join(path[path.index(d):] + [d]) if d in path else d}")
            if d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


@pytest.mark.parametrize("layer, forbidden", [
    ("dflash_compile.primitives", ("models", "paged", "step", "runtime", "passes", "lowerings", "serve", "training")),
    ("dflash_compile.models", ("paged", "step", "runtime", "passes", "lowerings", "serve", "training")),
    ("dflash_compile.paged", ("step", "runtime", "passes", "lowerings", "serve", "training")),
    ("dflash_compile.step", ("runtime", "passes", "lowerings", "serve", "training")),
    ("dflash_compile.passes", ("models", "paged", "step", "runtime", "serve", "training")),
    ("dflash_compile.lowerings", ("models", "paged", "step", "runtime", "serve", "training")),
])
def test_layers_point_one_way(layer, forbidden):
    bad = {m: sorted(d for d in deps if any(d.startswith(f"dflash_compile.{f}") for f in forbidden))
           for m, deps in _imports().items() if m.startswith(layer)}
    assert not {m: d for m, d in bad.items() if d}, bad
