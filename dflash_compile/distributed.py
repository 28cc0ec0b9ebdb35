"""Tensor-parallel targets over torch.distributed: every rank runs the same wrapper and scheduler in lockstep (SPMD).

A target loaded with ``from_pretrained(..., tp_plan="auto")`` (or split by any DTensor tensor-parallel plan) holds
DTensor parameters on a 1-D device mesh. ``TensorParallel.of(target)`` finds that mesh; the wrapper then keeps its
ranks in step where their host decisions could differ:

- which queued requests join the batch (as many as every rank has queued, in submission order), which running ones
  are cancelled (a cancel on any rank cancels on all), and when the driver stops (no rank has work);
- the speculation policy's choice for each step (rank 0's: each rank times its own steps);
- the seed of each request that samples without one (rank 0 draws it), so every rank draws the same uniforms.

Each is one small all-gather of integers on the host per scheduler iteration (``Scheduler._sync``), on a gloo
group of its own. Ranks that were given different requests are detected from a digest of each admitted request and
fail with an error naming the ranks.

Faults: collectives time out after ``DFLASH_TP_TIMEOUT`` seconds (default 60): the scheduler's own group is created
with it, and ``init_distributed`` gives it to the process group it creates (the target's collectives). A rank that
raises or dies makes the others fail within that time with the collective's error, never hang forever. A request
that fails on one rank only (its streamer raised) is cancelled on the others at the next step.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import struct
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 60.0


def collective_timeout() -> datetime.timedelta:
    """The collective timeout ``init_distributed`` gives the process group: ``$DFLASH_TP_TIMEOUT`` seconds (60)."""
    raw = os.environ.get("DFLASH_TP_TIMEOUT", str(DEFAULT_TIMEOUT_S))
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"DFLASH_TP_TIMEOUT={raw!r} is not a number of seconds") from None
    if seconds <= 0:
        raise ValueError(f"DFLASH_TP_TIMEOUT must be positive, got {seconds}")
    return datetime.timedelta(seconds=seconds)


def init_distributed(backend: str | None = None, timeout: datetime.timedelta | None = None) -> tuple[int, int]:
    """Create the default process group from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...),
    with ``timeout`` (default :func:`collective_timeout`) for every collective, unless one exists. ``backend``:
    ``"gloo"`` on CPU (the default without CUDA), ``"nccl"`` with CUDA. Call it before ``from_pretrained(...,
    tp_plan="auto")``, which would otherwise create the group with torch's default timeout (30 minutes for gloo).
    Returns ``(rank, world_size)``."""
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed")
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(f"no process group and no torchrun environment ({', '.join(missing)} unset): launch "
                               f"with `torchrun --nproc-per-node N ...`")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timeout or collective_timeout())
    return dist.get_rank(), dist.get_world_size()


@dataclass(frozen=True)
class TensorParallel:
    """The 1-D device mesh a tensor-parallel target is split over, and this process's place in it."""

    mesh: object  # torch.distributed.device_mesh.DeviceMesh
    group: object  # its ProcessGroup (the target's collectives)
    host: object  # a gloo group over the same ranks, for the scheduler's host agreements (``gather``)
    rank: int
    world: int

    @classmethod
    def of(cls, module: torch.nn.Module) -> "TensorParallel | None":
        """The mesh ``module``'s DTensor parameters live on; None when it has none (one process, no split)."""
        from torch.distributed.tensor import DTensor

        meshes = {id(p.device_mesh): p.device_mesh for p in module.parameters() if isinstance(p, DTensor)}
        if not meshes:
            return None
        if len(meshes) > 1:
            raise ValueError(f"the target's DTensor parameters live on {len(meshes)} device meshes: one "
                             f"tensor-parallel mesh is supported")
        mesh = next(iter(meshes.values()))
        if mesh.ndim != 1:
            raise ValueError(f"the target is split over a {mesh.ndim}-D device mesh: only a 1-D tensor-parallel mesh "
                             f"is supported")
        group = mesh.get_group()
        # The driver thread agrees with the other ranks after the last step of a batch too, while the caller's
        # thread may already run collectives of its own on the target's group: a group of its own keeps the two
        # sequences apart (collectives on one group must come in the same order on every rank).
        host = dist.new_group(dist.get_process_group_ranks(group), backend="gloo", timeout=collective_timeout())
        return cls(mesh, group, host, dist.get_rank(group), dist.get_world_size(group))

    def gather(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (the same length on every rank), on every rank."""
        mine = torch.tensor(values, dtype=torch.int64)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(out, mine, group=self.host)
        return [t.tolist() for t in out]

    def check_same(self, what: str, text: str) -> None:
        """Raise ``ValueError`` on every rank when ranks hold a different ``text`` for ``what``."""
        ranks = self.gather([digest(text)])
        odd = [r for r, (d,) in enumerate(ranks) if d != ranks[0][0]]
        if odd:
            raise ValueError(f"ranks {odd} hold a different {what} than rank 0: every rank must build the same "
                             f"wrapper (the same target, drafter and arguments)")


def digest(text: str) -> int:
    """A signed 64-bit digest of ``text``."""
    return struct.unpack("<q", hashlib.sha256(text.encode()).digest()[:8])[0]
