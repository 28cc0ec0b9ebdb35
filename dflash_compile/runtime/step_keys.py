"""Step keys: which sizes tell one compiled step graph from another, and how a graph is traced to serve the sizes a
key leaves open (``docs/compile.md``, "One graph per key")."""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..primitives.slots import pages
from .regions import DEFAULT_MIN_REPEATS, repeated_layer_types


@dataclasses.dataclass(frozen=True)
class StepKey:
    """What tells one step graph from another: ``batch`` rows, ``verify_len`` tokens per row (``K + 1``), greedy or
    ``sampled``, ``context_pages`` and whether it ``propose``s the next block (a step before a plain ``K = 0`` step
    does not). None for a size: the graph serves every value of it (a dynamic dimension: the batch from 2 rows,
    ``K`` from 1, the context from 2 pages)."""

    batch: int | None
    verify_len: int | None
    sampled: bool
    context_pages: int | None = None
    propose: bool = True

    def sort_key(self) -> tuple:
        return tuple(-1 if v is None else v for v in dataclasses.astuple(self))

    def compile_order(self) -> tuple:
        """Longest compile first, so that parallel compiles end together: a graph with more dynamic sizes, with the
        drafter (``propose``) and with more rows compiles longer (SmolLM2, cold: batch 2 and up every K 70 s, batch 1
        every K 40 s, plain decoding 25-30 s)."""
        dynamic = sum(v is None for v in (self.batch, self.verify_len, self.context_pages))
        return (-dynamic, -self.propose, -(self.batch or 1 << 30), -(self.verify_len or 1 << 30), self.sampled)

    @property
    def filename(self) -> str:
        size = lambda v: "any" if v is None else str(v)  # noqa: E731
        plain = "" if self.propose else "-noprop"
        return (f"step-b{size(self.batch)}-v{size(self.verify_len)}{plain}-"
                f"{'sampled' if self.sampled else 'greedy'}-ctx{size(self.context_pages)}.pt2")

    def __str__(self) -> str:
        ctx = "every context" if self.context_pages is None else f"{self.context_pages} pages"
        plain = "" if self.propose else " (no proposal)"
        k = "every K" if self.verify_len is None else f"K {self.verify_len - 1}"
        batch = "batch 2 and up" if self.batch is None else f"batch {self.batch}"
        return f"{batch}, {k}{plain}, {'sampled' if self.sampled else 'greedy'}, {ctx}"


def size_oblivious():
    """Sizes computed from a dynamic one traced for every value they may take: the drafts of a block of K + 1 tokens
    (``block[:, 1:]``) are a single column at K = 1, which dynamo would otherwise specialise or guard against 1."""
    return torch.fx.experimental._config.patch(backed_size_oblivious=True)


