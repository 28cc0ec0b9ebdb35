"""How many drafts each step verifies: ``K``, chosen per step from ``0`` (plain decoding) to ``block_size - 1``.

A step at ``K`` verifies the bonus token and the first ``K`` of the drafts the previous step proposed; a step
``propose``s (runs the drafter for the next block) only when the next step may want drafts. ``K = 0`` without
proposing is plain decoding through the same pools: the target's one token per row, and the drafter's context
still receives every new position, so speculation can resume at any step. Every (``K``, proposes) pair is its own
step graph; a policy names the ``K`` values it may use up front (:meth:`SpeculationPolicy.ks`), so the graph set is
bounded and can be compiled ahead of time.

Policies:

- :class:`FixedK`: ``num_speculative_tokens=K`` (every step verifies ``K``).
- :class:`BatchSizeSchedule`: vLLM's ``num_speculative_tokens_per_batch_size`` — ``K`` from the live batch size.
- :class:`GoodputPolicy` (``speculation="auto"``, the default): each step's ``K`` maximises the batch's expected
  tokens per second, ``sum_i (1 + E_i[accepted | K]) / cost(bucket, K, context)``, where ``cost`` is
  the measured wall time of that step graph on this machine (:class:`StepCosts`) and ``E_i`` comes from request
  ``i``'s own per-position acceptance history (:class:`AcceptanceHistory`; the drafter's pooled history is its
  prior until it has its own).
"""

from __future__ import annotations

import math
import re
from collections import deque
from dataclasses import dataclass, field


def default_ks(block_size: int) -> tuple[int, ...]:
    """The ``K`` values ``speculation="auto"`` may use: 0, the powers of two below ``block_size - 1``, and
    ``block_size - 1`` (``block_size`` 8: 0, 1, 2, 4, 7; 16: 0, 1, 2, 4, 8, 15)."""
    top = block_size - 1
    ks, k = {0, top}, 1
    while k < top:
        ks.add(k)
        k *= 2
    return tuple(sorted(ks))


@dataclass(frozen=True)
class Plan:
    """What a policy wants for the next step: verify ``k`` drafts, and whether this step ``propose``s a block."""

    k: int
    propose: bool


@dataclass
class StepView:
    """What a policy sees before a step: the batch ``bucket``, the live ``rows`` (their ``acceptance`` histories and
    ``args``), the step's context ``pages`` and whether it runs the ``sampled`` graph."""

    bucket: int
    rows: list
    pages: int
    sampled: bool

    @property
    def live(self) -> int:
        return len(self.rows)


class SpeculationPolicy:
    """Chooses each step's ``K``. ``ks(block_size)`` is the set of ``K`` it may return (each is its own graph);
    ``choose(view)`` returns a :class:`Plan`; ``observe`` is told what the step did: its seconds (None when the
    call compiled or loaded a graph, so its time says nothing about the step) and, per row of ``view``, the drafts
    accepted (None for a row that verified none) and whether a first draft proposed for a ``K = 0`` step agreed
    with the target's token (None where there was none)."""

    def ks(self, block_size: int) -> tuple[int, ...]:
        raise NotImplementedError

    def history(self, size: int) -> AcceptanceHistory | None:
        """A new request's acceptance history (None: this policy keeps none)."""
        return None

    def choose(self, view: StepView) -> Plan:
        raise NotImplementedError

    def observe(self, view: StepView, k: int, propose: bool, seconds: float | None,
                accepted: list[int | None], agreed: list[bool | None]) -> None:
        pass

    def describe(self) -> str:
        return type(self).__name__


class FixedK(SpeculationPolicy):
    """Every step verifies ``k`` drafts (``num_speculative_tokens=k``; ``k = 0`` is plain decoding)."""

    def __init__(self, k: int):
        self.k = k

    def ks(self, block_size: int) -> tuple[int, ...]:
        return (self.k,)

    def choose(self, view: StepView) -> Plan:
        return Plan(self.k, self.k > 0)

    def describe(self) -> str:
        return f"K = {self.k}"


_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


