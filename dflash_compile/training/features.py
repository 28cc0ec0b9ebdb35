"""The frozen target's features over a whole dataset, computed once and kept on disk.

A drafter step needs the target's hidden states at its ``target_layer_ids`` for every token of a batch. Running
the target inside every step costs far more than the drafter (SmolLM2-135M over a 16-conversation batch: ~1.5
TFLOP a step), and a dataset too large for memory (``TrainConfig.cache_features``) is read many times over, so
``FeatureStore`` runs the target once per row, in batches of similar lengths, and writes ``[tokens, n_ids * H]``
fp16 rows into one memory-mapped file (``features.f16``), with ``done.npy`` marking the finished rows: an
interrupted build resumes where it stopped. The file is keyed by the dataset's tokens, the layer ids and the
target's fingerprint (``meta.json``); another key refuses to reuse it.

fp16 keeps ~3 significant digits, as the drafter's fp16 published weights do; a value past fp16's range is an
error, not an ``inf`` in the data.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import time
from pathlib import Path

import numpy as np
import torch

from ..models.hidden_states import AuxHiddenStates
from .data import DraftDataset


def dataset_digest(data: DraftDataset) -> str:
    h = hashlib.sha256()
    for t, n in zip(data.tokens, data.lengths.tolist()):
        h.update(t[:n].numpy().astype(np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()


class FeatureStore:
    """Row ``i``'s features are ``features[offsets[i] : offsets[i] + lengths[i]]``."""

    def __init__(self, folder, lengths: torch.Tensor, width: int, mode: str = "r"):
        self.folder = Path(folder)
        self.lengths = lengths.to(torch.long)
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.long), self.lengths.cumsum(0)])
        self.width = width
        total = int(self.offsets[-1])
        self.array = np.memmap(self.folder / "features.f16", dtype=np.float16, mode=mode, shape=(total, width))
        self.done = np.load(self.folder / "done.npy") if (self.folder / "done.npy").is_file() else \
            np.zeros(len(self.lengths), dtype=bool)

    @classmethod
    def build(cls, target, data: DraftDataset, layer_ids, folder, target_fingerprint: str = "",
              batch_tokens: int = 8192, progress: bool = True, save_every_s: float = 120.0) -> "FeatureStore":
        """Open the store in ``folder`` for (target, data, layer_ids), computing the rows not done yet."""
        from tqdm import tqdm

        from ..lowerings.cpu.onednn_linear import onednn_linears

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        H = target.config.get_text_config().hidden_size
        width = len(layer_ids) * H
        key = {"dataset": dataset_digest(data), "layer_ids": list(layer_ids), "target": target_fingerprint,
               "width": width, "rows": len(data), "tokens": int(data.lengths.sum())}
        meta = folder / "meta.json"
        if meta.is_file():
            have = json.loads(meta.read_text())
            if have != key:
                raise ValueError(f"{folder} holds features of another dataset, target or layer ids: {have}")
            store = cls(folder, data.lengths, width, mode="r+")
        else:
            for f in ("features.f16", "done.npy"):
                (folder / f).unlink(missing_ok=True)
            meta.write_text(json.dumps(key, indent=1))
            store = cls(folder, data.lengths, width, mode="w+")
        todo = [i for i in torch.argsort(data.lengths, descending=True).tolist() if not store.done[i]]
        if not todo:
            return cls(folder, data.lengths, width)
        aux = AuxHiddenStates(target, layer_ids)
        extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(target.forward).parameters else {}
        device = next(target.parameters()).device
        bar = tqdm(total=int(data.lengths[todo].sum()), desc="target features", unit="tok", unit_scale=True,
                   disable=not progress, mininterval=5)
        last_save = time.time()
        try:
            with torch.no_grad(), onednn_linears(target):
                i = 0
                while i < len(todo):
                    T = int(data.lengths[todo[i]])
                    rows = todo[i:i + max(1, batch_tokens // T)]  # sorted longest first: padding stays small
                    i += len(rows)
                    x = data.tokens[rows, :T].to(device)
                    target(input_ids=x, use_cache=False, **extra)  # right padding: causal, rows never see it
                    feats = aux.read().float().cpu()
                    if not torch.isfinite(feats).all() or feats.abs().max() > 6e4:
                        raise ValueError("a target feature is not finite or outside fp16's range")
                    for r, f in zip(rows, feats):
                        n = int(data.lengths[r])
                        o = int(store.offsets[r])
                        store.array[o:o + n] = f[:n].numpy().astype(np.float16)
                        store.done[r] = True
                    bar.update(sum(int(data.lengths[r]) for r in rows))
                    if time.time() - last_save > save_every_s:
                        store.flush()
                        last_save = time.time()
        finally:
            store.flush()
            bar.close()
            aux.remove()
        return cls(folder, data.lengths, width)

    def flush(self) -> None:
        self.array.flush()
        tmp = self.folder / "done.tmp.npy"
        np.save(tmp, self.done)
        tmp.replace(self.folder / "done.npy")

    def batch(self, idx: torch.Tensor, T: int) -> torch.Tensor:
        """``[len(idx), T, width]`` float32, rows zero-padded past their length."""
        if not self.done[idx.numpy()].all():
            raise RuntimeError("features of some rows were never computed (an interrupted build: run build again)")
        out = torch.zeros(len(idx), T, self.width)
        for j, r in enumerate(idx.tolist()):
            n = min(int(self.lengths[r]), T)
            o = int(self.offsets[r])
            out[j, :n] = torch.from_numpy(np.asarray(self.array[o:o + n], dtype=np.float32))
        return out