class StepKeys:
    """The keys of one wrapper's step graphs: ``dynamic_context`` (the backend compiles dynamic shapes) and
    ``regions`` (``spec.compile``'s argument) decide which sizes a key keeps."""

    def __init__(self, spec, dynamic_context: bool, regions: bool | None):
        self.spec, self.dynamic_context, self.regions_arg = spec, dynamic_context, regions

    @functools.cached_property
    def region_types(self) -> list[type]:
        """The layer classes compiled as nested compile regions (``regions.py``). The target's: ``regions=True``:
        every repeated class; None (default): classes repeated ``DEFAULT_MIN_REPEATS`` times, except in
        tensor-parallel targets (their collectives run inside the layers; the collective graph settings are the top
        graph's) and targets with recurrent layers (not tried as regions); False: none. The drafter's repeated layer
        class joins them where the target has one and the drafter is not split over ranks: its graph already calls
        regions (Inductor's Python wrapper), so one more class costs a call per layer and saves the copies."""
        spec, arg = self.spec, self.regions_arg
        if arg is False or (arg is None and (spec.tp is not None or spec.kv_cache().has_states)):
            return []
        kinds = repeated_layer_types(spec.target, min_repeats=2 if arg else DEFAULT_MIN_REPEATS)
        if kinds and spec.tp is None:
            kinds += [k for k in repeated_layer_types(spec.draft.layers) if k not in kinds]
        return kinds

    @property
    def regions(self) -> bool:
        return bool(self.region_types)

    @property
    def serves_every_context(self) -> bool:
        """Whether one graph per key serves every context length (else the context pages are part of the key)."""
        return self.dynamic_context and self.pages_range() is not None

    def key(self, batch: int, context_pages: int, sampled: bool, verify_len: int, propose: bool = True) -> StepKey:
        """The key of a step of these sizes. Where graphs are dynamic (``serves_every_context``), one graph per
        sampling mode serves every context length, every batch bucket from 2 rows (``open_batch``; one row keeps
        graphs of its own) and every ``K`` of the steps that propose (``K = 0`` among them, run with a block of 2:
        ``block_len``); the plain ``K = 0`` step that does not propose keeps a graph of its own (no drafter in it).
        Static ``K`` stays where ``open_k`` is False, a graph per bucket where ``open_batch`` is."""
        if not self.serves_every_context:
            return StepKey(batch, verify_len, sampled, context_pages, propose)
        return StepKey(None if batch >= 2 and self.open_batch else batch,
                       None if propose and self.open_k else verify_len, sampled, None, propose)

    @functools.cached_property
    def open_k(self) -> bool:
        """Whether the proposing steps of a bucket share one graph with ``K`` a dynamic size: graphs that serve every
        context, not tensor-parallel (not tried dynamic), no recurrent layers (they run the block token by token), a
        block of more than 2 tokens, and a policy that may verify a draft (the pools and the traced example hold
        ``num_speculative_tokens + 1`` tokens a step: a policy of ``K = 0`` alone has no block of 2)."""
        spec = self.spec
        return (self.serves_every_context and spec.dflash_step.block_size > 2 and spec.verify_len > 1
                and spec.tp is None and not spec.kv_cache().has_states)

    @functools.cached_property
    def open_batch(self) -> bool:
        """Whether the batch buckets from 2 rows share one graph per variant, the batch a dynamic size from 2 to
        ``max_batch_size``: graphs that serve every context, not tensor-parallel or recurrent (as ``open_k``), and
        two or more such buckets. A batch of one keeps its own graphs: traced as a size that may be 1, dynamo
        specialises or refuses (guards such as ``s*(2//s) == 2``), and plain decoding at one row is the step most
        worth its static shapes."""
        spec = self.spec
        return (self.serves_every_context and spec.tp is None and not spec.kv_cache().has_states
                and sum(1 for b in spec.batch_buckets if b >= 2) >= 2)

    def block_len(self, K: int, propose: bool) -> int:
        """The block a step verifying ``K`` drafts runs with: ``K + 1`` tokens, but 2 for a ``K = 0`` step that
        proposes where the proposing steps share the dynamic graph (its range starts at 2: HF attention branches on a
        query length of 1). The host fills the second column with -1, a draft no token equals, so that step accepts
        nothing and emits the target's one token, as a ``K = 0`` step does; it costs one more verified row."""
        return 2 if K == 0 and propose and self.open_k else K + 1

    def marked(self, key: StepKey, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Fresh views of ``forward``'s arguments (the marks stay off the caller's tensors) with the sizes ``key``
        leaves open marked dynamic: the batch (every per-row input's first dimension), the table's pages, the
        block's length."""
        args, kwargs = list(args), dict(kwargs)
        dims: dict[int, list] = {}  # argument index -> [(dim, min, max)]
        if key.batch is None:
            rows = (2, self.spec.max_batch_size)
            for i in (0, 1, 2, 3):  # block, seq_lens, block_tables, active
                dims.setdefault(i, []).append((0, *rows))
        if key.context_pages is None and self.pages_range() is not None:
            dims.setdefault(2, []).append((1, *self.pages_range()))
        if key.verify_len is None:
            dims.setdefault(0, []).append((1, 2, self.spec.dflash_step.block_size))
        for i, marks in dims.items():
            args[i] = args[i][:]  # one view per argument, every mark on it
            for dim, lo, hi in marks:
                torch._dynamo.mark_dynamic(args[i], dim, min=lo, max=hi)
        if key.batch is None and len(args) > 6:  # the sampling inputs, one value per row
            args[6] = type(args[6])(*[t[:] for t in args[6]])
            for t in args[6]:
                torch._dynamo.mark_dynamic(t, 0, min=2, max=self.spec.max_batch_size)
        return tuple(args), kwargs

    def pages_range(self) -> tuple[int, int] | None:
        """The dynamic page dimension's range, or None where the capacity is too small for one."""
        full = pages(self.spec.max_seq_len, self.spec.page_size)
        return (2, full) if full >= 3 else None

    def example(self, key: StepKey) -> tuple[tuple, dict]:
        """Step inputs of ``key``'s shapes to trace it with: for ``K`` and the batch, when the key leaves them open,
        the largest the wrapper runs (the sizes Inductor tunes its code for)."""
        spec = self.spec
        K = (key.verify_len or spec.verify_len) - 1
        return spec.dflash_step.example_inputs(spec.kv_cache(), key.batch or spec.max_batch_size,
                                               key.context_pages or 2, key.sampled, K, key.propose)

    def keys_for(self, buckets, sampling) -> list[StepKey]:
        """The keys of the graphs a batch in ``buckets`` steps through, greedy (``sampling=False``), sampled (True)
        or ``"both"``: one per ``(K, proposes)`` variant the policy may run, fewer where a dynamic graph serves
        several ``K``, and per context bucket where graphs are static."""
        if sampling not in (False, True, "both"):
            raise ValueError(f"sampling={sampling!r}: expected False, True or 'both'")
        modes = [False, True] if sampling == "both" else [bool(sampling)]
        pages_of = [None] if self.serves_every_context else list(self.spec.context_buckets)
        return list(dict.fromkeys(self.key(b, p or 2, m, k + 1, propose) for b in buckets for m in modes
                                  for p in pages_of for k, propose in self.spec.step_graphs()))