class BatchSizeSchedule(SpeculationPolicy):
    """vLLM's ``num_speculative_tokens_per_batch_size``: ``{"1-4": 7, "5-8": 2, "9-16": 0}``, inclusive ranges of
    the live batch size (``"8"`` is ``"8-8"``). A batch size in a gap takes the ``K`` of the last range below it,
    one below every range ``num_speculative_tokens``; each ``K`` is clamped to ``num_speculative_tokens``."""

    def __init__(self, schedule: dict, num_speculative_tokens: int):
        if not isinstance(schedule, dict) or not schedule:
            raise ValueError(f"num_speculative_tokens_per_batch_size must be a non-empty dict of ranges, got "
                             f"{schedule!r}")
        ranges = []
        for key, k in schedule.items():
            m = _RANGE.match(str(key))
            if not m:
                raise ValueError(f"num_speculative_tokens_per_batch_size key {key!r} is not a batch size range "
                                 f"('LO-HI' or 'N')")
            lo, hi = int(m[1]), int(m[2] or m[1])
            if lo < 1 or hi < lo:
                raise ValueError(f"num_speculative_tokens_per_batch_size range {key!r} is empty or below 1")
            if isinstance(k, bool) or not isinstance(k, int) or k < 0:
                raise ValueError(f"num_speculative_tokens_per_batch_size[{key!r}] = {k!r}: K must be an integer >= 0")
            ranges.append((lo, hi, min(k, num_speculative_tokens)))
        ranges.sort()
        for (_, hi, _), (lo, _, _) in zip(ranges, ranges[1:]):
            if lo <= hi:
                raise ValueError(f"num_speculative_tokens_per_batch_size ranges overlap at batch size {lo}")
        self.ranges, self.default = ranges, num_speculative_tokens

    def k_for(self, batch_size: int) -> int:
        k = self.default
        for lo, hi, rk in self.ranges:
            if batch_size < lo:
                break
            k = rk  # inside the range, or in the gap after it
        return k

    def ks(self, block_size: int) -> tuple[int, ...]:
        return tuple(sorted({rk for _, _, rk in self.ranges} | ({self.default} if self.ranges[0][0] > 1 else set())))

    def choose(self, view: StepView) -> Plan:
        k = self.k_for(view.live)
        return Plan(k, k > 0)

    def describe(self) -> str:
        return "per batch size " + ", ".join(f"{lo}-{hi}: {k}" for lo, hi, k in self.ranges)


# ---------------------------------------------------------------------------------------------- acceptance
@dataclass
class AcceptanceHistory:
    """Per-position acceptance of one request (or, pooled, of a drafter): ``tries[k]`` steps where draft ``k + 1``
    was verified with every draft before it accepted, ``hits[k]`` those where it was accepted too. Counts decay by
    ``decay`` per record, so the estimate follows the text as it changes."""

    size: int
    decay: float = 0.9
    tries: list[float] = field(default_factory=list)
    hits: list[float] = field(default_factory=list)

    def __post_init__(self):
        self.tries = self.tries or [0.0] * self.size
        self.hits = self.hits or [0.0] * self.size

    def record(self, k: int, accepted: int) -> None:
        """A step verified ``k`` drafts and accepted the first ``accepted``."""
        self._decay()
        for j in range(min(k, accepted + 1)):
            self.tries[j] += 1
            self.hits[j] += j < accepted

    def record_first(self, agreed: bool) -> None:
        """A step verified no draft, but a proposed first draft is comparable with the target's token."""
        self._decay()
        self.tries[0] += 1
        self.hits[0] += agreed

    def _decay(self) -> None:
        for j in range(self.size):
            self.tries[j] *= self.decay
            self.hits[j] *= self.decay

    def rates(self, prior: list[float] | None = None, weight: float = 2.0) -> list[float]:
        """Each position's conditional acceptance rate, shrunk toward ``prior`` (default 0.5) with ``weight``
        pseudo-steps."""
        prior = prior or [0.5] * self.size
        return [(h + weight * p) / (t + weight) for h, t, p in zip(self.hits, self.tries, prior)]


def expected_accepted(rates: list[float], k: int) -> float:
    """``E[accepted drafts]`` when ``k`` are verified: ``sum_{j<=k} prod_{i<=j} rate_i``."""
    total, run = 0.0, 1.0
    for r in rates[:k]:
        run *= r
        total += run
    return total


