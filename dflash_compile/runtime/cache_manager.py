"""The wrapper's pools: what the target caches and how its masks read (a ``TargetPlan``, made once per device and
dtype), and the paged pools sized, checked against the memory allowed, grown and released.

A plan is made the first time pools are needed on a device and dtype: the target's layers are probed
(``paged.layout.probe_layout``), the step learns what each mask the target reads is (``target_check.mask_plan``), the
recurrent mixers are set to run token by token in verify (``paged.recurrent.step_by_token``, undone by ``release``),
and the target over small scratch pools is checked to give its own logits (``target_check.check_paged_forward``),
before the real pools exist. A compiled wrapper records a passed check in its compile-cache folder (whose fingerprint
holds the versions, this package's sources, both models' configs and parameter shapes, the device and dtype: what the
check depends on), and a later process with that folder skips it (~1.2 s for SmolLM2-135M on a CPU).
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass

import torch

from ..paged.layout import StateLayout, probe_layout
from ..paged.pools import PagedKVCache, available_memory
from ..paged.recurrent import step_by_token, unstep
from ..primitives.slots import pages
from .target_check import check_paged_forward, mask_plan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TargetPlan:
    """What the target caches on one device and dtype: per decoder layer (``layout``), and which layers keep
    recurrent states (``stateful``)."""

    device: torch.device
    dtype: torch.dtype
    layout: tuple
    stateful: tuple[int, ...]


class CacheManager:
    """Pools for one wrapper's ``step`` (a ``DFlashStep``), ``max_batch_size`` requests of ``max_seq_len`` tokens at
    most, within ``max_cache_bytes`` (default: the memory available). ``busy()`` says whether requests are running
    (the pools then may grow but not move)."""

    def __init__(self, step, *, max_batch_size: int, max_seq_len: int, page_size: int, max_cache_bytes: int | None,
                 prefix_caching: bool, busy):
        self.step = step
        self.max_batch_size, self.max_seq_len, self.page_size = max_batch_size, max_seq_len, page_size
        self.max_cache_bytes = max_cache_bytes
        self.prefix_caching = prefix_caching
        self.busy = busy
        self.plan: TargetPlan | None = None
        self.cache: PagedKVCache | None = None
        self._stepping = False  # the recurrent mixers run token by token (until release)
        # the scheduler's thread and a caller readying graphs (``CompiledSteps.ready``) may both ask for the pools
        # first: one makes them (and checks the target over them), the other gets them
        self._making = threading.RLock()
        # set by ``compile()``: where a passed paged-forward check is recorded (a file in the compile cache's folder,
        # whose fingerprint holds everything the check depends on), or None
        self.check_record = None

    @property
    def capacity_blocks(self) -> int:
        return self.max_batch_size * pages(self.max_seq_len, self.page_size)

    def pools(self, num_blocks: int | None = None) -> PagedKVCache:
        """The paged pools with at least ``num_blocks`` KV blocks (default: the capacity), on the target's device
        and dtype; grown in place, every block's contents kept, when more are needed while requests run."""
        with self._making:
            return self._pools(num_blocks)

    def _pools(self, num_blocks: int | None) -> PagedKVCache:
        p = next(self.step.target.parameters())
        num_blocks = num_blocks or self.capacity_blocks
        c = self.cache
        fits = c is not None and c.device == p.device and c.draft_pool.dtype == p.dtype
        if fits and c.num_blocks >= num_blocks:
            return c
        if c is not None and not fits and self.busy():
            raise RuntimeError("the target moved to another device or dtype while requests are running")
        make = self._factory(p.device, p.dtype, num_blocks)
        need = make(device="meta").nbytes  # sized on the meta device: nothing allocated yet
        if fits:  # more requests in flight: grow, keeping every running request's blocks
            self._check_bytes(need, num_blocks, p.device)
            c.grow(num_blocks)
            return c
        self.cache = None  # the old pools go first: the new ones are checked against the memory left
        self._check_bytes(need, num_blocks, p.device)
        self.cache = make(device=p.device)
        return self.cache

    def for_requests(self, live, at_capacity: bool, verify_len: int) -> PagedKVCache:
        """The pools with room for every request in ``live`` (each prompt + ``max_new_tokens`` + a verify block,
        capped at ``max_seq_len``); at capacity when ``at_capacity`` (compiled: the graphs are static in the pools'
        shapes) or with prefix caching (room for the pages no request holds)."""
        if at_capacity or self.prefix_caching:
            return self.pools()
        need = sum(pages(min(self.max_seq_len, len(r.prompt) + r.args.max_new_tokens + verify_len), self.page_size)
                   for r in live)
        return self.pools(need)

    def _factory(self, device, dtype, num_blocks: int):
        """``PagedKVCache`` with this target's plan (made first if needed) and ``num_blocks``; the other keywords
        (``device``, and ``max_batch_size``/``num_blocks`` for scratch pools) given when called."""
        plan = self.plan if self.plan is not None and (self.plan.device, self.plan.dtype) == (device, dtype) else None
        if plan is None:
            plan = self._make_plan(device, dtype)
        draft = self.step.draft
        return functools.partial(
            PagedKVCache, prefix_caching=self.prefix_caching and not plan.stateful,
            max_batch_size=self.max_batch_size, max_seq_len=self.max_seq_len, page_size=self.page_size,
            target_layout=plan.layout, draft_shape=(draft.config.num_hidden_layers, draft.num_kv_heads,
                                                    draft.config.head_dim),
            dtype=dtype, num_blocks=num_blocks)

    def _make_plan(self, device, dtype) -> TargetPlan:
        target = self.step.target
        layout = tuple(probe_layout(target))
        stateful = tuple(i for i, lay in enumerate(layout) if isinstance(lay, StateLayout))
        self.step.mask_plan = mask_plan(target.config.get_text_config(), layout)
        if not self._stepping:  # recurrent mixers run token by token in verify (recurrent.py)
            step_by_token(target, layout)
            self._stepping = True
        if self.prefix_caching and stateful:
            log.warning("prefix caching is off: target layers %s keep recurrent states, which are not kept at page "
                        "boundaries, so a cached prefix could not be resumed", list(stateful))
        plan = TargetPlan(device, dtype, layout, stateful)
        self.plan = plan  # the check below builds its scratch pools from it
        record = self.check_record() if self.check_record is not None else None
        if record is not None and record.exists():
            log.info("dflash: the target's paged forward was checked for this fingerprint (%s)", record)
            return plan
        try:
            check_paged_forward(self.step, functools.partial(self._factory(device, dtype, 1), device=device))
        except BaseException:
            self.plan = None
            raise
        if record is not None:
            _write_record(record, device, dtype)
        return plan

    def _check_bytes(self, need: int, num_blocks: int, device) -> None:
        allowed = self.max_cache_bytes if self.max_cache_bytes is not None else available_memory(device)
        if allowed is not None and need > allowed:
            raise ValueError(
                f"the KV pools need {need} bytes ({num_blocks} blocks of {self.page_size} tokens), more than "
                + (f"max_cache_bytes={allowed}" if self.max_cache_bytes is not None
                   else f"the {allowed} bytes available on {device}")
                + ": fewer or shorter concurrent requests (max_batch_size, max_seq_len, max_new_tokens) need less"
            )

    def prefix_cache_stats(self) -> dict:
        """Prefix caching's counters: ``queries`` (prompts looked up), ``query_tokens``, ``hit_tokens`` (prompt
        tokens whose K/V were reused rather than prefilled), ``evicted_blocks``, and ``cached_blocks`` now."""
        c = self.cache
        if c is None:
            return {"queries": 0, "query_tokens": 0, "hit_tokens": 0, "evicted_blocks": 0, "cached_blocks": 0}
        return {**{k: c.prefix_stats[k] for k in ("queries", "query_tokens", "hit_tokens", "evicted_blocks")},
                "cached_blocks": c.num_cached_blocks}

    @property
    def nbytes(self) -> int:
        """Bytes the KV pools hold now (0 before any are made)."""
        return self.cache.nbytes if self.cache is not None else 0

    def release(self) -> None:
        """Drop the pools and give the recurrent mixers their own forward back (idempotent)."""
        if self._stepping:
            unstep(self.step.target)
            self._stepping = False
        self.cache = None


def _write_record(path, device, dtype) -> None:
    """Record that the paged-forward check passed (a later process with the same compile-cache folder skips it)."""
    import json
    import time

    from torch._dynamo.aot_compile import atomic_write_binary

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_binary(str(path), json.dumps({"passed": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                                   "device": str(device), "dtype": str(dtype)}).encode())
    except OSError as e:  # an unwritable cache: the check runs again next time, said by the graphs' own warning
        log.debug("dflash: cannot record the paged-forward check at %s (%s)", path, e)
