"""The scheduler's two policies: which resident key a full tier gives up next (eviction), and
whether a lower tier's hit is worth reading at all (the cost model). Both decide from what the
tier index and the planner tell them and never touch bytes; neither is thread-safe (the
scheduler half owns them, on one thread).

Eviction: a policy orders opaque keys. The tier index tells it what became resident, was hit
and left, and asks for a victim among the keys it may evict (pinned keys are skipped, not
removed). All O(1) but ``victim``: O(1 + pinned keys it steps over from the cold end).

The cost model loads a lower-tier hit only when it beats recomputing it: a disk or a Redis
that reads slower than the engine prefills makes a "hit" slower than a miss. It keeps running
estimates from what the planner already sees, asked before each fill (:meth:`CostModel.affordable`):

* **Read time per tier** (disk, remote), from completed fill rounds (the chunks one lookup
  sent to a tier at once, issue to the last one's report: what the request waited). Over the
  last :data:`WINDOW` rounds, ``T = latency + n * chunk_bytes / bandwidth`` fitted by Theil-Sen
  (medians: one stalled or lucky round moves nothing); rounds of one size only: the median
  ``T / n``, latency 0.
* **The engine's prefill rate** (tokens/s): a step's scheduled tokens over :meth:`step_scheduled`
  (``build_connector_meta``) to :meth:`step_done` (its output, by number), steps of a chunk's
  tokens or more only; the median of the last :data:`RATE_WINDOW`. A step's time holds its
  loads and decodes too: the rate is if anything low, erring towards loading.

The decision: a tier's chunks in a lookup's run are filled only when their predicted read time
times ``1 + margin`` is at most the time to recompute from the first of them to the run's end;
else the hit ends before them, counted in ``hits_declined{tier, reason="slower_than_recompute"}``
once per request and tier, and the decline sticks. Until a tier and the rate both have
:data:`MIN_SAMPLES` samples, every fill is allowed. While a tier is declined, one chunk is read
every :data:`EXPLORE_INTERVAL_S` (exploration) so that a tier that recovers is used again: a
round much faster than predicted starts its estimate over. A tier turning slow, and fast
again, is logged (a warning each way; flapping near break-even, :data:`TURN_WARNINGS` a minute).

The remote probe: a request waits for it (:meth:`may_wait_for_probe`) no longer than the remote
hit could save (recomputing the rest minus reading it) nor than ``remote_timeout_s``; then it
computes the rest (``hits_declined{tier="remote", reason="probe_wait_over_saving"}``, counted
when it ends if the answer shows Redis held more: ``RemoteHits.settle``). A remote tier known
slower than recomputing saves nothing: its probe is not waited for, except when the tier is due
to be explored (the wait bounded by the recompute time alone; one chunk explored).
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from statistics import median

from tieredkv.metrics.specs import Count, Counts
from tieredkv.protocol import PolicyName

logger = logging.getLogger(__name__)


def _first_evictable(keys: Iterable[bytes], can_evict: Callable[[bytes], bool]) -> bytes | None:
    return next((key for key in keys if can_evict(key)), None)


class EvictionPolicy(ABC):
    """Orders resident keys for eviction. :meth:`victim`'s ``can_evict`` must not change the
    policy (it is called while the policy iterates its own lists)."""

    @abstractmethod
    def insert(self, key: bytes) -> None:
        """``key`` became resident (inserting a resident key counts as a hit)."""

    @abstractmethod
    def touch(self, key: bytes) -> None:
        """``key`` was hit; a key that is not resident is ignored."""

    @abstractmethod
    def remove(self, key: bytes, *, evicted: bool = True) -> None:
        """``key`` is no longer resident (absent: a no-op). ``evicted``: it was chosen as a
        victim, and a policy that learns from its mistakes (ARC) remembers it; False for a
        departure that says nothing of its choices (an aborted write, a failed read, a reset)."""

    @abstractmethod
    def victim(self, can_evict: Callable[[bytes], bool]) -> bytes | None:
        """The best resident key to evict among those ``can_evict`` accepts; not removed."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every key, resident or remembered (a reset makes all history stale)."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident keys."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is resident."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first: one ordered dict, coldest key at the front."""

    def __init__(self, capacity: int = 0) -> None:
        self.capacity = capacity  # unused by LRU: every policy is built the same way
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, key: bytes) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: bytes, *, evicted: bool = True) -> None:
        self._order.pop(key, None)

    def victim(self, can_evict: Callable[[bytes], bool]) -> bytes | None:
        return _first_evictable(self._order, can_evict)

    def clear(self) -> None:
        self._order.clear()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST 2003).

    Resident keys live in T1 (seen once recently) or T2 (seen at least twice); keys evicted
    from them are remembered, without data, in ghost lists B1 and B2. A key back from B1 grows
    T1's target size ``p``, one back from B2 shrinks it; either returns to T2. A one-time scan
    only churns T1, so keys hit more than once survive it (plain LRU cannot promise that).
    The tier index decides when to evict; :meth:`victim` applies ARC's REPLACE rule (T1's
    coldest key when ``|T1| > p``, else T2's), falling back to the other list when the
    preferred one is all pinned. Ghosts keep ARC's bounds: ``|T1| + |B1| <= capacity`` and
    ``|T1| + |T2| + |B1| + |B2| <= 2 * capacity``.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"ARC capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._p = 0
        self._t1: OrderedDict[bytes, None] = OrderedDict()
        self._t2: OrderedDict[bytes, None] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()

    @property
    def p(self) -> int:
        """Adaptive target size of T1, in ``0..capacity``."""
        return self._p

    def insert(self, key: bytes) -> None:
        if key in self._t1 or key in self._t2:
            self.touch(key)
            return
        if key in self._b1:
            # A recency ghost came back: T1 was evicted too eagerly.
            self._p = min(self.capacity, self._p + max(1, len(self._b2) // len(self._b1)))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            # A frequency ghost came back: T2 deserved more room.
            self._p = max(0, self._p - max(1, len(self._b1) // len(self._b2)))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._trim_ghosts()

    def touch(self, key: bytes) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def remove(self, key: bytes, *, evicted: bool = True) -> None:
        if key in self._t1:
            del self._t1[key]
            if evicted:
                self._b1[key] = None
        elif key in self._t2:
            del self._t2[key]
            if evicted:
                self._b2[key] = None
        else:
            return
        self._trim_ghosts()

    def victim(self, can_evict: Callable[[bytes], bool]) -> bytes | None:
        if len(self._t1) > self._p:
            first, second = self._t1, self._t2
        else:
            first, second = self._t2, self._t1
        found = _first_evictable(first, can_evict)
        return found if found is not None else _first_evictable(second, can_evict)

    def clear(self) -> None:
        for lst in (self._t1, self._t2, self._b1, self._b2):
            lst.clear()
        self._p = 0

    def where(self, key: bytes) -> str | None:
        """Which list holds ``key``: ``"t1"``, ``"t2"``, ``"b1"``, ``"b2"`` or None."""
        for name, lst in (("t1", self._t1), ("t2", self._t2), ("b1", self._b1), ("b2", self._b2)):
            if key in lst:
                return name
        return None

    def _trim_ghosts(self) -> None:
        # Only ghosts are dropped here; resident keys leave when the tier index evicts them.
        c = self.capacity
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        total = len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2)
        while total > 2 * c and (self._b1 or self._b2):
            (self._b2 if self._b2 else self._b1).popitem(last=False)
            total -= 1

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """Build the policy called ``name`` (``"lru"`` or ``"arc"``) for ``capacity`` slots."""
    normalized = name.strip().lower() if isinstance(name, str) else name
    if normalized == PolicyName.LRU:
        return LRUPolicy(capacity)
    if normalized == PolicyName.ARC:
        return ARCPolicy(capacity)
    raise ValueError(
        f"tieredkv: unknown eviction policy {name!r}; expected one of {', '.join(PolicyName)}"
    )


# ---------------------------------------------------------------------------- cost model


WINDOW = 8  # fill rounds per tier the fit looks at: a recovered tier counts after ~5 rounds
RATE_WINDOW = 16  # prefill steps the rate's median looks at
STEPS_IN_FLIGHT = 64  # steps scheduled ahead of their output (pipeline parallel: up to pp + 1)
MIN_SAMPLES = 3  # below this, no estimate: every fill is allowed
EXPLORE_INTERVAL_S = 5.0  # while a tier is declined, one chunk read this often
DEFAULT_MARGIN = 0.2
RECOVERED = 0.5  # a round this much faster than predicted: the tier changed, start over
TURN_WARNINGS, TURN_WINDOW_S = 3, 60.0  # a tier's turns logged as warnings, at most, per window


@dataclass(slots=True)
class _Round:
    tier: str
    started: float
    chunks: int
    remaining: int
    background: bool = False  # no request waits for it: timed by the workers' own clocks
    worker_s: float = 0.0  # the slowest job's time on the workers


class ReadEstimate:
    """One tier's read time: ``latency_s + chunks * seconds_per_chunk`` from recent rounds."""

    def __init__(self, window: int = WINDOW) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._fit: tuple[float, float] | None = None

    def add(self, chunks: int, seconds: float) -> None:
        """One round; one under :data:`RECOVERED` of the prediction starts the window over (a
        tier that recovered, found by exploration, is trusted again at once, not after the
        slow rounds age out of the window)."""
        if chunks <= 0 or seconds < 0:
            return
        if len(self._samples) >= MIN_SAMPLES and seconds < RECOVERED * self.predict(chunks):
            self._samples.clear()
        self._samples.append((chunks, seconds))
        self._fit = None

    def __len__(self) -> int:
        return len(self._samples)

    def fit(self) -> tuple[float, float]:
        """``(latency_s, seconds_per_chunk)``, Theil-Sen over the window (both >= 0)."""
        if self._fit is None:
            samples = list(self._samples)
            slopes = [(t2 - t1) / (n2 - n1) for i, (n1, t1) in enumerate(samples)
                      for n2, t2 in samples[i + 1:] if n2 != n1]
            if slopes:
                slope = max(0.0, median(slopes))
                latency = max(0.0, median(t - slope * n for n, t in samples))
            else:
                slope, latency = median(t / n for n, t in samples), 0.0
            self._fit = (latency, slope)
        return self._fit

    def predict(self, chunks: int) -> float:
        latency, per_chunk = self.fit()
        return latency + chunks * per_chunk