# ---------------------------------------------------------------------------------------------- cost
def context_bin(pages: int) -> int:
    """Context lengths whose step costs are pooled: pages 1-2, 3-4, 5-8, 9-16, ..."""
    return max(1, pages - 1).bit_length()


class StepCosts:
    """Measured seconds per step graph and context bin: the median of the last ``window`` timed calls of each cell
    ``(bucket, K, propose, sampled, context bin)``."""

    def __init__(self, window: int = 9):
        self.window = window
        self.cells: dict[tuple, deque] = {}

    def add(self, cell: tuple, seconds: float) -> None:
        self.cells.setdefault(cell, deque(maxlen=self.window)).append(seconds)

    def samples(self, cell: tuple) -> int:
        return len(self.cells.get(cell, ()))

    def measured(self, cell: tuple) -> float | None:
        d = self.cells.get(cell)
        if not d:
            return None
        s = sorted(d)
        n = len(s)
        return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])

    def estimate(self, cell: tuple, reference: tuple | None = None) -> float | None:
        """The cell's cost: measured, else the same graph at the nearest measured context bin, scaled by how
        ``reference`` (another graph measured at both bins) changed between them; None if the graph was never
        timed."""
        got = self.measured(cell)
        if got is not None:
            return got
        *graph, ctx = cell
        bins = sorted((abs(c[-1] - ctx), c[-1]) for c in self.cells if list(c[:-1]) == graph and self.cells[c])
        if not bins:
            return None
        near = bins[0][1]
        value = self.measured((*graph, near))
        if reference is not None:
            here, there = self.measured((*reference[:-1], ctx)), self.measured((*reference[:-1], near))
            if here is not None and there:
                value *= here / there
        return value

    def table(self) -> list[dict]:
        """Every cell, for reports: bucket, K, propose, sampled, context bin, samples, median seconds."""
        return [dict(bucket=c[0], k=c[1], propose=c[2], sampled=c[3], context_bin=c[4], samples=len(d),
                     seconds=self.measured(c)) for c, d in sorted(self.cells.items()) if d]


@dataclass
class _BucketState:
    """What :class:`GoodputPolicy` keeps per batch bucket."""

    probe_gap: int  # plain steps until the next probe (doubles while speculation is far off)
    want: int | None = None  # the K it wants
    since_switch: int = 0  # steps since the wanted K last changed
    zero_steps: int = 0  # plain steps since the last probe


