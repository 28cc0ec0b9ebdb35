"""Recurrent-state target layers over per-request state pools.

Hybrid targets keep, per request and per recurrent layer, states of a fixed size instead of a growing K/V cache: a
convolution window and a recurrent state (Gated DeltaNet in Qwen3.5/3.6 and Qwen3-Next, Mamba in Jamba, Bamba,
Granite 4 or Nemotron-H), a convolution window alone (LFM2's short convolutions), and some layers hold attention K/V
beside them (Falcon-H1 runs attention and Mamba side by side; Zamba's hybrid layers add a shared attention block).
They reach HF's cache through ``LinearAttentionCacheLayerMixin`` (``update_conv_state``,
``update_recurrent_state``); ``PagedStateLayer`` implements that seam over pools with one slot per running request
(``layout.probe_layout`` sizes them from what HF's own cache stores, and finds the module that updates them), and
``PagedHybridLayer`` adds the paged K/V of a layer that has both. So any model written against the seam works,
whatever its layers are called, not a list of families.

Rollback is the hard part. A paged K/V cache rolls back by length, but a recurrent state after the verified block
has absorbed every drafted token, the rejected ones too, and cannot be un-absorbed. So during verify the mixer runs
token by token (``step_by_token`` re-enters the layer's own forward with one token at a time, which is HF's own
decode path) and the layer keeps the state after every block position; after acceptance each row's state after its
accepted tokens and the bonus is picked with a gather at ``num_accepted`` and written to the row's slot. No host
read, static shapes, one graph. The other designs were worse here: re-running the accepted tokens needs a second
target pass, or "neutral" padding tokens that a gated delta rule does not have (every token decays the state); and
the chunked kernel keeps only the final state. The cost is ``block_size`` small recurrent steps per linear layer
instead of one chunked call, and ``block_size`` states per row held during the step.

Prefill runs the layer's ordinary (chunked) path from an empty state; left padding is zeroed by the model itself
through the 2-D mask it receives for ``linear_attention`` layers, so padded rows start from the same zero state.

Rows read their state from ``slot`` and write it back to the same slot; bucket-padding rows read ``ZERO_SLOT`` and
write ``TRASH_SLOT``, as for the K/V pools.
"""

from __future__ import annotations

import functools
import inspect
import weakref

import torch
from torch import nn
from transformers.cache_utils import Cache, LinearAttentionCacheLayerMixin

from ..primitives.slots import TRASH_SLOT, ZERO_SLOT
from .hf_cache import PagedTargetLayer
from .layout import ATTENTION, StateLayout, cache_arg


class StateAccess:
    """One forward's access to the recurrent-state pools: the rows' slots (``[Bk]``), and whether the mixers run
    token by token (verify) or whole (prefill)."""

    def __init__(self, slots: torch.Tensor, active: torch.Tensor, stepped: bool):
        self.read = torch.where(active, slots, ZERO_SLOT)
        self.write = torch.where(active, slots, TRASH_SLOT)
        self.stepped = stepped
        self.layers: list[PagedStateLayer] = []

    def layer(self, pools: dict, write_slots: torch.Tensor, read_slots: torch.Tensor) -> PagedStateLayer:
        """The cache layer over one layer's state pools (and its K/V pool, written at ``write_slots`` and read at
        ``read_slots`` as ``PagedTargetLayer`` does, when the layer caches both)."""
        if ATTENTION in pools:
            layer = PagedHybridLayer(pools, self.read, self.write, self.stepped, write_slots, read_slots)
        else:
            layer = PagedStateLayer(pools, self.read, self.write, self.stepped)
        self.layers.append(layer)
        return layer

    def commit(self, num_accepted: torch.Tensor) -> None:
        """Write every row's state after ``num_accepted + 1`` block tokens to its slot (verify only)."""
        for layer in self.layers:
            layer.commit(num_accepted)


def _split(name: str) -> tuple[str, int]:
    kind = "conv" if name.startswith("conv") else "recurrent"
    return kind, int(name[len(kind):])


