"""The shared remote tier (Redis/Valkey) as the planner sees it: probe, admit, remember.

The remote tier is a :class:`~tieredkv.scheduler.lower_tier.LowerTier` (host slots are
filled from it like from disk) but not an indexed one: the scheduler does not own it (other
replicas write and Redis evicts at any moment), so it keeps no index of it, only hints:

* **Reads.** A lookup whose prefix continues past what host and disk hold asks
  :meth:`RemoteTier.poll` how many more chunks every rank's shard exists for. The answer comes
  from a non-blocking :class:`RemoteProbe` (``None``: ask again). Present chunks are read
  into host slots by the workers (the fill path's ``Move.REMOTE_READ`` jobs) and verified there
  before anything is promised; a chunk that turns out gone or bad is a miss, counted by
  cause, and forgotten.
* **Writes.** A chunk stored in host memory, or a prompt's tail (found by the probe under its
  last block's key), is queued for the remote tier once admitted (``remote_admission``
  sightings), unless it is known to be there already (read from it, written before, or seen
  by a probe).
* **Reset.** ``reset_cache`` forgets the hints, never the shared data (replicas serve it).
**The probe** (:class:`RemoteProbe`): ask, never wait. A lookup runs on vLLM's scheduler
thread, where a network round trip would stall every request. So :meth:`RemoteProbe.poll`
only ever *starts* a probe (one pipelined ``batch_exists`` for every TP rank's shard of
every chunk key not yet known present) or *looks* at one (``Future.done()``), answering
``None`` ("ask again") meanwhile:

* answered: the number of leading chunks whose shards exist for every rank (a hole ends the
  prefix: a chunk is usable only if all ranks can load it);
* failed (store down, error, the store's own timeout) or still unanswered ``deadline_s``
  after it was sent: the prefix confirmed before this probe (0 for a request's first
  probe). A store that is failing or stalled would fail or stall the load too, so the
  lookup serves what host and disk hold rather than promising remote chunks.

Chunks seen present for every rank are remembered in a bounded LRU ("known present"), so requests
sharing a prefix probe only what they add. Absence is never remembered: another replica may write
the chunk at any moment. Known present is a hint, not a promise: the load re-reads and verifies
every shard, and a chunk gone meanwhile is recomputed. A prompt's tail: a prompt that ends inside a
chunk may find its last blocks in Redis as a tail entry, keyed by its last block's key (chunk keys
are the keys of their last block, so tails and chunks share one key space). The lookup passes the
block keys of that partial chunk (``tail``); the same pipelined call asks for them, and
:meth:`RemoteProbe.tail_blocks` answers how many leading blocks the longest tail every rank holds
covers. A hybrid model's tail is a whole slot's value (zeros in the rows it does not keep), read as
one (:attr:`RemoteTier.whole_slot_tails`); its lookup asks only for tails ending by its limit, since
such a tail serves a hit ending exactly at its end. Growing prompts: chunk keys are chained (a key
commits to every key before it), so a later call whose keys extend the earlier ones re-probes only
the new keys, and only if every earlier key was present (a hole already ends the prefix); keys that
do not extend them (the prompt changed) start the request over. One probe per request is in flight
at a time; the scheduler thread alone calls the probe (no locking), and on a step that computes
nothing it sleeps on the probes in flight (:meth:`RemoteProbe.wait`) rather than spin.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any, Protocol

from tieredkv.metrics.specs import Count, Counts
from tieredkv.protocol import FailureCause, Job, Move, StepPlan, Tier
from tieredkv.remote.codec import DEFAULT_PREFIX, RemoteKeyNames
from tieredkv.remote.results import BatchResult
from tieredkv.scheduler.lower_tier import LowerTier, Sightings

DEFAULT_KNOWN_CAPACITY = 1 << 16  # chunk keys; ~100 B each with the dict's overhead


class ExistsStore(Protocol):
    """What the probe needs of a store: :class:`~tieredkv.remote.ThreadedRemoteStore` fits."""

    def batch_exists(
        self, keys: Sequence[bytes], *, timeout_s: float | None = None
    ) -> Future[BatchResult[bool]]: ...


@dataclass(frozen=True)
class ProbeStats:
    """Counters since the last :meth:`RemoteProbe.take_stats` (for metrics): ``keys_probed``
    chunk keys sent (each is ``world_size`` Redis keys); ``known_hits`` chunk keys skipped,
    known present; ``timeouts`` probes given up at ``deadline_s``; ``failures`` probes that
    resolved with a failure, by cause; ``latency_s`` each answered probe's round trip."""

    probes: int = 0
    keys_probed: int = 0
    known_hits: int = 0
    answered: int = 0
    timeouts: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    latency_s: tuple[float, ...] = ()


