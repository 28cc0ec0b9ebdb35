"""What each target layer caches, read off the target itself: ``probe_layout`` and the layout types.

An attention layer caches K and V per token (``AttentionLayout``); a recurrent layer (linear attention, Mamba, short
convolution) named states per request (``StateLayout``), with K/V beside them when the same layer also attends; a
layer that caches nothing (MLP only) None. The pools (``pools.py``) are sized from this.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import CacheLayerMixin, DynamicCache, LinearAttentionCacheLayerMixin

from ..models.hidden_states import decoder_layers

_CACHE_ARGS = ("cache", "cache_params", "past_key_values")

@dataclass(frozen=True)
class AttentionLayout:
    """What one attention layer caches per token: K and V as ``(heads, head_dim)`` each."""

    key: tuple[int, int]
    value: tuple[int, int]
    dtype: torch.dtype


@dataclass(frozen=True)
class StateLayout:
    """What one recurrent layer caches per request: named states (``conv0``, ``recurrent0``, ...) and their shapes;
    ``attention``: what it also caches per token when the same layer holds attention K/V beside its states (an SSM
    and attention side by side, or a shared attention block in a Mamba layer); ``mixer``: the module, under the
    target, that updated the states (the one ``recurrent.step_by_token`` runs token by token)."""

    states: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]
    mixer: str
    attention: AttentionLayout | None = None


#: the key of a layer's attention pool inside its state pools (a layer caching both)
ATTENTION = "attention"


def probe_layout(target: torch.nn.Module) -> list[AttentionLayout | StateLayout | None]:
    """Per decoder layer, what the target caches: one forward of one token through HF's own ``DynamicCache``, whose
    layers are read back: attention K/V shapes, conv and recurrent state shapes, both for a layer that holds both,
    None for a layer that caches nothing (an MLP-only layer). Generic over families: whatever the model's attention
    or mixer stores through HF's cache seams is what the pools are sized for, whatever the layers are called. The
    module that updates each layer's states is found on the way (forward hooks around every module of the target
    whose forward takes a cache)."""
    cache = DynamicCache(config=target.config)
    param = next(target.parameters())
    stack: list[str] = []
    mixers: dict[int, set[str]] = {}
    hooks = []
    for name, module, _ in cache_taking_modules(target):
        hooks.append(module.register_forward_pre_hook(lambda m, a, name=name: stack.append(name)))
        hooks.append(module.register_forward_hook(lambda m, a, o: stack.pop() and None))  # None: output unchanged

    def recording(i, update):
        def wrapped(*args, **kwargs):
            if stack:
                mixers.setdefault(i, set()).add(stack[-1])
            return update(*args, **kwargs)
        return wrapped

    for i, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            for method in ("update_conv_state", "update_recurrent_state"):
                setattr(layer, method, recording(i, getattr(layer, method)))
    try:
        with torch.no_grad():
            target(input_ids=torch.zeros(1, 1, dtype=torch.long, device=param.device), cache=cache, use_cache=True)
    except (RuntimeError, ValueError, TypeError, IndexError) as e:  # its own forward, HF's own cache: not ours
        raise ValueError(f"the target's own forward fails on one token with transformers' DynamicCache "
                         f"({type(e).__name__}: {e}): it does not run over transformers' generic cache as configured "
                         f"(its own generate may use a cache class of its own, or fail too)") from e
    finally:
        for hook in hooks:
            hook.remove()
    layouts = []
    for i, layer in enumerate(cache.layers):
        keys = getattr(layer, "keys", None) if isinstance(layer, CacheLayerMixin) else None
        attention = None
        if keys is not None:
            values = layer.values
            attention = AttentionLayout(tuple(keys.shape[1:2]) + tuple(keys.shape[3:]),
                                        tuple(values.shape[1:2]) + tuple(values.shape[3:]), keys.dtype)
        states = []
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            states = [(f"{kind}{idx}", tuple(t.shape[1:]), t.dtype)
                      for kind, table in (("conv", layer.conv_states), ("recurrent", layer.recurrent_states))
                      for idx, t in sorted(table.items()) if t is not None]
        if not states:
            layouts.append(attention)  # None: the layer caches nothing
            continue
        found = sorted(mixers.get(i, ()))
        if len(found) != 1:
            raise NotImplementedError(
                f"target layer {i} ({type(layer).__name__}) stores recurrent states, updated from "
                f"{found or 'no module whose forward takes a cache'}; expected exactly one token mixer")
        layouts.append(StateLayout(tuple(states), found[0], attention))
    return layouts


def cache_arg(module: nn.Module) -> str | None:
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):  # a forward Python cannot introspect (a builtin): it takes no cache of ours
        return None
    return next((name for name in _CACHE_ARGS if name in params), None)


def cache_taking_modules(target: nn.Module):
    """``(qualified name, module, cache argument)`` of every module under ``target``'s decoder layers (the layers
    included) whose forward takes a cache."""
    layers = set(map(id, decoder_layers(target)))
    inside = set()
    for name, module in target.named_modules():
        if id(module) in layers or any(name.startswith(prefix) for prefix in inside):
            if id(module) in layers:
                inside.add(name + ".")
            arg = cache_arg(module)
            if arg is not None:
                yield name, module, arg
