"""FX passes that recognise the DFlash step's hot patterns in pre-dispatch ATen and swap in custom ops.

Each pass bumps ``torch._dynamo.utils.counters["dflash"][<name>]`` once per replacement. See README.md here
for the invariants they keep.
"""

from __future__ import annotations

import functools
import hashlib

import torch

from ._common import Region
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
    """Each subgraph that ``gm`` calls through ``invoke_subgraph`` (by ``id``), with its calls."""
    calls: dict[int, tuple[torch.fx.GraphModule, list]] = {}
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph):
        sub = getattr(gm, node.args[0].target)
        calls.setdefault(id(sub), (sub, []))[1].append(node)
    return {key: Region(sub, nodes) for key, (sub, nodes) in calls.items()}


def passes_uuid() -> str:
    """Changes whenever any pass changes."""
    return hashlib.sha256("".join(p.uuid() for p in build_passes()).encode()).hexdigest()


__all__ = ["PASS_NAMES", "apply_passes", "build_passes", "graph_modules", "passes_uuid"]
