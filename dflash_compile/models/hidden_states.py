"""Auxiliary hidden states of any HF decoder, through forward hooks on its decoder layers.

Index convention: layer id ``i`` means HF ``output_hidden_states[i + 1]``, the output of decoder layer ``i``.
HF takes the last entry after the final norm, so the last layer's id reads the decoder's (normed) output.
"""

from __future__ import annotations

import torch
from torch import nn


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder-layer list of an HF causal LM, found from the model rather than a per-family table."""
    cfg = model.config.get_text_config()
    n = cfg.num_hidden_layers
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) == n:
        return layers
    found = [m for m in decoder.modules() if isinstance(m, nn.ModuleList) and len(m) == n]
    if len(found) != 1:
        raise ValueError(
            f"cannot find the decoder layers of {type(model).__name__}: expected exactly one ModuleList of "
            f"{n} layers under {type(decoder).__name__}, found {len(found)}"
        )
    return found[0]


def _first(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return out[0]
    if hasattr(out, "last_hidden_state"):
        return out.last_hidden_state
    raise TypeError(f"cannot read a hidden state from a module output of type {type(out).__name__}")


class AuxHiddenStates:
    """Forward hooks that record the hidden states named by ``layer_ids`` on every target forward.

    ``read()`` returns them concatenated on the feature dim, ``[B, T, len(layer_ids) * H]``, in the order
    of ``layer_ids``, for the most recent forward, and forgets them. ``remove()`` detaches the hooks. While
    ``enabled`` is False the hooks record nothing: an owner that switches them on around its own forwards only
    keeps no hidden states of anyone else's (a plain ``model.generate``).
    """

    def __init__(self, model: nn.Module, layer_ids, enabled: bool = True):
        self.layer_ids = tuple(layer_ids)
        self.enabled = enabled
        layers = decoder_layers(model)
        n = len(layers)
        bad = [i for i in self.layer_ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"target_layer_ids {bad} are outside the target's {n} decoder layers [0, {n})")
        self._store: dict[int, torch.Tensor] = {}
        self._handles = []
        for i in sorted(set(self.layer_ids)):
            if i == n - 1:  # HF's last hidden state is the final-normed decoder output
                module = model.get_decoder() if hasattr(model, "get_decoder") else model
            else:
                module = layers[i]
            self._handles.append(module.register_forward_hook(self._hook(i)))

    def _hook(self, i):
        def hook(module, args, out):
            if self.enabled:
                self._store[i] = _first(out)

        return hook

    def recording(self, forward, **kwargs):
        """``forward(**kwargs)`` with the hooks recording, and off again afterwards on every path (a forward that
        raises leaves them off: nothing of the user's own later forwards is kept)."""
        self.enabled, done = True, False
        try:
            out, done = forward(**kwargs), True
            return out
        finally:
            self.enabled = False
            if not done:  # what the failed forward recorded is nobody's
                self._store.clear()

    def read(self) -> torch.Tensor:
        missing = [i for i in self.layer_ids if i not in self._store]
        if missing:
            raise RuntimeError(f"no hidden states recorded for target layers {missing}; run the target first")
        out = torch.cat([self._store[i] for i in self.layer_ids], dim=-1)
        self._store.clear()
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._store.clear()