class CostModel:
    """Read estimates per tier, the prefill rate, and the decline decision (one thread)."""

    def __init__(
        self, counters: Counts, *, chunk_tokens: int, chunk_bytes: int = 0,
        margin: float = DEFAULT_MARGIN, enabled: bool = True, probe_timeout_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.enabled = enabled
        self.chunk_tokens = chunk_tokens
        self.chunk_bytes = chunk_bytes  # all ranks; 0: unknown (bandwidth in chunks/s)
        self.margin = margin
        self.probe_timeout_s = probe_timeout_s
        self._counters = counters
        self._clock = clock
        self._reads: dict[str, ReadEstimate] = {}
        self._rounds: dict[int, _Round] = {}
        self._rates: deque[float] = deque(maxlen=RATE_WINDOW)
        # Steps scheduled, not yet reported: (number, time, tokens), oldest first; an output
        # (async scheduling: k+1 is scheduled before k's comes back) is paired by the number
        # the workers echo, else the oldest. Under a chunk: untimed (no clock read on decode).
        self._steps: deque[tuple[int, float, int]] = deque(maxlen=STEPS_IN_FLIGHT)
        self._step = 0  # the last step's number
        self._explored: dict[str, float] = {}
        self._exploring: set[str] = set()  # declined tiers due for a background read
        self._declined: dict[str, set[str]] = {}  # req_id -> tiers declined for it
        self._slow: set[str] = set()  # tiers whose last decision declined (logged at each turn)
        self._warned: dict[str, deque[float]] = {}  # when each tier's last turns were logged
        self._unlogged: dict[str, int] = {}  # turns past the warnings' rate, not logged yet
        self._probe_waits: dict[str, float] = {}

    # ------------------------------------------------------------------ observations

    def fills_started(self, tier: str, job_ids: Sequence[int], background: bool = False) -> None:
        """One lookup sent these fill jobs to ``tier`` together: one round. A ``background``
        round (an exploration no request waits for) runs beside other requests' compute
        steps, so it is timed by the workers (job submit to result), not by the steps."""
        if job_ids:
            round_ = _Round(tier, self._clock(), len(job_ids), len(job_ids), background)
            for job_id in job_ids:
                self._rounds[job_id] = round_

    def fill_done(self, job_id: int, worker_s: float = 0.0) -> None:
        """Every rank reported the fill job (ok or failed); ``worker_s``: its slowest rank's."""
        round_ = self._rounds.pop(job_id, None)
        if round_ is None:
            return
        round_.remaining -= 1
        round_.worker_s = max(round_.worker_s, worker_s)
        if round_.remaining == 0:
            elapsed = self._clock() - round_.started
            if round_.background and round_.worker_s > 0:
                elapsed = round_.worker_s
            self._reads.setdefault(round_.tier, ReadEstimate()).add(round_.chunks, elapsed)

    def step_scheduled(self, tokens: int) -> int:
        """vLLM scheduled a step of ``tokens`` tokens (``build_connector_meta``); its number."""
        self._step += 1
        self._steps.append((self._step, self._clock() if tokens >= self.chunk_tokens else 0.0,
                            tokens))
        return self._step

    def step_done(self, step: int | None = None) -> None:
        """Step ``step``'s output (None: the oldest's): a rate sample if it computed a chunk."""
        steps = self._steps
        while step is not None and steps and steps[0][0] < step:
            steps.popleft()
        if not steps or (step is not None and steps[0][0] != step):
            return
        _, started, tokens = steps.popleft()
        if tokens < self.chunk_tokens:
            return
        elapsed = self._clock() - started
        if elapsed > 0:
            self._rates.append(tokens / elapsed)

    def computing(self) -> bool:
        """Whether a step that computes tokens has not had its output yet."""
        return any(tokens for _, _, tokens in self._steps)

    # ------------------------------------------------------------------ estimates

    @property
    def prefill_tokens_per_s(self) -> float | None:
        return median(self._rates) if len(self._rates) >= MIN_SAMPLES else None

    def read_seconds(self, tier: str, chunks: int) -> float | None:
        """Predicted time to fill ``chunks`` from ``tier``; None: too few samples yet."""
        reads = self._reads.get(tier)
        return reads.predict(chunks) if reads is not None and len(reads) >= MIN_SAMPLES else None

    def bandwidth(self, tier: str) -> float | None:
        """Bytes/s (chunks/s without a chunk size) of ``tier``'s reads, or None."""
        reads = self._reads.get(tier)
        if reads is None or len(reads) < MIN_SAMPLES:
            return None
        per_chunk = reads.fit()[1]
        return (self.chunk_bytes or 1) / per_chunk if per_chunk > 0 else float("inf")

    def recompute_seconds(self, tokens: int) -> float | None:
        rate = self.prefill_tokens_per_s
        return tokens / rate if rate else None

    # ------------------------------------------------------------------ decisions

    def affordable(
        self, req_id: str, run: Sequence[bytes], by_tier: Sequence[tuple[str, Collection[bytes]]],
        first_chunk: int, start_token: int, limit: int,
    ) -> int:
        """How many of ``run``'s keys (chunk ``first_chunk`` on) to keep: cut before a tier's
        chunks (``by_tier``, the last tier in the run first) whose read is predicted slower
        than recomputing from there to the run's end (``limit`` at most)."""
        keep = len(run)
        if not self.enabled:
            return keep
        C = self.chunk_tokens
        for tier, keys in by_tier:
            positions = [p for p in range(keep) if run[p] in keys]
            if not positions:
                continue
            tokens = (min((first_chunk + keep) * C, limit)
                      - max((first_chunk + positions[0]) * C, start_token))
            allowed = self._allowed(req_id, tier, len(positions), tokens)
            if allowed < len(positions):
                keep = positions[allowed]
        return keep

    def _allowed(self, req_id: str, tier: str, chunks: int, tokens: int) -> int:
        """Chunks of ``tier`` this request may fill: all or none. A decline while the tier is
        due to be explored queues it for :meth:`take_explorations`."""
        declined = self._declined.get(req_id)
        if declined is not None and tier in declined:
            return 0
        read = self.read_seconds(tier, chunks)
        recompute = self.recompute_seconds(tokens)
        allowed = read is None or recompute is None or read * (1 + self.margin) <= recompute
        if allowed == (tier in self._slow) or self._unlogged.get(tier):
            self._log_turn(tier, allowed, chunks, read, recompute)
        if allowed:
            return chunks
        self._declined.setdefault(req_id, set()).add(tier)
        self._counters[Count.HITS_DECLINED_SLOWER, tier] += 1
        now = self._clock()
        if now - self._explored.get(tier, float("-inf")) >= EXPLORE_INTERVAL_S:
            self._explored[tier] = now
            self._exploring.add(tier)
        return 0

    def _log_turn(self, tier: str, allowed: bool, chunks: int, read: float | None,
                  recompute: float | None) -> None:
        """Why hits stop, or resume: a warning at each turn, at most :data:`TURN_WARNINGS` per
        tier in :data:`TURN_WINDOW_S` (a tier near break-even turns with each request's size);
        the next one says how many turns went unlogged, and the state the tier is in."""
        turned = allowed == (tier in self._slow)
        self._slow ^= {tier} if turned else set()
        now, warned = self._clock(), self._warned.setdefault(tier, deque(maxlen=TURN_WARNINGS))
        if len(warned) == TURN_WARNINGS and now - warned[0] < TURN_WINDOW_S:
            self._unlogged[tier] = self._unlogged.get(tier, 0) + turned
            return
        warned.append(now)
        unlogged = self._unlogged.pop(tier, 0)
        logger.warning(
            "tieredkv: %s hits %s (a %d-chunk read predicted %s, recomputing %s)%s", tier,
            "are taken again" if allowed else "predicted slower than recomputing them are "
            f"declined; one chunk is read every {EXPLORE_INTERVAL_S:.0f} s to measure the "
            "tier again", chunks, "n/a" if read is None else f"{read:.3f} s",
            "n/a" if recompute is None else f"{recompute:.3f} s",
            f"; {unlogged} turns since the last warning were not logged" if unlogged else "")

    def take_explorations(self) -> set[str]:
        """Tiers due for an exploration since the last call (one chunk read in the background)."""
        tiers, self._exploring = self._exploring, set()
        return tiers

    def may_wait_for_probe(self, req_id: str, tier: str, tokens: int, chunks: int) -> bool:
        """Whether the request may wait (on) for its remote probe: False once it has waited
        longer than the ``chunks`` (``tokens``) the remote tier could hold would save."""
        now = self._clock()
        since = self._probe_waits.setdefault(req_id, now)
        if not self.enabled:
            return True
        recompute = self.recompute_seconds(tokens)
        if recompute is None:
            return True  # no estimate: the probe's own deadline (remote_timeout_s) applies
        saving = recompute - (self.read_seconds(tier, chunks) or 0.0)
        if saving <= 0 and now - self._explored.get(tier, float("-inf")) >= EXPLORE_INTERVAL_S:
            saving = recompute  # known slower, but due to be explored: let the probe answer
        if self.probe_timeout_s:
            saving = min(saving, self.probe_timeout_s)
        return now - since <= saving  # False: counted once the answer shows a hit

    def forget(self, req_id: str, *, declines: bool = True) -> None:
        """The request finished: drop its probe wait and (``declines``) its sticky declines."""
        self._probe_waits.pop(req_id, None)
        if declines:  # kept across a preemption: a decline is counted once per request
            self._declined.pop(req_id, None)