@dataclass(slots=True)
class _Probe:
    future: Future[BatchResult[bool]]
    stop: int                # the probe covers keys[confirmed:stop]
    asked: list[int]         # indices sent (the rest of the range was known present)
    sent_at: float
    tail: list[bytes] = field(default_factory=list)  # tail candidates sent after the chunks


@dataclass(slots=True)
class _Request:
    keys: list[bytes]
    confirmed: int = 0       # leading keys present for every rank
    checked: int = 0         # leading keys with a verdict; confirmed < checked: a hole, final
    probe: _Probe | None = None
    tail: list[bytes] = field(default_factory=list)  # the partial chunk's block keys
    tail_blocks: int | None = 0  # blocks of the longest tail found; None: to ask


class RemoteProbe:
    """Answers "how many leading chunks does the remote tier hold?" without ever blocking."""

    def __init__(
        self,
        store: ExistsStore,
        fingerprint: bytes,
        world_size: int,
        *,
        prefix: str = DEFAULT_PREFIX,
        deadline_s: float,
        store_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        known_capacity: int = DEFAULT_KNOWN_CAPACITY,
    ) -> None:
        """``store_timeout_s`` bounds the store's own call (default ``deadline_s``)."""
        if world_size < 1 or deadline_s <= 0 or known_capacity < 0:
            raise ValueError("remote probe: world_size >= 1, deadline_s > 0, known_capacity >= 0")
        self._store = store
        self._world_size = world_size
        self._deadline_s = deadline_s
        self._store_timeout_s = deadline_s if store_timeout_s is None else store_timeout_s
        self._clock = clock
        self._capacity = known_capacity
        self._names = [RemoteKeyNames(fingerprint, r, prefix) for r in range(world_size)]
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._requests: dict[str, _Request] = {}
        self._counts: Counter[str] = Counter()
        self._failures: Counter[str] = Counter()
        self._latency: list[float] = []

    # -- the lookup's call ---------------------------------------------------------------------

    def poll(self, req_id: str, keys: Sequence[bytes], tail: Sequence[bytes] = ()) -> int | None:
        """Leading ``keys`` held remotely by every rank, or ``None``: ask again next step.

        ``tail``: the block keys of the partial chunk right after ``keys`` (in block order),
        asked in the same call; :meth:`tail_blocks` says what was found."""
        if not keys and not tail:
            return 0
        req = self._requests.get(req_id)
        if req is None or (keys and req.keys and not self._extends(req, keys)):
            req = self._requests[req_id] = _Request(list(keys))
        elif len(keys) > len(req.keys):
            req.keys.extend(keys[i] for i in range(len(req.keys), len(keys)))
        if list(tail) != req.tail:
            req.tail, req.tail_blocks = list(tail), (None if tail else 0)
        if req.probe is not None and not self._take_answer(req, req.probe):
            return None
        chunks_open = req.confirmed == req.checked < len(keys)
        if chunks_open or req.tail_blocks is None:
            self._send(req, len(keys) if chunks_open else req.checked)
            if req.probe is not None:
                return None
        return min(req.confirmed, len(keys))

    def tail_blocks(self, req_id: str) -> int:
        """Blocks of the longest tail of the request's ``tail`` keys that every rank holds (0:
        none, or not known): meaningful once :meth:`poll` answered."""
        req = self._requests.get(req_id)
        return req.tail_blocks or 0 if req is not None else 0

    def names(self, key: bytes) -> list[bytes]:
        """Every rank's Redis key of ``key``."""
        return [name(key) for name in self._names]

    def wait(self, timeout_s: float) -> bool:
        """Sleep (GIL released) until a probe in flight is answered, ``timeout_s`` at most."""
        pending = [req.probe.future for req in self._requests.values()
                   if req.probe is not None and not req.probe.future.done()]
        return bool(pending) and bool(wait_futures(pending, timeout_s, FIRST_COMPLETED).done)

    def in_flight(self, req_id: str) -> bool:
        """True while ``req_id``'s probe is sent and unanswered (the store's future not done)."""
        req = self._requests.get(req_id)
        return req is not None and req.probe is not None and not req.probe.future.done()

    @staticmethod
    def _extends(req: _Request, keys: Sequence[bytes]) -> bool:
        # Chained keys: the last key both lists have in common vouches for all before it.
        common = min(len(req.keys), len(keys))
        return req.keys[common - 1] == keys[common - 1]

    def _send(self, req: _Request, stop: int) -> None:
        """Probe keys[checked:stop] not known present, and the tail candidates if not asked
        yet, in one call; answered at once if nothing needs asking."""
        known, asked = self._known, []
        for i in range(req.checked, stop):
            if req.keys[i] in known:
                known.move_to_end(req.keys[i])
            else:
                asked.append(i)
        self._counts["known_hits"] += stop - req.checked - len(asked)
        tail = req.tail if req.tail_blocks is None else []
        if not asked and not tail:
            if req.confirmed == req.checked:  # every key known present (never past a hole)
                req.confirmed = req.checked = stop
            return
        names = [name(req.keys[i]) for i in asked for name in self._names]
        names += [name(key) for key in tail for name in self._names]
        future = self._store.batch_exists(names, timeout_s=self._store_timeout_s)
        self._counts["probes"] += 1
        self._counts["keys_probed"] += len(asked) + len(tail)
        req.probe = _Probe(future, stop, asked, self._clock(), list(tail))

    def _take_answer(self, req: _Request, probe: _Probe) -> bool:
        """Fold a finished (or overdue) probe into ``req``; False while it is still pending."""
        if not probe.future.done():
            if self._clock() - probe.sent_at < self._deadline_s:
                return False
            self._counts["timeouts"] += 1
            self._give_up(req, probe)
            return True
        future = probe.future  # done: nothing below waits
        if future.cancelled() or future.exception() is not None:  # not the store's contract
            result: BatchResult[bool] = BatchResult([], FailureCause.CANCELLED)
        else:
            result = future.result()
        if not result.ok:
            self._failures[str(result.cause)] += 1
            self._give_up(req, probe)
            return True
        self._counts["answered"] += 1
        self._latency.append(result.latency_s)
        ws, values = self._world_size, result.values
        first_hole = probe.stop
        for n, i in enumerate(probe.asked):  # ascending: the first miss is the hole
            if all(values[n * ws:(n + 1) * ws]):
                self._remember(req.keys[i])
            elif first_hole == probe.stop:
                first_hole = i
        if probe.asked or req.confirmed == req.checked:  # not a tail after a hole
            req.confirmed, req.checked = first_hole, probe.stop
        req.probe = None
        if probe.tail and probe.tail == req.tail:
            found = values[len(probe.asked) * ws:]
            req.tail_blocks = max((j + 1 for j in range(len(probe.tail))
                                   if all(found[j * ws:(j + 1) * ws])), default=0)
        return True

    def _give_up(self, req: _Request, probe: _Probe) -> None:
        """Serve what was confirmed before this probe; the request's remote prefix ends there."""
        if probe.asked:
            req.checked = probe.stop  # stop > confirmed: a hole, final
        req.probe = None
        if probe.tail:
            req.tail_blocks = 0

    def _remember(self, key: bytes) -> None:
        if self._capacity == 0:
            return
        self._known[key] = None
        self._known.move_to_end(key)
        while len(self._known) > self._capacity:
            self._known.popitem(last=False)

    # -- lifecycle and metrics -----------------------------------------------------------------

    def forget(self, req_id: str) -> None:
        """The request finished or was answered for good; a probe in flight is abandoned."""
        self._requests.pop(req_id, None)

    def answered(self, req_id: str) -> tuple[int, int] | None:
        """``(leading keys held, tail blocks)`` once ``req_id``'s probe is answered (folded in
        now if it just was); None while it is not, or for an unknown id. Never sends."""
        req = self._requests.get(req_id)
        if req is None or (req.probe is not None and not self._take_answer(req, req.probe)):
            return None
        return req.confirmed, req.tail_blocks or 0

    def reset(self) -> None:
        """Drop the known-present cache (vLLM's ``reset_cache``); answers given stay given."""
        self._known.clear()

    def known(self, key: bytes) -> bool:
        """Whether ``key`` was seen present for every rank (a hint; reads still verify)."""
        return key in self._known

    def unknow(self, key: bytes) -> None:
        """A read of ``key`` failed: stop believing it is there."""
        self._known.pop(key, None)

    def take_stats(self) -> ProbeStats:
        """The counters since the last call, then zero them."""
        c = self._counts
        stats = ProbeStats(
            probes=c["probes"], keys_probed=c["keys_probed"], known_hits=c["known_hits"],
            answered=c["answered"], timeouts=c["timeouts"], failures=dict(self._failures),
            latency_s=tuple(self._latency),
        )
        c.clear()
        self._failures.clear()
        self._latency = []
        return stats


