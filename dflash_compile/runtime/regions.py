"""Regional compilation: every distinct decoder layer of the target traced and compiled once (the drafter's few
layers stay inline: its attention pattern spans the pool gather made outside its layers).

A decoder stack repeats one layer class ``L`` times (30 times in SmolLM2-135M). Traced inline, the step graph holds
``L`` copies of the layer, and Inductor lowers, generates and builds C++ for each copy. Inside ``compile_regions``
each repeated layer class's ``forward`` is marked as torch's nested compile region
(``torch.compiler.nested_compile_region``): dynamo traces a layer once into an ``invoke_subgraph`` subgraph and
calls that subgraph from every layer with the layer's own parameters and caches as inputs; the DFlash passes and
lowerings run inside the subgraph (``backends.dflash_passes``, ``lower``), and Inductor generates its code once.
Layers whose traced graphs differ (a sliding-window layer among full-attention ones) get a subgraph each.

The mark is a pass-through outside dynamo, and it is set on the classes only while a step is traced (a saved
graph that is loaded is not traced again), then restored.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

_MISSING = object()
#: ``regions=None`` (the default) compiles a layer class as a region where it repeats this many times: real decoder
#: stacks (16 to 80 layers; SmolLM2-135M's 30: its cold step 114 s inline, 49 s as a region), not the few layers of
#: small targets, whose inline graph compiles in seconds anyway and runs faster (C++ wrapper, the target's
#: attention fused; ``docs/compile.md``).
DEFAULT_MIN_REPEATS = 16


def repeated_layer_types(*modules: nn.Module, min_repeats: int = 2) -> list[type]:
    """The classes that occur at least ``min_repeats`` times in one ``nn.ModuleList`` of ``modules`` (the decoder
    layers), in the order first met."""
    found: dict[type, None] = {}
    for module in modules:
        for sub in module.modules():
            if not isinstance(sub, nn.ModuleList):
                continue
            kinds = [type(child) for child in sub]
            for kind in kinds:
                if kinds.count(kind) >= min_repeats:
                    found.setdefault(kind, None)
    return list(found)


@contextlib.contextmanager
def compile_regions(kinds: list[type]):
    """While open, each class in ``kinds`` runs its ``forward`` as a nested compile region (a pass-through in
    eager code); its own ``forward`` (or the inherited one) is back on exit."""
    saved = []
    try:
        for kind in kinds:
            own = vars(kind).get("forward", _MISSING)
            forward = kind.forward
            # wraps: the region keeps forward's name, which torch's saved graph uses to find the method again
            kind.forward = functools.wraps(forward)(torch.compiler.nested_compile_region(forward))
            saved.append((kind, own))
        yield
    finally:
        for kind, own in reversed(saved):
            if own is _MISSING:
                del kind.forward
            else:
                kind.forward = own
