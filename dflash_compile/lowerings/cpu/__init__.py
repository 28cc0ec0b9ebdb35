"""CPU lowerings of the DFlash custom ops: each op as plain ATen that Inductor compiles into C++.

``cpu_lowerings()`` is the table the backends trace into the step graph in place of the ops (see
``lowerings.lower``), so a compiled CPU step runs no Python-implemented op. ``fused_kv_proj`` and
``paged_kv_write`` lower to their references (plain torch already: one linear with a norm/RoPE epilogue, one
``index_put_``); ``block_attention`` to ``block_attention.py``.
"""

from __future__ import annotations


def cpu_lowerings() -> dict:
    """``{op overload: implementation}`` for CPU graphs."""
    import torch

    from .. import ops
    from .block_attention import block_attention

    d = torch.ops.dflash
    return {
        d.fused_kv_proj.default: ops._fused_kv_proj_reference,
        d.paged_kv_write.default: ops._paged_kv_write_reference,
        d.block_attention.default: block_attention,
    }


__all__ = ["cpu_lowerings"]
