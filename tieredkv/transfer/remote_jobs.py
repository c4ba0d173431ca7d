"""Remote jobs: host slots to and from the shared Redis/Valkey tier, one TP rank's shards.

Reads: one ``batch_get`` per batch, answered by a future; ``on_answer`` tells the owner when
one can be polled. A value reaches its host slot only in :meth:`RemoteJobs.poll`, and only once
``codec.decode`` proved it is this rank's shard of this key in this namespace, of the exact
payload length and checksum; anything else leaves the slot alone and is a miss with its
cause. A slot stays *busy* until its read was polled, so the engine does not hand it to a
new tenant that the late answer would overwrite.

Writes: each payload is encoded (copied) at call time, so the slot can be reused at once,
and offered to the store's bounded write queue. What does not fit, or arrives while the
store is down or closing, is dropped and counted: the shared tier is a bonus, never a
reason for the engine to wait on the network.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tieredkv.protocol import FailureCause, JobResult
from tieredkv.remote.codec import Rejected, RemoteKeyNames, decode, encode
from tieredkv.remote.results import BatchResult
from tieredkv.transfer.host_pool import HostPool

if TYPE_CHECKING:
    from tieredkv.remote.threaded import ThreadedRemoteStore

logger = logging.getLogger(__name__)

# (job id, chunk key, host slot): one read into, or one write from, a host slot.
SlotJob = tuple[int, bytes, int]


@dataclass(frozen=True)
class RemoteJobStats:
    """Counters since the last :meth:`RemoteJobs.take_stats`.

    ``bytes_written`` counts payload bytes accepted into the write queue; whether Redis then
    took them is the store's ``writes_done``/``writes_failed``.
    """

    reads_ok: int = 0
    reads_failed: dict[str, int] = field(default_factory=dict)  # by cause
    bytes_read: int = 0
    writes_ok: int = 0
    writes_dropped: int = 0
    writes_failed: dict[str, int] = field(default_factory=dict)  # by cause, ``dropped`` aside
    bytes_written: int = 0


@dataclass
class _Batch:
    """One ``batch_get`` in flight and the jobs waiting on it, in key order."""

    future: Future[BatchResult[bytes | None]]
    jobs: list[SlotJob]


class RemoteJobs:
    """Reads and writes of one rank's chunk shards between a :class:`HostPool` and the store.

    Owns ``store`` (``close`` closes it). Thread-safe; meant for the engine's one thread.
    """

    def __init__(
        self,
        store: ThreadedRemoteStore,
        host: HostPool,
        *,
        fingerprint: bytes,
        rank: int,
        prefix: str,
        ttl_s: float | None,
        timeout_s: float,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"remote read timeout must be positive, got {timeout_s}")
        self._redis_name = RemoteKeyNames(fingerprint, rank, prefix)  # checks the ids once
        self.store = store
        self.host = host
        self.fingerprint = fingerprint
        self.rank = rank
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._batches: list[_Batch] = []
        self._busy: set[int] = set()
        self._ready: list[JobResult] = []  # failed before reaching the network
        # Called (on the store's thread, or the caller's) once a read's answer can be polled.
        self.on_answer: Callable[[], None] | None = None
        self._reset()

    def _reset(self) -> None:
        self._reads_ok = 0
        self._reads_failed: Counter[str] = Counter()
        self._bytes_read = 0
        self._writes_ok = 0
        self._writes_dropped = 0
        self._writes_failed: Counter[str] = Counter()
        self._bytes_written = 0

    def _usable(self, slot: int) -> bool:
        return 0 <= slot < self.host.num_slots and slot not in self._busy

    def _read_failed(self, job_id: int, cause: FailureCause) -> JobResult:
        self._reads_failed[cause.value] += 1
        return JobResult.fail(job_id, cause)

    # -- reads -------------------------------------------------------------------------------

    def busy_slots(self) -> frozenset[int]:
        """Slots a read still owns (until its answer was polled): not to be reused yet."""
        with self._lock:
            return frozenset(self._busy)

    def start_reads(self, reads: Sequence[SlotJob]) -> None:
        """Ask for every ``(job_id, key, slot)`` in one ``batch_get``; never blocks.

        A slot out of range, busy with another read, or named twice fails ``copy_error``;
        a malformed key fails ``unknown`` (a bug upstream, logged). Results come from ``poll``.
        """
        jobs: list[SlotJob] = []
        names: list[bytes] = []
        with self._lock:
            for job_id, key, slot in reads:
                if not self._usable(slot):
                    self._ready.append(self._read_failed(job_id, FailureCause.COPY_ERROR))
                    continue
                try:
                    names.append(self._redis_name(key))
                except ValueError as exc:
                    logger.error("tieredkv remote read %d: %s", job_id, exc)
                    self._ready.append(self._read_failed(job_id, FailureCause.UNKNOWN))
                    continue
                self._busy.add(slot)
                jobs.append((job_id, key, slot))
            future = None
            if jobs:
                future = self.store.batch_get(names, timeout_s=self.timeout_s)
                self._batches.append(_Batch(future, jobs))
        callback = self.on_answer  # called outside the lock: it polls
        if callback is not None and self._ready:
            callback()
        if callback is not None and future is not None:
            future.add_done_callback(lambda _answered: callback())

    def poll(self) -> list[JobResult]:
        """Results of reads answered since the last poll; verified values land in their slots.

        Never blocks and never raises. A value that is absent or failed to arrive reads as a
        miss with the batch's cause (``timeout``, ``io_error``, ``unavailable``, ``cancelled``).
        """
        with self._lock:
            out, self._ready = self._ready, []
            waiting: list[_Batch] = []
            for batch in self._batches:
                if batch.future.done():
                    out += self._finish(batch)
                else:
                    waiting.append(batch)
            self._batches = waiting
        return out

    def _finish(self, batch: _Batch) -> list[JobResult]:
        try:
            result = batch.future.result(0)
            values, cause = result.values, result.cause
            if len(values) != len(batch.jobs):
                raise ValueError(f"{len(values)} values for {len(batch.jobs)} keys")
        except Exception:  # noqa: BLE001 - the store answers one value per key; this is a bug
            logger.exception("tieredkv remote tier: a read batch went wrong")
            values, cause = [None] * len(batch.jobs), FailureCause.UNKNOWN
        out = []
        for (job_id, key, slot), value in zip(batch.jobs, values, strict=True):
            self._busy.discard(slot)
            out.append(self._land(job_id, key, slot, value, cause))
        return out

    def _land(
        self, job_id: int, key: bytes, slot: int, value: bytes | None, cause: FailureCause | None
    ) -> JobResult:
        """Verify one value and copy it into its slot, or fail with the reason it is unusable."""
        if value is None and cause is not None:
            # The call (or its item) failed: a miss by the call's cause, not ``missing``.
            return self._read_failed(job_id, cause)
        size = self.host.payload_bytes
        decoded = decode(value, fingerprint=self.fingerprint, key=key, rank=self.rank,
                         expected_len=size)
        if isinstance(decoded, Rejected):
            logger.debug("tieredkv remote read %d rejected: %s", job_id, decoded.detail)
            return self._read_failed(job_id, decoded.cause)
        if len(decoded.payload) != size:  # decode checked it; never copy more than a slot
            return self._read_failed(job_id, FailureCause.SHORT_READ)
        self.host.slot_memoryview(slot)[:size] = decoded.payload
        self._reads_ok += 1
        self._bytes_read += size
        return JobResult.done(job_id)

    # -- writes ------------------------------------------------------------------------------

    def write(self, writes: Sequence[SlotJob]) -> list[JobResult]:
        """Queue each ``(job_id, key, slot)``'s payload for the store; never blocks.

        Accepted: ``done`` (queued, not yet stored); no room or store down/closing: ``dropped``.
        A slot out of range or still being read into fails ``copy_error``.
        """
        size = self.host.payload_bytes
        out: list[JobResult] = []
        queued: list[tuple[int, bytes, bytes]] = []
        with self._lock:
            for job_id, key, slot in writes:
                if not self._usable(slot):
                    self._writes_failed[FailureCause.COPY_ERROR.value] += 1
                    out.append(JobResult.fail(job_id, FailureCause.COPY_ERROR))
                    continue
                try:
                    payload = self.host.slot_memoryview(slot)[:size]
                    value = encode(payload, fingerprint=self.fingerprint, key=key, rank=self.rank)
                    queued.append((job_id, self._redis_name(key), value))
                except ValueError as exc:
                    logger.error("tieredkv remote write %d: %s", job_id, exc)
                    self._writes_failed[FailureCause.UNKNOWN.value] += 1
                    out.append(JobResult.fail(job_id, FailureCause.UNKNOWN))
        accepted = 0
        if queued:
            accepted = self.store.submit_writes([(n, v) for _, n, v in queued], self.ttl_s)
        with self._lock:
            self._writes_ok += accepted
            self._bytes_written += accepted * size
            self._writes_dropped += len(queued) - accepted
        # The queue keeps a prefix of each offer: the first ``accepted`` went in.
        out += [JobResult.done(j) for j, _, _ in queued[:accepted]]
        out += [JobResult.fail(j, FailureCause.DROPPED) for j, _, _ in queued[accepted:]]
        return out

    def flush_writes(self, timeout_s: float) -> bool:
        """Block until queued writes are done (tests, orderly shutdown; never the hot path)."""
        try:
            return bool(self.store.flush_writes(timeout_s).result(timeout_s + 1.0))
        except TimeoutError:
            return False

    # -- counters and shutdown ---------------------------------------------------------------

    def take_stats(self) -> RemoteJobStats:
        """The counters since the last call, which resets them."""
        with self._lock:
            stats = RemoteJobStats(
                reads_ok=self._reads_ok, reads_failed=dict(self._reads_failed),
                bytes_read=self._bytes_read, writes_ok=self._writes_ok,
                writes_dropped=self._writes_dropped, writes_failed=dict(self._writes_failed),
                bytes_written=self._bytes_written,
            )
            self._reset()
        return stats

    def close(self, timeout_s: float = 2.0) -> list[JobResult]:
        """Close the store within ~``timeout_s`` (queued writes are dropped, counted by it).

        Returns the results of every read still outstanding: the store resolves the futures
        it could not answer as ``cancelled``, so after this no slot is busy.
        """
        self.store.close(timeout_s)
        return self.poll()
