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


def size_arg(graph: torch.fx.Graph, node: torch.fx.Node, dim: int):
    """``node``'s size along ``dim`` as an argument of a node inserted into ``graph``: the int, or a ``sym_size``
    node where the size is symbolic (a dynamic batch or block length; a bare SymInt in a node's arguments names a
    symbol the graph's code does not define)."""
    size = val(node).shape[dim]
    if isinstance(size, int):
        return size
    out = graph.call_function(torch.ops.aten.sym_size.int, (node, dim))
    out.meta["val"] = size
    return out


def same_shape(a, b) -> bool:
    """``a == b`` for shapes that may hold symbolic sizes, decided without adding a guard: sizes that are not
    provably equal (for every value their symbols may take) do not match."""
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


class DFlashPass(CustomGraphPass):
    """A graph pass over pre-dispatch ATen. ``uuid()`` hashes the pass's module source, so it changes
    whenever the pass changes (what Inductor's FX graph cache keys on when a pass is registered there)."""

    name: str

    def __call__(self, graph: torch.fx.Graph, region: "Region | None" = None) -> int:
        """Rewrite ``graph`` in place; ``region``: the callers' view when ``graph`` is a region's subgraph."""
        n = self.apply(graph, region)
        if n:
            counters["dflash"][self.name] += n
            stable_topological_sort(graph)  # replacements land at the first matched node; move them after their inputs
            graph.eliminate_dead_code()
        return n

    def apply(self, graph: torch.fx.Graph, region: "Region | None" = None) -> int:
        raise NotImplementedError

    def uuid(self) -> str:
        source = inspect.getsource(inspect.getmodule(type(self)))
        return hashlib.sha256(source.encode()).hexdigest()


class Region:
    """A nested compile region's subgraph as the graph that calls it sees it: the outer node behind each of its
    inputs (where every call passes the same one), and new inputs that bring outer nodes in.

    ``calls``: the ``invoke_subgraph`` nodes that call ``gm`` (``args = (subgraph, identifier, *operands)``, one
    operand per placeholder of ``gm``, in order). A pass that needs what a region's input was made from (the
    target's attention mask is built once outside the decoder layers and enters each layer as an input) follows
    it with ``outer``, and reads outer values inside with ``inner``; ``prune`` then drops the inputs nothing reads
    any more from the subgraph and from every call, so the outer graph can drop what made them."""

    _OPERANDS = 2  # invoke_subgraph's arguments before the operands

    def __init__(self, gm: torch.fx.GraphModule, calls: list[torch.fx.Node]):
        self.gm, self.calls = gm, calls

    def _inputs(self) -> list[torch.fx.Node]:
        return list(self.gm.graph.find_nodes(op="placeholder"))

    def outer(self, node):
        """The outer node every call passes for input ``node``, or None (not an input, or the calls differ)."""
        if not (isinstance(node, torch.fx.Node) and node.op == "placeholder" and node.graph is self.gm.graph):
            return None
        i = self._OPERANDS + self._inputs().index(node)
        passed = {id(call.args[i]): call.args[i] for call in self.calls}
        (only,) = passed.values() if len(passed) == 1 else (None,)
        return only if isinstance(only, torch.fx.Node) else None

    def inner(self, node: torch.fx.Node) -> torch.fx.Node:
        """``node`` as the subgraph reads it: itself if it is the subgraph's, else the input every call passes it
        to, added (at the end, on every call) if there is none yet."""
        if node.graph is self.gm.graph:
            return node
        inputs = self._inputs()
        for i, p in enumerate(inputs):
            if all(call.args[self._OPERANDS + i] is node for call in self.calls):
                return p
        with self.gm.graph.inserting_after(inputs[-1]):
            p = self.gm.graph.placeholder(f"outer_{node.name}")
        p.meta.update({k: node.meta[k] for k in ("val", "tensor_meta") if k in node.meta})
        for call in self.calls:
            call.args = (*call.args, node)
        return p

    def prune(self) -> int:
        """Drop the tensor inputs the subgraph no longer reads (from it and from every call); -> how many."""
        dropped = 0
        for i, p in reversed(list(enumerate(self._inputs()))):
            if p.users or not isinstance(val(p), torch.Tensor):
                continue
            for call in self.calls:
                args = list(call.args)
                del args[self._OPERANDS + i]
                call.args = tuple(args)
            self.gm.graph.erase_node(p)
            dropped += 1
        return dropped
