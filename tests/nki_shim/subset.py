"""A static check that NKI kernel functions stay inside the Python subset the NKI compiler front end accepts.

``nki.simulate`` (and this shim) run a kernel as plain Python, so a comprehension or a ``zip`` passes there
and only fails in ``neuronx-cc``. This walks the AST of the kernel functions instead: the top-level
``_*_kernel`` functions of a module and every module-level function they call (transitively), and reports

* list / set / dict comprehensions, generator expressions and ``lambda``;
* calls of a bare name that is neither an NKI built-in (:data:`NKI_BUILTINS`) nor a kernel helper of the same
  module (so ``zip``, ``enumerate``, ``sorted``, ``sum``, ``map``, ... are rejected);
* calls through a module other than ``nl``/``nisa``/``nki`` (``math.ceil``, ``np.zeros``, ``torch.*``);
* nested functions, and ``for`` loops over anything but ``range(...)`` / ``nl.*range(...)`` (a conservative
  rule: the kernels index lists and tuples by a range loop rather than iterating them).

Method calls on values (``t.ap(...)``, ``t.broadcast(...)``, ``rows.append(...)``) are left to the compiler.
Host-side launcher code, outside the kernel functions, is not checked.
"""

from __future__ import annotations

import ast
import inspect
import re
import types

#: The built-ins the NKI front end implements (plus ``range``, its loop construct).
NKI_BUILTINS = frozenset({"min", "max", "abs", "str", "bool", "int", "float", "divmod", "tuple", "list", "dict",
                          "len", "isinstance", "type", "slice", "print", "range"})
#: Module aliases whose attributes are NKI API.
NKI_MODULES = frozenset({"nl", "nisa", "nki"})
KERNEL_NAME = re.compile(r"^_\w*_kernel$")

_FORBIDDEN_NODES = {
    ast.ListComp: "list comprehension",
    ast.SetComp: "set comprehension",
    ast.DictComp: "dict comprehension",
    ast.GeneratorExp: "generator expression",
    ast.Lambda: "lambda",
}


class NkiSubsetError(Exception):
    """A kernel function uses Python the NKI compiler front end does not accept."""


def _module_functions(module: types.ModuleType) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(inspect.getsource(module))
    return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _is_range(node: ast.expr) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Name):
        return func.id == "range"
    return (isinstance(func, ast.Attribute) and _root_name(func) == "nl" and func.attr.endswith("range"))


def _check_function(fn: ast.FunctionDef, helpers: dict[str, ast.FunctionDef], module_name: str,
                    module_globals: dict) -> tuple[list[str], set[str]]:
    """Problems found in ``fn`` and the names of the module's functions it calls."""
    problems, called = [], set()
    for node in sorted(ast.walk(fn), key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0))):
        where = f"{module_name}:{getattr(node, 'lineno', fn.lineno)} in {fn.name}()"
        kind = _FORBIDDEN_NODES.get(type(node))
        if kind is not None:
            problems.append(f"{where}: {kind}")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node is not fn:
            problems.append(f"{where}: nested function {node.name}()")
        if isinstance(node, (ast.For, ast.AsyncFor)) and not _is_range(node.iter):
            problems.append(f"{where}: for loop over {ast.unparse(node.iter)}, not range(...) or an nl.*range")
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name):
            if func.id in helpers:
                called.add(func.id)
            elif func.id not in NKI_BUILTINS:
                problems.append(f"{where}: call of {func.id}(), not an NKI built-in or kernel helper")
        elif isinstance(func, ast.Attribute):
            root = _root_name(func)
            if root is not None and root not in NKI_MODULES and isinstance(module_globals.get(root),
                                                                              types.ModuleType):
                problems.append(f"{where}: call of {ast.unparse(func)}(), not NKI API")
        else:
            problems.append(f"{where}: call of {ast.unparse(func)}")
    return problems, called


def kernel_functions(module: types.ModuleType) -> list[str]:
    """Names of the module's kernel functions and the helpers they call, kernels first."""
    return _walk(module)[0]


def _walk(module: types.ModuleType, start: list[str] | None = None) -> tuple[list[str], list[str]]:
    """Check the functions named ``start`` (default: the module's ``_*_kernel`` functions) and, transitively,
    the module's functions they call; returns (the functions checked, the problems found)."""
    functions = _module_functions(module)
    module_name = module.__name__.rsplit(".", 1)[-1] + ".py"
    if start is None:
        start = []
        for name in functions:
            if KERNEL_NAME.match(name):
                start.append(name)
    todo, seen, problems = list(start), [], []
    while todo:
        name = todo.pop(0)
        if name in seen:
            continue
        seen.append(name)
        found, called = _check_function(functions[name], functions, module_name, vars(module))
        problems.extend(found)
        todo.extend(sorted(called - set(seen)))
    return seen, problems


def check_module(module: types.ModuleType) -> list[str]:
    """Every problem in the kernel functions of ``module`` (empty when they stay inside the NKI subset)."""
    return _walk(module)[1]


def check_function(fn) -> None:
    """Raise :class:`NkiSubsetError` when ``fn``, a top-level kernel function, or a helper of its module that it
    calls leaves the NKI subset. Functions defined inside other functions (the shim's own tests build kernels
    from closures) and functions whose source is unavailable are not checked: ``nki.jit`` compiles top-level
    functions."""
    import sys

    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    if module is None or getattr(fn, "__qualname__", None) != getattr(fn, "__name__", None):
        return
    try:
        if fn.__name__ not in _module_functions(module):
            return
        problems = _walk(module, [fn.__name__])[1]
    except (OSError, TypeError):
        return
    if problems:
        raise NkiSubsetError("the kernel leaves the Python subset of the NKI compiler:\n  " + "\n  ".join(problems))
