"""fp32 linears through oneDNN with prepacked weights, for eager code on x86 CPUs.

torch's CPU ``F.linear`` in fp32 calls MKL. On AMD Zen CPUs MKL takes a slow path: on this 2-core EPYC (one
thread, ``benchmarks``-style median of 10) a 576 -> 1536 projection reaches 47 GFLOPS at 8 rows and 72 at 32, where
oneDNN's ``mkldnn._linear_pointwise`` on a weight reordered once reaches 106 and 168; the 576 -> 49152 vocabulary
projection 21 / 42 against 80 / 135. The results are fp32 with another summation order, so they match MKL's to
rounding, not bit for bit: use this where a result need not equal HF's own to the last bit (data generation),
never to produce output that is checked token for token against ``target.generate``.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@contextlib.contextmanager
def onednn_linears(model: nn.Module, rows_hint: int = 32):
    """Within the block, every fp32 ``nn.Linear`` of ``model`` runs on a oneDNN-packed copy of its weight
    (``rows_hint``: the row count the packing is tuned for; any count works). Weights are read when the block
    starts: do not train inside it. Restored on exit, on every path. Without oneDNN, a no-op."""
    saved = []
    try:
        if onednn_available():
            for m in model.modules():
                if isinstance(m, nn.Linear) and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu":
                    packed = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), rows_hint)
                    bias = None if m.bias is None else m.bias.detach()

                    def forward(x, packed=packed, bias=bias, out=m.out_features):
                        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
                        return y.view(*x.shape[:-1], out)

                    saved.append(m)
                    m.forward = forward
        yield model
    finally:
        for m in saved:
            del m.forward  # back to the class's forward