class GoodputPolicy(SpeculationPolicy):
    """``speculation="auto"``: the ``K`` that maximises the batch's expected tokens per second.

    For each candidate ``K`` (``ks``), ``goodput(K) = sum_i (1 + E_i(K)) / cost(K)``: ``E_i`` from row
    ``i``'s acceptance history (shrunk toward the pooled history of every request this policy has seen), ``cost``
    the measured seconds of the step graph ``(bucket, K, proposes = K > 0, sampled)`` at this context bin. A ``K``
    whose graph was never timed at this bucket is explored only while its optimistic goodput — its tokens over the
    cost of the largest smaller ``K`` timed (a step costs no less with more drafts), infinite when none is — beats
    the best measured one by more than ``margin``: the first step of a bucket calibrates plain decoding, and a ``K``
    that cannot pay even at that bound is never tried.

    The wanted ``K`` and the probes' pace below are kept per batch bucket: what pays at one row says nothing about
    eight (a queue that drains to one row and explores there must not start the next queue's batch of eight at the
    ``K`` it wanted at one row, nor reset that batch's probe pace).

    No thrashing: the wanted ``K`` changes at most once per ``dwell`` steps (so at most ``100 / dwell`` switches per
    100 steps), and between two timed ``K`` only for a gain above ``margin``. While the batch stays at ``K = 0``,
    every ``probe_every`` steps a step proposes a block anyway (through the proposing graph, whose block is two
    tokens: at batch 8 on SmolLM2 it cost 2.3x a plain step), so the next step compares its first draft with the
    target's token and acceptance keeps being measured. A probe whose estimates still leave speculation far from
    paying (the best ``K > 0`` below ``far`` times plain decoding's goodput) doubles the gap to the next one, up to
    ``max_probe_every`` steps; one that does not, and any step that speculates, set it back to ``probe_every``.
    """

    def __init__(self, ks: tuple[int, ...] | None = None, *, dwell: int = 4, margin: float = 0.03,
                 probe_every: int = 16, max_probe_every: int = 256, far: float = 0.75, prior_weight: float = 4.0,
                 decay: float = 0.95, pooled_decay: float = 0.995):
        if dwell < 1 or probe_every < 2 or max_probe_every < probe_every:
            raise ValueError("dwell must be >= 1, probe_every >= 2 and max_probe_every >= probe_every")
        if not 0.0 <= far <= 1.0:
            raise ValueError(f"far must be in [0, 1], got {far}")
        self._ks, self.dwell, self.margin, self.probe_every = ks, dwell, margin, probe_every
        self.max_probe_every, self.far = max_probe_every, far
        self.prior_weight, self.decay, self.pooled_decay = prior_weight, decay, pooled_decay
        self.block_size = None  # set by ks(), which the wrapper calls first
        self.costs = StepCosts()
        self.pooled: AcceptanceHistory | None = None
        self._buckets: dict[int, _BucketState] = {}
        self._bucket: int | None = None  # the bucket of the last step chosen
        self.switches = 0  # changes of the wanted K, every bucket
        self._checked_ks: tuple[int, ...] = ()
        self.last_goodput: dict[int, float] = {}

    @property
    def probe_gap(self) -> int:
        """Plain steps between probes at the bucket of the last step chosen."""
        return self._state(self._bucket).probe_gap if self._bucket is not None else self.probe_every

    def _state(self, bucket: int) -> _BucketState:
        if bucket not in self._buckets:
            self._buckets[bucket] = _BucketState(probe_gap=self.probe_every)
        return self._buckets[bucket]

    def ks(self, block_size: int) -> tuple[int, ...]:
        self.block_size = block_size
        ks = self._ks or default_ks(block_size)
        bad = [k for k in ks if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= block_size - 1]
        if bad:
            raise ValueError(f"speculative K values {bad} are outside [0, block_size - 1 = {block_size - 1}]")
        self._checked_ks = tuple(sorted(set(ks)))
        return self._checked_ks

    def history(self, size: int) -> AcceptanceHistory:
        """A new request's acceptance history."""
        if self.pooled is None:
            self.pooled = AcceptanceHistory(size, self.pooled_decay)
        return AcceptanceHistory(size, self.decay)

    def _cell(self, view: StepView, k: int, propose: bool | None = None) -> tuple:
        return (view.bucket, k, k > 0 if propose is None else propose, view.sampled, context_bin(view.pages))

    def goodputs(self, view: StepView, ks: tuple[int, ...]) -> dict[int, tuple[float, bool]]:
        """``{K: (expected tokens per second, measured)}``; an unmeasured ``K``'s is its optimistic bound."""
        prior = self.pooled.rates() if self.pooled is not None else None
        rates = [r.acceptance.rates(prior, self.prior_weight) if r.acceptance is not None
                 else (prior or [0.5] * self.block_size) for r in view.rows]
        want = self._state(view.bucket).want
        ref = self._cell(view, want) if want is not None else None
        out, floor = {}, 0.0
        for k in ks:
            tokens = sum(1.0 + expected_accepted(rt, k) for rt in rates)
            cost = self.costs.estimate(self._cell(view, k), ref)
            if cost is not None:
                floor = max(floor, cost)
                out[k] = (tokens / cost, True)
            else:
                out[k] = (tokens / floor if floor > 0 else math.inf, False)
        return out

    def choose(self, view: StepView) -> Plan:
        ks = self._checked_ks
        g = self.goodputs(view, ks)
        self.last_goodput = {k: v for k, (v, _) in g.items()}
        measured = [k for k in ks if g[k][1]]
        best = max(ks, key=lambda k: (g[k][0], -k))
        if measured and not g[best][1]:  # explore an untimed K only for a gain above the margin, even at best
            known = max(measured, key=lambda k: (g[k][0], -k))
            best = best if g[best][0] > g[known][0] * (1.0 + self.margin) else known
        st = self._state(view.bucket)
        self._bucket = view.bucket
        want = st.want
        if want is None or want not in g:
            want, st.since_switch = best, 0
        elif best != want and st.since_switch >= self.dwell:
            gain_needed = 1.0 + (self.margin if g[best][1] and g[want][1] else 0.0)
            if g[best][0] > g[want][0] * gain_needed:
                want, st.since_switch = best, 0
                self.switches += 1
        st.since_switch += 1
        st.want = want
        if want == 0:
            st.zero_steps += 1
            if st.zero_steps < st.probe_gap:
                return Plan(0, False)
            st.zero_steps = 0
            speculating = max((g[k][0] for k in ks if k > 0), default=0.0)
            far_off = speculating < self.far * g[0][0]
            st.probe_gap = min(2 * st.probe_gap, self.max_probe_every) if far_off else self.probe_every
            return Plan(0, True)
        st.zero_steps = 0
        st.probe_gap = self.probe_every
        return Plan(want, True)

    def observe(self, view: StepView, k: int, propose: bool, seconds: float | None,
                accepted: list[int | None], agreed: list[bool | None]) -> None:
        if seconds is not None:
            self.costs.add(self._cell(view, k, propose), seconds)
        for r, a, f in zip(view.rows, accepted, agreed):
            for h in (r.acceptance, self.pooled):
                if h is None:
                    continue
                if a is not None and k > 0:
                    h.record(k, a)
                elif f is not None:
                    h.record_first(f)

    def describe(self) -> str:
        return f"auto over K in {self._ks or 'the default set'}"


