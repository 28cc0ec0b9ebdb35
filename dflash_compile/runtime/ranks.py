"""How the scheduler's host decisions are made: by this process alone (``SingleProcess``), or agreed with the other
ranks of a tensor-parallel target so that every rank runs the same batch in lockstep (``Lockstep``; see
``distributed.py``). One interface; the scheduler asks it at each point a rank's view could differ."""

from __future__ import annotations

import dataclasses

import torch

from .distributed import TensorParallel, digest


class SingleProcess:
    """Every decision is this process's own."""

    def admission(self, scheduler) -> tuple[int | None, int | None, bool]:
        """``(requests to admit or None for as many as fit, a seed for unseeded sampled requests or None, whether
        some rank has work)``, at the top of a driver iteration."""
        return None, None, False

    def may_stop(self, admit: int | None, busy: bool, waiting: int) -> bool:
        """Whether the driver may stop when this process has nothing running and nothing joining."""
        return True

    def agree_on(self, incoming: list, seed: int | None) -> None:
        """The joining requests are the same everywhere (and seeded alike)."""

    def plan(self, plan):
        """The speculation policy's choice for this step, as every rank runs it."""
        return plan

    def drops_joining_cancelled(self) -> bool:
        return True

    def cancelled(self, request) -> bool:
        return request.cancelled

    def leaves_later(self, request) -> bool:
        """Whether ``request``, which failed here only (its streamer raised), must stay until the ranks agree."""
        return False


class Lockstep(SingleProcess):
    """Tensor-parallel ranks in lockstep: one all-gather of a few integers per driver iteration (admission, cancels,
    rank 0's seed), one per step (rank 0's ``K``), and a digest of every joining request."""

    def __init__(self, tp: TensorParallel, max_batch_size: int):
        self.tp, self.max_batch_size = tp, max_batch_size

    def admission(self, scheduler) -> tuple[int | None, int | None, bool]:
        """Agree on how many queued requests join (as many as every rank has), which running rows are cancelled
        (any rank's cancel) and, as rank 0 draws it, a seed for joining requests that sample without one."""
        tp = self.tp
        with scheduler._lock:
            running = scheduler.batch.rows if scheduler.batch is not None else []
            free = self.max_batch_size - len(running)
            queued = len(scheduler._waiting)
            unseeded = any(r.args.do_sample and r.generator is None for r in scheduler._waiting)
        flags = [int(r.cancelled) for r in running] + [0] * (self.max_batch_size - len(running))
        # from rank 0's global RNG, as an unseeded request's seed is in one process; drawn only when one is queued
        seed = int(torch.randint(0, 2**62, (1,)).item()) if tp.rank == 0 and unseeded else 0
        ranks = tp.gather([min(free, queued), int(bool(queued or running)), seed] + flags)
        for i, r in enumerate(running):
            r.cancel_agreed = any(v[3 + i] for v in ranks)
        busy = any(v[1] for v in ranks)
        return min(v[0] for v in ranks), (ranks[0][2] if busy else None), busy

    def may_stop(self, admit: int | None, busy: bool, waiting: int) -> bool:
        return admit == 0 and not busy and not waiting  # every rank stops at the same iteration

    def agree_on(self, incoming: list, seed: int | None) -> None:
        """Check that every rank admits the same requests (a digest of each), and seed the ones that sample without
        a seed from rank 0's ``seed``."""
        if not incoming:
            return
        for j, r in enumerate(incoming):
            if r.args.do_sample and r.generator is None:
                r.generator = torch.Generator().manual_seed((seed + j) % 2**62)
        ranks = self.tp.gather([_digest(r) for r in incoming])
        odd = [k for k, v in enumerate(ranks) if v != ranks[0]]
        if odd:
            raise RuntimeError(
                f"tensor-parallel ranks {odd} were given different requests than rank 0 (prompt, generation "
                f"arguments or seed of the {len(incoming)} joining now): every rank must submit the same requests "
                f"in the same order")

    def plan(self, plan):
        k, propose = self.tp.gather([plan.k, int(plan.propose)])[0]  # each rank times its own steps: rank 0's
        return dataclasses.replace(plan, k=k, propose=bool(propose))

    def drops_joining_cancelled(self) -> bool:
        return False  # the ranks drop the rows they agreed on; joining ones at the next agreement

    def cancelled(self, request) -> bool:
        return request.cancel_agreed

    def leaves_later(self, request) -> bool:
        return request.error is not None and request.finish_reason is None


def ranks_for(tp: TensorParallel | None, max_batch_size: int) -> SingleProcess:
    return SingleProcess() if tp is None else Lockstep(tp, max_batch_size)


def _digest(r) -> int:
    """What must be the same for one request on every rank: its prompt, generation arguments and seed."""
    a = r.args
    return digest(repr((r.prompt, a.max_new_tokens, a.do_sample, a.temperature, a.top_k, a.top_p,
                        sorted(a.eos_token_ids), a.stop_strings, r.sampling_seed() if r.generator else None)))
