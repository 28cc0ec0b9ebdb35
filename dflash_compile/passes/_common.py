"""Shared plumbing of the DFlash FX passes: pre-dispatch tracing, argument access, pass identity."""

from __future__ import annotations

import hashlib
import inspect

import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.pattern_matcher import stable_topological_sort
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten = torch.ops.aten


def trace_pre_dispatch(fn, args, get_decomp_fn=None, **_):
    """Trace ``fn`` to pre-dispatch ATen, the IR the passes work on (no decompositions, mutations kept)."""
    return make_fx(fn, pre_dispatch=True)(*args)


def bound_args(node: torch.fx.Node) -> dict:
    """A call_function node's arguments by schema name, defaults filled in."""
    schema = node.target._schema
    out = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    out.update(zip((a.name for a in schema.arguments), node.args))
    out.update(node.kwargs)
    return out


def val(node):
    """The fake value of a node (``meta["val"]``), or None."""
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def same_shape(a, b) -> bool:
    """``a == b`` for shapes that may hold symbolic sizes, decided without adding a guard: sizes that are not
    provably equal (for every value their symbols may take) do not match."""
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


class DFlashPass(CustomGraphPass):
    """A graph pass over pre-dispatch ATen. ``uuid()`` hashes the pass's module source, so it changes
    whenever the pass changes (what Inductor's FX graph cache keys on when a pass is registered there)."""

    name: str

    def __call__(self, graph: torch.fx.Graph) -> int:
        n = self.apply(graph)
        if n:
            counters["dflash"][self.name] += n
            stable_topological_sort(graph)  # replacements land at the first matched node; move them after their inputs
            graph.eliminate_dead_code()
        return n

    def apply(self, graph: torch.fx.Graph) -> int:
        raise NotImplementedError

    def uuid(self) -> str:
        source = inspect.getsource(inspect.getmodule(type(self)))
        return hashlib.sha256(source.encode()).hexdigest()