def make_policy(speculation, num_speculative_tokens: int | None, block_size: int) -> SpeculationPolicy:
    """The wrapper's ``speculation`` argument -> a policy (see ``DFlashSpecWrapper``)."""
    K = num_speculative_tokens
    if speculation is None:
        speculation = "auto" if K is None else "fixed"
    if isinstance(speculation, SpeculationPolicy):
        return speculation
    if isinstance(speculation, dict):
        return BatchSizeSchedule(speculation, block_size - 1 if K is None else K)
    if speculation == "fixed":
        return FixedK(block_size - 1 if K is None else K)
    if speculation == "auto":
        return GoodputPolicy(None if K is None else tuple(k for k in default_ks(block_size) if k < K) + (K,))
    raise ValueError(f"speculation={speculation!r}: expected 'auto', 'fixed', a num_speculative_tokens_per_batch_size "
                     f"dict or a SpeculationPolicy")


def read_speculative_config(target, speculative_config: dict | str, kwargs: dict):
    """vLLM's ``speculative_config`` -> ``(drafter, K, the wrapper's keyword arguments)`` (see
    ``DFlashSpecWrapper.from_speculative_config``)."""
    import json
    from pathlib import Path

    from ..models.draft_model import DFlashDraftModel
    from ..models.hidden_states import decoder_layers

    cfg = json.loads(speculative_config) if isinstance(speculative_config, str) else dict(speculative_config)
    known = {"method", "model", "num_speculative_tokens", "num_speculative_tokens_per_batch_size", "max_model_len"}
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ValueError(f"speculative_config keys {unknown} are not supported ({', '.join(sorted(known))})")
    if cfg.get("method") != "dflash":
        raise ValueError(f"speculative_config method {cfg.get('method')!r} is not supported: only 'dflash'")
    if not cfg.get("model") or not Path(cfg["model"]).is_dir():
        raise ValueError(f"speculative_config model {cfg.get('model')!r} is not a drafter directory")
    p = next(target.parameters())
    draft = DFlashDraftModel.from_pretrained(cfg["model"], dtype=p.dtype, device=p.device,
                                             num_target_layers=len(decoder_layers(target)),
                                             vocab_size=target.config.get_text_config().vocab_size)
    kwargs = dict(kwargs)
    if "max_model_len" in cfg:
        kwargs.setdefault("max_seq_len", cfg["max_model_len"])
    if "num_speculative_tokens_per_batch_size" in cfg:
        kwargs.setdefault("speculation", cfg["num_speculative_tokens_per_batch_size"])
    return draft, cfg.get("num_speculative_tokens"), kwargs
