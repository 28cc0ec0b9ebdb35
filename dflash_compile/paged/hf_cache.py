"""The target's view of the pools through transformers' public ``Cache`` seam: one cache layer per decoder layer,
scattering new K/V at their slots and returning each row's dense K/V gathered through its block table."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DummyLayer

class PagedTargetLayer(CacheLayerMixin):
    """One target decoder layer's view of the pool: ``update`` scatters the new K/V at their slots and
    returns each row's dense K/V gathered through the block table (``[B, kv_heads, S, head_dim]``)."""

    is_compileable = True
    is_sliding = False

    def __init__(self, pool, write: torch.Tensor, read: torch.Tensor):
        super().__init__()
        self.pool = pool  # [2, slots, kv_heads, head_dim], or a (K, V) pair of [slots, heads, dim]: this layer's pool
        self.write = write  # [B * T] flat slots
        self.read = read  # [B, S]
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        # key_states/value_states [B, Hkv, T, D] -> rows [B * T, Hkv, D] at self.write
        B, H, T, D = key_states.shape
        if isinstance(self.pool, tuple):  # K and V of different shapes (MLA): a pool each
            for pool, new in zip(self.pool, (key_states, value_states)):
                _check_rows(pool.shape[1:], new)
                pool[self.write] = new.transpose(1, 2).reshape(B * T, *pool.shape[1:])
            return tuple(pool[self.read].transpose(1, 2) for pool in self.pool)
        _check_rows(self.pool.shape[-2:], key_states)
        _check_rows(self.pool.shape[-2:], value_states)
        self.pool[:, self.write] = torch.stack([key_states, value_states]).transpose(2, 3).reshape(2, B * T, H, D)
        return self.pool[0][self.read].transpose(1, 2), self.pool[1][self.read].transpose(1, 2)  # [B, Hkv, S, D]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.read.shape[1], 0

    def get_seq_length(self) -> int:
        return 0  # positions are always passed explicitly

    def get_max_length(self) -> int:
        return self.read.shape[1]


def _check_rows(pool_row, new: torch.Tensor) -> None:
    if tuple(pool_row) != (new.shape[1], new.shape[3]):
        raise ValueError(f"target K/V are [{new.shape[1]}, {new.shape[3]}] per token, the pool holds {tuple(pool_row)}")


class _OneLayerCache(Cache):
    """The cache a decoder layer compiled as a region sees (``runtime/regions.py``): its own pool alone, whatever
    layer index it asks for, so nothing in the region depends on the layer's index."""

    def __init__(self, layer: PagedTargetLayer):
        super().__init__(layers=[layer])

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        return self.layers[0].update(key_states, value_states, *args, **kwargs)

    def get_seq_length(self, layer_idx=0) -> int:
        return self.layers[0].get_seq_length()

    def get_mask_sizes(self, query_length, layer_idx=0):
        return self.layers[0].get_mask_sizes(query_length)


def one_layer_cache(pool, write: torch.Tensor, read: torch.Tensor) -> Cache:
    """A cache of one ``PagedTargetLayer`` over ``pool`` that every layer index maps to."""
    return _OneLayerCache(PagedTargetLayer(pool, write, read))


def paged_target_cache(target_pools, write: torch.Tensor, read: torch.Tensor, states=None) -> Cache:
    """An HF ``Cache`` whose layers read and write ``target_pools`` (one per layer) through slot tensors.

    ``states``: a ``recurrent.StateAccess`` for targets with recurrent layers (their pools are dicts; one holding an
    ``ATTENTION`` pool too makes a layer that is both), else None. A layer without a pool caches nothing."""
    flat = write.reshape(-1)
    layers = []
    for pool in target_pools:
        if pool is None:
            layers.append(DummyLayer())
        elif isinstance(pool, dict):
            if states is None:
                raise ValueError("a target with recurrent layers needs state slots for its step")
            layers.append(states.layer(pool, flat, read))
        else:
            layers.append(PagedTargetLayer(pool, flat, read))
    return Cache(layers=layers)

