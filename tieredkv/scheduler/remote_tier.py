"""The shared remote tier (Redis/Valkey) as the planner sees it: probe, admit, remember.

The remote tier is a :class:`~tieredkv.scheduler.lower_tier.LowerTier` (host slots are
filled from it like from disk) but not an indexed one: the scheduler does not own it (other
replicas write and Redis evicts at any moment), so it keeps no index of it, only hints:

* **Reads.** A lookup whose prefix continues past what host and disk hold asks
  :meth:`RemoteTier.poll` how many more chunks every rank's shard exists for. The answer comes
  from a non-blocking :class:`~tieredkv.scheduler.remote_probe.RemoteProbe` (``None``: ask
  again). Present chunks are read into host slots by the workers (the fill path's
  ``RemoteReadJob``) and verified there before anything is promised; a chunk that turns out
  gone or bad is a miss, counted by cause, and forgotten.
* **Writes.** A chunk stored in host memory (a whole chunk: the probe asks for chunk keys) is
  queued for the remote tier once admitted (``remote_admission`` sightings), unless it is
  known to be there already (read from it, written before, or seen by a probe).
* **Reset.** ``reset_cache`` forgets the hints, never the shared data: other replicas may be
  serving from it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from tieredkv.metrics.specs import Count, Counts
from tieredkv.protocol import FailureCause, JobKind, RemoteReadJob, StepPlan, Tier
from tieredkv.scheduler.lower_tier import LowerTier, Sightings
from tieredkv.scheduler.remote_probe import RemoteProbe

WRITTEN_CAPACITY = 1 << 16  # chunk keys this engine remembers writing
INFO_INTERVAL_S = 5.0  # how often the server's memory and evictions are asked for (metrics)

# The server's own figures: used_memory, maxmemory, evicted_keys (None: down or failed).
ServerInfo = Callable[[], "Future[dict[str, int] | None]"]


class RemoteTier(LowerTier):
    """Probes, fills and write admission for the shared tier (the scheduler's thread only)."""

    name = Tier.REMOTE
    fill_kind = JobKind.REMOTE_READ
    fill_counter = Count.REMOTE_READ_CHUNKS

    def __init__(
        self,
        probe: RemoteProbe,
        *,
        is_up: Callable[[], bool],
        writes: bool,
        admission: int,
        seen_limit: int,
        written_capacity: int = WRITTEN_CAPACITY,
        server_info: ServerInfo | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.probe = probe
        self._is_up = is_up
        self.writes = writes
        self._sightings = Sightings(admission, seen_limit)
        self._written: OrderedDict[bytes, None] = OrderedDict()
        self._written_capacity = written_capacity
        self._server_info = server_info
        self._clock = clock
        self._info: dict[str, int] | None = None
        self._info_future: Future[dict[str, int] | None] | None = None
        self._info_at = float("-inf")
        self._evicted_seen: int | None = None
        self._skipped_down = 0

    @property
    def up(self) -> bool:
        return self._is_up()

    # ------------------------------------------------------------------ reads

    def poll(self, req_id: str, keys: Sequence[bytes]) -> int | None:
        """Leading ``keys`` every rank holds remotely, 0 while the store is down, or None."""
        if not keys:
            return 0
        if not self._is_up() and not self.probe.in_flight(req_id):
            self._skipped_down += 1  # known down: no call, no wait
            return 0
        return self.probe.poll(req_id, keys)

    def forget(self, req_id: str) -> None:
        self.probe.forget(req_id)

    def fill_aliases(self, key: bytes) -> None:
        return None  # a value holds a whole chunk: the host entry takes the request's keys

    def plan_fill(self, plan: StepPlan, job_id: int, key: bytes, host_slot: int,
                  req_id: str) -> None:
        plan.remote_reads.append(RemoteReadJob(job_id, key, host_slot, req_id=req_id))

    def fill_done(self, key: bytes, ok: bool) -> None:
        if ok:
            self.remember(key)  # there: no need to write it back
        else:
            self.forget_key(key)

    # ------------------------------------------------------------------ writes

    def note_seen(self, key: bytes) -> bool:
        """Count a sighting; True when the chunk should now be written (if not there yet)."""
        return self.writes and self._sightings.note(key) and not self.holds_hint(key)

    def admits(self, key: bytes) -> bool:
        return self.writes and self._sightings.admits(key)

    def holds_hint(self, key: bytes) -> bool:
        """Whether this engine believes the remote tier holds ``key`` (so not to write it)."""
        return key in self._written or self.probe.known(key)

    def remember(self, key: bytes) -> None:
        """``key`` was written by this engine or read from the remote tier."""
        written = self._written
        written[key] = None
        written.move_to_end(key)
        while len(written) > self._written_capacity:
            written.popitem(last=False)

    def forget_key(self, key: bytes) -> None:
        """A read of ``key`` failed: it is not there (or not usable); it may be written again."""
        self._written.pop(key, None)
        self.probe.unknow(key)

    def reset(self) -> None:
        """vLLM's reset_cache: forget every hint; the shared data stays for other replicas."""
        self._written.clear()
        self._sightings.clear()
        self.probe.reset()

    # ------------------------------------------------------------------ metrics

    def take_stats(self, counters: Counts) -> list[float]:
        """Add the probe's counters since the last call to ``counters``; its latencies."""
        stats = self.probe.take_stats()
        counters[Count.REMOTE_PROBES] += stats.probes
        counters[Count.REMOTE_PROBE_KEYS] += stats.keys_probed
        counters[Count.REMOTE_PROBE_KNOWN_HITS] += stats.known_hits
        if stats.timeouts:
            counters[Count.REMOTE_PROBE_FAILED, FailureCause.TIMEOUT] += stats.timeouts
        for cause, count in stats.failures.items():
            counters[Count.REMOTE_PROBE_FAILED, cause] += count
        if self._skipped_down:
            counters[Count.REMOTE_PROBE_FAILED, FailureCause.UNAVAILABLE] += self._skipped_down
            self._skipped_down = 0
        return list(stats.latency_s)

    def server_gauges(self, counters: Counts) -> dict[str, int]:
        """The server's memory use and limit (``remote_used_bytes``, ``remote_capacity_bytes``;
        0: no ``maxmemory``), refreshed in the background every ``INFO_INTERVAL_S``; the
        keys Redis evicted since the last reading go to ``evictions_remote``. Never waits."""
        future = self._info_future
        if future is not None and future.done():
            self._info_future = None
            info = future.result() if future.exception() is None else None
            if info is not None:
                self._info = info
                evicted = info.get("evicted_keys", 0)
                if self._evicted_seen is not None and evicted > self._evicted_seen:
                    counters[Count.EVICTIONS, Tier.REMOTE] += evicted - self._evicted_seen
                self._evicted_seen = evicted
        now = self._clock()
        if self._server_info is not None and self._info_future is None and (
                now - self._info_at >= INFO_INTERVAL_S):
            self._info_at = now
            self._info_future = self._server_info()
        info = self._info
        if info is None:
            return {}
        return {"remote_used_bytes": info.get("used_memory", 0),
                "remote_capacity_bytes": info.get("maxmemory", 0)}
