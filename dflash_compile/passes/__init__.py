"""FX passes that recognise the DFlash step's hot patterns in pre-dispatch ATen and swap in custom ops.

Each pass bumps ``torch._dynamo.utils.counters["dflash"][<name>]`` once per replacement. See README.md here
for the invariants they keep.
"""

from __future__ import annotations

import functools
import hashlib

import torch

from .block_attention import BlockAttentionPass
from .fused_kv import FusedKVProjPass
from .paged_scatter import PagedKVWritePass

PASS_NAMES = ("fused_kv_proj", "paged_kv_write", "block_attention")


@functools.cache
def build_passes():
    """The passes in the order they run: projections, scatters (rewiring later reads to the pool), attention.

    Built on first use (tracing the search patterns takes a moment), never at import."""
    return (FusedKVProjPass(), PagedKVWritePass(), BlockAttentionPass())


def apply_passes(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Run every pass over ``gm`` in place; returns the replacements per pass."""
    counts = {p.name: p(gm.graph) for p in build_passes()}
    gm.graph.lint()
    gm.recompile()
    return counts


def passes_uuid() -> str:
    """Changes whenever any pass changes."""
    return hashlib.sha256("".join(p.uuid() for p in build_passes()).encode()).hexdigest()


__all__ = ["PASS_NAMES", "apply_passes", "build_passes", "passes_uuid"]
