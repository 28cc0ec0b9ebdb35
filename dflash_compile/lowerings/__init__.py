"""Custom ops (``ops.py``: schema, reference, fake) and their device implementations (``cpu/``, ``triton/``, ``nki/``).

A compiled step does not call the ops as opaque Python functions: the backends trace each op's device
implementation into the graph (``lowering_table``) before Inductor, so Inductor compiles it with the rest of
the step (C++ on CPU, Triton kernels visible through ``wrap_triton`` on CUDA). The ops stay whole in the graph
the passes produce, which is what the graph dumps and counters show.
"""

from __future__ import annotations


def lowering_table(device_type: str) -> dict:
    """``{dflash op overload: traceable implementation}`` for graphs on ``device_type`` ("cpu" or "cuda");
    empty for other devices, whose compilers get the ops themselves."""
    if device_type == "cpu":
        from .cpu import cpu_lowerings

        return cpu_lowerings()
    if device_type == "cuda":
        from .triton import cuda_lowerings

        return cuda_lowerings()
    return {}


__all__ = ["lowering_table"]
