"""Tensor-parallel targets over torch.distributed: every rank runs the same wrapper and scheduler in lockstep (SPMD).

A target loaded with ``from_pretrained(..., tp_plan="auto")`` (or split by any DTensor tensor-parallel plan) holds
DTensor parameters on a 1-D device mesh. ``TensorParallel.of(target)`` finds that mesh; the wrapper then keeps its
ranks in step where their host decisions could differ:

- which queued requests join the batch (as many as every rank has queued, in submission order), which running ones
  are cancelled (a cancel on any rank cancels on all), and when the driver stops (no rank has work);
- the speculation policy's choice for each step (rank 0's: each rank times its own steps);
- the seed of each request that samples without one (rank 0 draws it), so every rank draws the same noise.

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
import json
import logging
import os
import struct
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger(__name__)

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


# ------------------------------------------------------------------ collectives in compiled step graphs
# A tensor-parallel step graph holds functional collectives: ``y = all_reduce(x)`` ... ``wait_tensor(y)``. Inductor
# lowers each to an in-place collective on a buffer that completes at the wait, and on torch 2.13 it scheduled reads
# of such a buffer before its wait: with ``reorder_for_locality`` (a kernel read a partial sum, see
# ``backends.COLLECTIVE_INDUCTOR_OPTIONS``) and, without it, at batch 16 on a 166 M Qwen3 over two gloo ranks (the
# 8-token verify's tokens diverged from the eager step's within 1 to 6 tokens on every row; batch 1 and smaller
# models were exact). ``waited_collectives`` fuses each collective with its wait into one opaque op that returns a
# new tensor, so nothing can read the result before the collective completes. What it gives up is overlapping a
# collective with unrelated compute, which a step has little of (each layer needs its all-reduce's result next).

@torch.library.custom_op("dflash::all_reduce_waited", mutates_args=())
def all_reduce_waited(x: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    out = torch.ops._c10d_functional.all_reduce(x, reduce_op, group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


@all_reduce_waited.register_fake
def _(x, reduce_op, group_name):
    return torch.empty_like(x)


@torch.library.custom_op("dflash::all_gather_into_tensor_waited", mutates_args=())
def all_gather_into_tensor_waited(x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    out = torch.ops._c10d_functional.all_gather_into_tensor(x, group_size, group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


@all_gather_into_tensor_waited.register_fake
def _(x, group_size, group_name):
    return x.new_empty((x.shape[0] * group_size, *x.shape[1:]))


_WAITED = {
    torch.ops._c10d_functional.all_reduce.default: torch.ops.dflash.all_reduce_waited.default,
    torch.ops._c10d_functional.all_gather_into_tensor.default: torch.ops.dflash.all_gather_into_tensor_waited.default,
}


def waited_collectives(gm: torch.fx.GraphModule) -> int:
    """Replace, in place, every functional all-reduce / all-gather of ``gm`` and its ``wait_tensor`` by one
    ``dflash.*_waited`` op; -> how many. Any other functional collective is an error (not lowered safely)."""
    wait = torch.ops._c10d_functional.wait_tensor.default
    done = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target.namespace != "_c10d_functional" or node.target == wait:
            continue
        waited = _WAITED.get(node.target)
        if waited is None:
            raise NotImplementedError(f"dflash: the step graph holds {node.target}, a collective this backend does "
                                      f"not compile (all-reduce and all-gather only)")
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(waited, node.args, node.kwargs)
        new.meta = dict(node.meta)
        for user in list(node.users):
            if user.op == "call_function" and user.target == wait:
                user.replace_all_uses_with(new)
                gm.graph.erase_node(user)
            else:  # read before its wait in the traced program: keep that read on the waited result too
                user.replace_input_with(node, new)
        gm.graph.erase_node(node)
        done += 1
    gm.recompile()
    return done


def split_drafter(draft, tp: TensorParallel) -> None:
    """Split the drafter over the target's ranks (heads and MLP, ``DFlashDraftModel.split``), or keep it whole
    on every rank where its sizes do not divide (said in the log)."""
    if draft.split_over == (tp.rank, tp.world):
        return
    if draft.split_over is not None:
        raise ValueError(f"the drafter is split over {draft.split_over[1]} ranks, the target over {tp.world}")
    reason = draft.split_reason(tp.world)
    if reason:
        log.warning("dflash: the drafter is replicated on each of the %d ranks (%s)", tp.world, reason)
        return
    draft.split(tp.rank, tp.world, tp.group)


def rank_identity(spec) -> str:
    """What must be the same on every rank of a tensor-parallel target: both configs, the drafter's weights (a
    checksum), the wrapper's geometry and the speculation policy's ``K`` set."""
    from ..models.draft_model import SPLIT_WEIGHTS

    split = spec.draft.split_over is not None  # already split by another wrapper: each rank holds its share
    with torch.no_grad():
        weights = [round(float(p.double().sum()), 6) for name, p in spec.draft.named_parameters()
                   if type(p) in (nn.Parameter, torch.Tensor) and not (split and name.endswith(SPLIT_WEIGHTS))]
    return json.dumps([spec.target.config.get_text_config().to_json_string(), spec.draft.config.to_json_string(),
                       repr(spec.draft.dflash_config), weights, spec.draft.split_over and spec.draft.split_over[1],
                       spec.max_batch_size, spec.max_seq_len, spec.page_size, spec.batch_buckets,
                       spec.context_buckets, list(spec.speculative_ks), type(spec.policy).__name__])