class PagedStateLayer(LinearAttentionCacheLayerMixin):
    """One recurrent layer's conv and recurrent states, read from and written to its pools at the rows' slots.

    Prefill (``stepped=False``): no previous state; what the layer stores is written to the pools. Verify
    (``stepped=True``): the rows' states are gathered from the pools, the layer updates them token by token, and
    ``end_token`` keeps a copy after each; ``commit`` writes the accepted one back."""

    is_compileable = True

    def __init__(self, pools: dict[str, torch.Tensor], read: torch.Tensor, write: torch.Tensor, stepped: bool):
        pools = {name: pool for name, pool in pools.items() if name != ATTENTION}
        idxs = sorted({_split(name)[1] for name in pools})
        super().__init__(number_of_states=idxs[-1] + 1)
        self.pools, self.state_write, self.stepped = pools, write, stepped
        self.steps: dict[str, list[torch.Tensor]] = {name: [] for name in pools}
        if stepped:
            for name, pool in pools.items():
                kind, idx = _split(name)
                getattr(self, f"{kind}_states")[idx] = pool[read]  # a gathered copy: in-place updates stay local
                getattr(self, f"is_{kind}_states_initialized")[idx] = True
                if kind == "conv":
                    self.conv_kernel_size[idx] = pool.shape[-1]
                self.has_previous_state[idx] = True

    def lazy_initialization(self, conv_states=None, recurrent_states=None, state_idx: int = 0) -> None:
        pass  # the pools exist before any forward

    def _pool(self, name: str, value: torch.Tensor) -> torch.Tensor:
        pool = self.pools.get(name)
        if pool is None or pool.shape[1:] != value.shape[1:]:
            held = None if pool is None else tuple(pool.shape[1:])
            raise ValueError(f"the target stores {name} of shape {tuple(value.shape[1:])} per request, the pool holds {held}")
        return pool

    def update_conv_state(self, conv_states, state_idx: int = 0, conv_kernel_size: int | None = None, **kwargs):
        # Same contract as HF's LinearAttentionLayer: return the window the convolution needs, keep the last K columns.
        if self.stepped:
            window = self.conv_states[state_idx]
            full = torch.cat([window, conv_states.to(window.dtype)], dim=-1)
            self.conv_states[state_idx] = full[..., -window.shape[-1]:]
            return full
        k = conv_kernel_size or conv_states.shape[-1]
        full = conv_states
        if full.shape[-1] < k:
            full = nn.functional.pad(full, (k - full.shape[-1], 0))
        last = full[..., -k:]
        pool = self._pool(f"conv{state_idx}", last)
        pool[self.state_write] = last.to(pool.dtype)
        return full

    def update_recurrent_state(self, recurrent_states, state_idx: int = 0, **kwargs):
        if self.stepped:
            self.recurrent_states[state_idx] = recurrent_states
            return recurrent_states
        pool = self._pool(f"recurrent{state_idx}", recurrent_states)
        pool[self.state_write] = recurrent_states.to(pool.dtype)
        return recurrent_states

    def end_token(self) -> None:
        """Keep every state as it is after this block position; the next position works on a copy."""
        for name in self.pools:
            kind, idx = _split(name)
            states = getattr(self, f"{kind}_states")
            self.steps[name].append(states[idx])
            states[idx] = states[idx].clone()

    def commit(self, num_accepted: torch.Tensor) -> None:
        rows = torch.arange(num_accepted.shape[0], device=num_accepted.device)
        for name, seq in self.steps.items():
            if not seq:
                raise RuntimeError(f"recurrent state {name} was not stepped during verify")
            chosen = torch.stack(seq, dim=1)[rows, num_accepted]  # [Bk, ...]: after the bonus + accepted drafts
            pool = self.pools[name]
            pool[self.state_write] = chosen.to(pool.dtype)


class PagedHybridLayer(PagedStateLayer, PagedTargetLayer):
    """A layer that caches both: its states as ``PagedStateLayer`` does, its K/V as ``PagedTargetLayer`` does (HF's
    cache tells the two apart by these two base classes)."""

    def __init__(self, pools: dict, read: torch.Tensor, write: torch.Tensor, stepped: bool, kv_write: torch.Tensor,
                 kv_read: torch.Tensor):
        PagedTargetLayer.__init__(self, pools[ATTENTION], kv_write, kv_read)
        PagedStateLayer.__init__(self, pools, read, write, stepped)

    def lazy_initialization(self, *args, **kwargs) -> None:
        pass

    update = PagedTargetLayer.update
    get_mask_sizes = PagedTargetLayer.get_mask_sizes
    get_seq_length = PagedTargetLayer.get_seq_length
    get_max_length = PagedTargetLayer.get_max_length


#: wrappers using each stepped mixer (the stepped ``forward`` is installed with the first, removed with the last)
_STEPPED_USERS: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()


def step_by_token(target: nn.Module, layouts) -> None:
    """Make the token mixer of every recurrent layer (the module that updated its states when the layout was
    probed) run one token at a time when it is handed a stepped ``PagedStateLayer`` (verify), recording the states
    after each token; any other cache (HF's own, prefill) runs the mixer unchanged. An instance-level ``forward``,
    installed once per module and counted per user, so that ``unstep`` by one wrapper leaves it in place for another
    wrapper over the same target."""
    for i, layout in enumerate(layouts):
        if not isinstance(layout, StateLayout):
            continue
        module = target.get_submodule(layout.mixer)
        if module not in _STEPPED_USERS:
            module.forward = _stepped(module.forward, i, cache_arg(module))
            _STEPPED_USERS[module] = 0
        _STEPPED_USERS[module] += 1


def unstep(target: nn.Module) -> None:
    """Undo one ``step_by_token`` on ``target``: the mixers get their own forward back with the last user."""
    for module in target.modules():
        if module in _STEPPED_USERS:
            _STEPPED_USERS[module] -= 1
            if _STEPPED_USERS[module] <= 0:
                del _STEPPED_USERS[module]
                del module.forward  # back to the class's forward


def _stepped(inner, layer_idx: int, cache_arg: str):
    params = list(inspect.signature(inner).parameters)
    hidden_arg, cache_pos = params[0], params.index(cache_arg)

    def forward(*args, **kwargs):
        cache = kwargs[cache_arg] if cache_arg in kwargs else (args[cache_pos] if len(args) > cache_pos else None)
        layer = cache.layers[layer_idx] if isinstance(cache, Cache) and layer_idx < len(cache.layers) else None
        if not (isinstance(layer, PagedStateLayer) and layer.stepped):
            return inner(*args, **kwargs)
        if hidden_arg in kwargs:
            hidden, rest = kwargs.pop(hidden_arg), args
        else:
            hidden, rest = args[0], args[1:]
        outs = []
        for t in range(hidden.shape[1]):
            out = inner(hidden[:, t : t + 1], *rest, **kwargs)
            if not isinstance(out, torch.Tensor):
                raise NotImplementedError(f"the token mixer of layer {layer_idx} returns {type(out).__name__}")
            outs.append(out)
            layer.end_token()
        return torch.cat(outs, dim=1)

    return functools.wraps(inner)(forward)