def tail_keys(keys: Any, chunk: int, limit: int, computed: int, chunk_blocks: int,
              block_size: int, *, one_past: bool = True) -> tuple[bytes, ...]:
    """The block keys of ``chunk`` in block order, from its first block to the block holding
    ``limit`` (a tail is keyed by its last block: one ending on a block boundary holds that
    block, which the hit never covers, and every block before it), never its last (the whole
    chunk's key): where the remote tier may hold a tail. Empty when no tail there could
    serve a block past the ``computed`` tokens or keys are not block-granular.

    ``one_past=False`` (hybrid models): only the tails ending by ``limit``, since a hybrid
    tail serves a hit ending exactly at its end (one past the limit would hide the longest
    usable one)."""
    if not getattr(keys, "block_granular", False):
        return ()
    base = chunk * chunk_blocks
    usable_end = min(limit // block_size, base + chunk_blocks - 1)  # a hit's blocks end here
    if not one_past:
        usable_end = min(usable_end, keys.num_blocks)
    if usable_end <= max(base, computed // block_size):
        return ()
    stop = usable_end + 1 if one_past else usable_end
    return keys.block_keys(base, min(stop, keys.num_blocks, base + chunk_blocks - 1))


WRITTEN_CAPACITY = 1 << 16  # chunk keys this engine remembers writing
TAILS_CAPACITY = 4096  # tails found and not yet filled (see RemoteTier._tails)
# The probe's second request for a lookup (``req_id + INNER_TAIL``): a tail inside the
# prompt, asked once the whole chunks answered (see ``Lookup.lookup``).
INNER_TAIL = "\x00inner-tail"
INFO_INTERVAL_S = 5.0  # how often the server's memory and evictions are asked for (metrics)

# The server's own figures: used_memory, maxmemory, evicted_keys (None: down or failed).
ServerInfo = Callable[[], "Future[dict[str, int] | None]"]


class RemoteTier(LowerTier):
    """Probes, fills and write admission for the shared tier (the scheduler's thread only)."""

    name = Tier.REMOTE
    fill_move = Move.REMOTE_READ
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
        # Tails a lookup found, until their fill ends (bounded: one never filled is not popped).
        self._tails: OrderedDict[bytes, int] = OrderedDict()
        # A hybrid model's tails are whole-slot values (the planner says): read as a whole slot.
        self.whole_slot_tails = False
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

    def poll(self, req_id: str, keys: Sequence[bytes], tail: Sequence[bytes] = ()) -> int | None:
        """Leading ``keys`` every rank holds, 0 while down, or None (``tail``: see found_tail)."""
        if not keys and not tail:
            return 0
        if not self._is_up() and not self.probe.in_flight(req_id):
            self._skipped_down += 1  # known down: no call, no wait
            return 0
        return self.probe.poll(req_id, keys, tail)

    def found_tail(self, req_id: str, tail: Sequence[bytes]) -> tuple[bytes, int] | None:
        """The longest of ``tail`` every rank holds as ``(key, blocks)``, noted for its fill."""
        blocks = self.probe.tail_blocks(req_id) if self._is_up() else 0
        if not 0 < blocks <= len(tail):
            return None
        key = tail[blocks - 1]
        self._tails[key] = blocks
        self._tails.move_to_end(key)
        while len(self._tails) > TAILS_CAPACITY:
            self._tails.popitem(last=False)
        return key, blocks

    def forget(self, req_id: str) -> None:
        self.probe.forget(req_id)
        self.probe.forget(req_id + INNER_TAIL)

    def fill_aliases(self, key: bytes) -> None:
        return None  # the tier keeps none: the host entry takes the request's keys

    def fill_blocks(self, key: bytes) -> int | None:
        return self._tails.get(key)

    def plan_fill(self, plan: StepPlan, job_id: int, key: bytes, host_slot: int,
                  req_id: str) -> None:
        rows = 0 if self.whole_slot_tails else self._tails.get(key, 0)
        plan.jobs.append(Job.remote_read(job_id, key, host_slot, req_id=req_id, rows=rows))

    def fill_done(self, key: bytes, ok: bool) -> None:
        self._tails.pop(key, None)
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
        self._tails.clear()
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
