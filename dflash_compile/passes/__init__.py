"""FX passes that recognise the DFlash step's hot patterns in pre-dispatch ATen and swap in custom ops.

Each pass bumps ``torch._dynamo.utils.counters["dflash"][<name>]`` once per replacement. See README.md here
for the invariants they keep.
"""

from __future__ import annotations

import copy
import functools
import hashlib

import torch
from torch._dynamo.utils import counters

from ._common import Region, bound_args
from .block_attention import BlockAttentionPass
from .fused_kv import FusedKVProjPass
from .paged_scatter import PagedKVWritePass

PASS_NAMES = ("fused_kv_proj", "paged_kv_write", "block_attention")


@functools.cache
def build_passes():
    """The passes in the order they run: projections, scatters (rewiring later reads to the pool), attention.

    Built on first use (tracing the search patterns takes a moment), never at import."""
    return (FusedKVProjPass(), PagedKVWritePass(), BlockAttentionPass())


def graph_modules(gm: torch.fx.GraphModule) -> list[torch.fx.GraphModule]:
    """``gm`` and the subgraphs it calls (a nested compile region's ``invoke_subgraph`` body, a ``cond`` branch),
    each once however often it is called."""
    return [m for _, m in gm.named_modules(remove_duplicate=True) if isinstance(m, torch.fx.GraphModule)]


def apply_passes(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Run every pass over ``gm`` and its subgraphs in place; returns the replacements per pass (a replacement
    inside a region's subgraph counts once, however many layers call it).

    A region's subgraph is passed first, seen from its calls (``Region``): a pattern may span the region's
    boundary (the target's attention inside a decoder layer reads a mask and read slots made once around the
    layers), and the inputs the rewrite leaves unread are dropped from every call, so the graph around it then
    drops what made them."""
    counts = dict.fromkeys(PASS_NAMES, 0)
    regions, pruned = _regions(gm), 0
    for module in sorted(graph_modules(gm), key=lambda m: m is gm):  # subgraphs first, the calling graph last
        region = regions.get(id(module))
        for p in build_passes():
            counts[p.name] += p(module.graph, region)
        if region is not None:
            pruned += region.prune()
        elif module is gm and pruned:
            gm.graph.eliminate_dead_code()  # what made the inputs the regions dropped
        module.graph.lint()
        module.recompile()
    return counts


def _regions(gm: torch.fx.GraphModule) -> dict[int, Region]:
    """Each subgraph that ``gm`` calls through ``invoke_subgraph`` (by ``id``), with its calls; a subgraph whose
    calls pass different masks or read slots is split first (``_split``)."""
    calls: dict[int, tuple[torch.fx.GraphModule, list]] = {}
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph):
        sub = getattr(gm, node.args[0].target)
        calls.setdefault(id(sub), (sub, []))[1].append(node)
    regions = {}
    for sub, nodes in calls.values():
        for part, part_calls in _split(gm, sub, nodes):
            regions[id(part)] = Region(part, part_calls)
    return regions


def _split(gm: torch.fx.GraphModule, sub: torch.fx.GraphModule, calls: list) -> list[tuple]:
    """``[(subgraph, its calls)]``: ``sub`` for all ``calls``, or, where they pass different tensors to an input that
    is an attention mask or the indices of a gather (layers of one class under different masks: Gemma's sliding and
    full layers trace to one subgraph), a copy of ``sub`` per group of calls that pass the same ones, each with an
    identifier of its own, so the passes can read each group's rule where its inputs were made."""
    inputs = list(sub.graph.find_nodes(op="placeholder"))
    keyed = [i for i, p in enumerate(inputs) if any(_reads_as_rule(user, p) for user in p.users)]
    groups: dict[tuple, list] = {}
    for call in calls:
        groups.setdefault(tuple(id(call.args[Region._OPERANDS + i]) for i in keyed), []).append(call)
    if len(groups) == 1:
        return [(sub, calls)]
    parts = []
    for n, group in enumerate(groups.values()):
        part = sub if n == 0 else copy.deepcopy(sub)
        if n:
            name = f"{group[0].args[0].target}_part{n}"
            gm.register_module(name, part)
            with gm.graph.inserting_before(group[0]):
                attr = gm.graph.get_attr(name)
            for call in group:
                call.args = (attr, f"{call.args[1]}_part{n}", *call.args[2:])
        parts.append((part, group))
    counters["dflash"]["region_splits"] += len(groups) - 1
    return parts


def _reads_as_rule(node: torch.fx.Node, p: torch.fx.Node) -> bool:
    """``node`` reads ``p`` as an attention mask or as gather indices."""
    if node.op != "call_function":
        return False
    if node.target is torch.ops.aten.scaled_dot_product_attention.default:
        return bound_args(node)["attn_mask"] is p
    return node.target is torch.ops.aten.index.Tensor and p in node.args[1]


def passes_uuid() -> str:
    """Changes whenever any pass changes."""
    return hashlib.sha256("".join(p.uuid() for p in build_passes()).encode()).hexdigest()


__all__ = ["PASS_NAMES", "apply_passes", "build_passes", "graph_modules", "passes_uuid"]
