"""Regional compilation: every distinct decoder layer of the target, and of the drafter with it, traced and compiled
once.

A decoder stack repeats one layer class ``L`` times (30 times in SmolLM2-135M). Traced inline, the step graph holds
``L`` copies of the layer, and Inductor lowers, generates and builds C++ for each copy. Inside ``compile_regions``
each repeated layer class's ``forward`` is marked as torch's nested compile region
(``torch.compiler.nested_compile_region``): dynamo traces a layer once into an ``invoke_subgraph`` subgraph and
calls that subgraph from every layer with the layer's own parameters and caches as inputs; the DFlash passes and
lowerings run inside the subgraph (``backends.dflash_passes``, ``lower``), and Inductor generates its code once.
Layers whose traced graphs differ (a sliding-window layer among full-attention ones) get a subgraph each. The
drafter's layer class marks its paged method instead (``region_method``: ``DFlashDecoderLayer.paged_forward``, which
gathers the layer's context K/V from its pool inside the region), so the ``block_attention`` pass finds the gather
and the attention in one subgraph.

Each layer hands its region its own pool and slot tensors rather than the whole cache (``_paged_region``), so dynamo
traces the first layer and stamps every other one out of that trace (torch's subgraph reuse: its arguments must be
tensors, constants or the module); handed the cache object, dynamo traced all 30 of SmolLM2's layers and only then
kept one subgraph (dynamo's share of a cold start 20.9 -> 10.8 s).

The mark is a pass-through outside dynamo, and it is set on the classes only while a step is traced (a saved
graph that is loaded is not traced again), then restored.
"""

from __future__ import annotations

import contextlib
import functools
import types

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


#: The attribute ``compile_regions`` sets on each layer of a repeated class while open: the index of that layer's
#: cache entry (its position in the decoder stack), so the layer's call can hand the region its own pool.
CACHE_INDEX = "_dflash_cache_index"


def cache_indices(kinds: list[type], model: nn.Module | None) -> dict[nn.Module, int]:
    """Each layer of ``kinds`` in ``model`` -> the index of its cache entry: its position in its ``nn.ModuleList``.
    A class is left out (its layers take the whole cache, as traced before) where a layer's own ``layer_idx``
    (on it or on a submodule, as HF attention keeps it) says another index, or where its layers sit in more than
    one list."""
    if model is None:
        return {}
    found: dict[nn.Module, int] = {}
    lists: dict[type, set[int]] = {}
    for sub in model.modules():
        if not isinstance(sub, nn.ModuleList):
            continue
        for i, child in enumerate(sub):
            if type(child) in kinds:
                found[child] = i
                lists.setdefault(type(child), set()).add(id(sub))
    wrong = {type(m) for m, i in found.items() if any(
        isinstance(getattr(s, "layer_idx", i), int) and getattr(s, "layer_idx", i) != i for s in m.modules())}
    wrong |= {kind for kind, ids in lists.items() if len(ids) > 1}
    return {m: i for m, i in found.items() if type(m) not in wrong}


def _paged_region(kind: type, forward, layers: int):
    """The region a layer of ``kind`` runs in when its cache entry is a paged pool: it takes the pool and its slot
    tensors instead of the whole cache, so every argument is a tensor, a constant or the module, the kinds dynamo
    can compare between calls, and dynamo traces the first layer and stamps the others out of it (torch's
    subgraph reuse) instead of tracing every layer and keeping one. Inside, a one-layer cache over the pool
    answers the layer's ``update`` whatever index it asks for."""
    from ..paged.hf_cache import one_layer_cache

    def region(self, _pool, _write, _read, _cache_name, *args, **kwargs):
        kwargs[_cache_name] = one_layer_cache(_pool, _write, _read)
        return forward(self, *args, **kwargs)

    # a code object of its own per class: dynamo keys its reuse cache by the region's code
    code = region.__code__.replace(co_name=f"{kind.__name__}_paged_region")
    region = types.FunctionType(code, region.__globals__, code.co_name, region.__defaults__, region.__closure__)
    # a reuse entry per distinct traced layer (a layer with other constants, e.g. a sliding window, is traced again
    # and kept as another entry); torch raises past its limit, so the limit is the class's layer count
    return torch.compiler.nested_compile_region(region, max_reuse_entries=max(layers, 1))


@contextlib.contextmanager
def compile_regions(kinds: list[type], model: nn.Module | None = None):
    """While open, each class in ``kinds`` runs its ``forward`` as a nested compile region (a pass-through in
    eager code); its own ``forward`` (or the inherited one) is back on exit. Given the ``model`` whose layers
    these are, a layer called with a paged cache passes the region its own pool (``_paged_region``)."""
    from transformers.cache_utils import Cache

    from ..paged.hf_cache import PagedTargetLayer

    indices = cache_indices(kinds, model)
    saved = []
    try:
        for module, index in indices.items():
            setattr(module, CACHE_INDEX, index)
        for kind in kinds:
            method = region_method(kind)
            own = vars(kind).get(method, _MISSING)
            forward = getattr(kind, method)
            whole = torch.compiler.nested_compile_region(forward)
            paged = _paged_region(kind, forward, sum(type(m) is kind for m in indices))

            def region_call(self, *args, _whole=whole, _paged=paged, **kwargs):
                index = getattr(self, CACHE_INDEX, None)
                # the cache's keyword: ``cache`` in transformers 5.2x, ``past_key_values`` before
                name = next((name for name, value in kwargs.items() if isinstance(value, Cache)), None)
                layers = kwargs[name].layers if name is not None else ()
                if index is None or index >= len(layers) or not isinstance(layers[index], PagedTargetLayer):
                    return _whole(self, *args, **kwargs)
                entry = layers[index]
                rest = {key: value for key, value in kwargs.items() if key != name}
                return _paged(self, entry.pool, entry.write, entry.read, name, *args, **rest)

            # wraps: the region keeps the method's name, which torch's saved graph uses to find the method again
            setattr(kind, method, functools.wraps(forward)(region_call))
            saved.append((kind, method, own))
        yield
    finally:
        for kind, method, own in reversed(saved):
            if own is _MISSING:
                delattr(kind, method)
            else:
                setattr(kind, method, own)
        for module in indices:
            if CACHE_INDEX in vars(module):
                delattr(module, CACHE_INDEX)


def region_method(kind: type) -> str:
    """The method of ``kind`` marked as the region: ``forward``, or the one the class names in ``region_method``
    (the drafter's layer: ``paged_forward``, which gathers its context K/V from the pool inside the region)."""
    return getattr(kind, "region_method", "forward")
