"""Remote jobs: host slots to and from the shared Redis/Valkey tier, one TP rank's shards.

Reads: ``batch_get_bounded`` calls answered by futures; ``on_answer`` tells the owner when
one can be polled. Redis is written by anyone who can reach it, so no read takes more than one
value's exact length per key (a planted 400 MiB value costs one value's bytes, and is a miss),
and the values out at once (sent, not yet landed) total at most ``read_batch_bytes``: reads
are cut into batches of half that, so one batch lands while the next is read, and reads past
it wait, in order, until earlier batches landed. A value that fills its slot is received
straight into it (the socket writes it there: no copy); it counts as landed only in
:meth:`RemoteJobs.poll`, outside the lock, once ``codec.decode`` proved it is this rank's shard
of this key in this namespace, of the exact payload length and checksum; anything else is a
miss with its cause, never promised. A slot stays *busy* until its read was polled and landed,
so the engine does not hand it to a new tenant that a late answer would overwrite. With
``on_answer`` set, answers are landed on a thread of this object's own, never on the store's
event loop (it would stop receiving the next batch meanwhile). A prompt's tail is a value of
only its own rows (rows 0..n-1 of every layer), received aside and copied into those rows. A
superseded tail's key may hold a pointer (``codec.next_hop``): its entry is read (slot still
busy) and verified, the tail's rows land; a pointer to nothing is deleted (if this rank writes).

Writes: each payload is encoded (copied) at call time, so the slot can be reused at once,
and offered to the store's bounded write queue. What does not fit, or arrives while the
store is down or closing, is dropped and counted: the shared tier is a bonus, never a
reason for the engine to wait on the network. A value holds only its entry's rows (a tail's
rows of every layer, never the slot's others, which hold a previous tenant's bytes). The
shorter tails an entry supersedes become pointers to it, once it is stored and only where
they exist (``SET XX``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from tieredkv.protocol import FailureCause, JobResult
from tieredkv.remote import codec
from tieredkv.remote.results import BatchResult
from tieredkv.transfer.host_pool import HostPool
from tieredkv.transfer.remote_rows import entry_payload, land_rows, rows_bytes

if TYPE_CHECKING:
    from tieredkv.remote.store import Head
    from tieredkv.remote.threaded import ThreadedRemoteStore

logger = logging.getLogger(__name__)

# (job id, chunk key, host slot, rows the value holds; 0: a whole slot): one read.
SlotJob = tuple[int, bytes, int, int]
# (job id, chunk key, host slot, rows of the slot the entry holds, rows it leaves empty, keys
# of the shorter tails of its chunk it supersedes): one write from a slot.
WriteJob = tuple[int, bytes, int, int, tuple[int, ...], tuple[bytes, ...]]
# Bytes of values one rank's reads hold at once (in flight or arrived, not yet landed).
READ_BATCH_BYTES = 128 << 20
# Bytes of values one read batch asks for at most: the first lands while later ones arrive.
READ_BATCH_TARGET = 4 << 20


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


class _Read(NamedTuple):
    """One read: ``rows`` its value holds, ``land`` those it lands (fewer: ``via`` a pointer)."""

    job_id: int
    key: bytes
    slot: int
    rows: int
    land: int
    via: tuple[bytes, bytes] | None = None  # (the pointer's key, its value)


@dataclass
class _Batch:
    """One bounded read: its jobs, Redis names and slots to receive into (None: a value to
    land by rows), in key order; ``future`` once sent."""

    jobs: list[_Read]
    names: list[bytes]
    into: list[memoryview | None]
    future: Future[BatchResult[Head | None]] | None = None


class RemoteJobs:
    """Reads and writes of one rank's chunk shards between a :class:`HostPool` and the store.
    Owns ``store`` (``close`` closes it). Thread-safe; meant for the engine's one thread."""

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
        slot_rows: int | None = None,
        read_batch_bytes: int = READ_BATCH_BYTES,
        writes: bool = True,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"remote read timeout must be positive, got {timeout_s}")
        if read_batch_bytes <= 0:
            raise ValueError(f"remote read batch bytes must be positive, got {read_batch_bytes}")
        self._redis_name = codec.RemoteKeyNames(fingerprint, rank, prefix)  # checks the ids once
        self.store = store
        self.host = host
        self.fingerprint = fingerprint
        self.rank = rank
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.writes = writes  # False: a read-only replica, which deletes no dangling pointer
        self.slot_rows = slot_rows  # a slot's rows (set by the driver); None: writes refused
        # (offset of row 0, bytes per row) of each layer's region in a slot, where an entry's
        # rows lie (set by the driver; (): tails and holes are refused).
        self.row_spans: tuple[tuple[int, int], ...] = ()
        self.value_len = codec.value_bytes(host.payload_bytes)  # the longest value a read accepts
        self._budget = read_batch_bytes
        # Two batches fit the budget (one lands while the next is read); a prompt's are several.
        self._batch_keys = max(1, min(read_batch_bytes // 2, READ_BATCH_TARGET) // self.value_len)
        self._lock = threading.Lock()
        self._batches: list[_Batch] = []  # sent, not yet taken by a poll
        self._landing = 0  # values taken by a poll, not landed yet (their buffers still held)
        self._landed = threading.Condition(self._lock)  # notified whenever some landed
        self._unsent: deque[_Batch] = deque()  # waiting for the batch before them
        self._busy: set[int] = set()
        self._ready: list[JobResult] = []  # failed before reaching the network
        # Called (on this object's landing thread, or the caller's) once an answer can be polled.
        self.on_answer: Callable[[], None] | None = None
        self._wake = threading.Condition(self._lock)  # the landing thread's
        self._woken = False
        self._stopping = False
        self._lander: threading.Thread | None = None
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

    def start_reads(self, reads: Sequence[SlotJob]) -> None:
        """Ask for every ``(job_id, key, slot)`` in bounded batches; never blocks.

        A slot out of range, busy with another read, or named twice, or rows no slot has,
        fails ``copy_error``;
        a malformed key fails ``unknown`` (a bug upstream, logged). Results come from ``poll``.
        """
        jobs: list[_Read] = []
        names: list[bytes] = []
        with self._lock:
            for job_id, key, slot, rows in reads:
                if not self._usable(slot) or self._rows_bytes(rows) is None:
                    self._ready.append(self._read_failed(job_id, FailureCause.COPY_ERROR))
                    continue
                try:
                    names.append(self._redis_name(key))
                except ValueError as exc:
                    logger.error("tieredkv remote read %d: %s", job_id, exc)
                    self._ready.append(self._read_failed(job_id, FailureCause.UNKNOWN))
                    continue
                self._busy.add(slot)
                jobs.append(_Read(job_id, key, slot, rows, rows))
            self._unsent.extend(self._cut(jobs, names))
            sent = self._send_locked()
            answered = bool(self._ready)
        callback = self.on_answer  # called outside the lock: it polls
        if callback is not None and answered:
            callback()
        self._watch(sent)

    def _cut(self, jobs: list[_Read], names: list[bytes]) -> list[_Batch]:
        """Reads as batches of at most ``_batch_keys`` values, in order; a value that fills
        its slot whole is received straight into it (its header aside), not copied there."""
        n, size = self._batch_keys, self.host.payload_bytes
        into = [self.host.slot_memoryview(read.slot)[:size] if read.land == read.rows
                and self._rows_bytes(read.rows) == size else None for read in jobs]
        return [_Batch(jobs[i:i + n], names[i:i + n], into[i:i + n])
                for i in range(0, len(jobs), n)]

    def _send_locked(self) -> list[Future[BatchResult[Head | None]]]:
        """Send batches in order while the values out (sent, not yet landed) fit in
        ``read_batch_bytes``; one batch always may go (it was cut to fit)."""
        sent = []
        out = (sum(len(batch.jobs) for batch in self._batches) + self._landing) * self.value_len
        while self._unsent:
            size = len(self._unsent[0].jobs) * self.value_len
            if out and out + size > self._budget:
                break
            batch = self._unsent.popleft()
            batch.future = self.store.batch_get_bounded(
                batch.names, self.value_len, timeout_s=self.timeout_s, into=batch.into,
                into_offset=codec.HEADER_BYTES)
            self._batches.append(batch)
            sent.append(batch.future)
            out += size
        return sent

    def _watch(self, sent: list[Future[BatchResult[Head | None]]]) -> bool:
        """Have the landing thread call ``on_answer`` when a sent batch is answered (outside
        the lock). Without a callback: True if one is answered already (the caller polls
        again)."""
        if self.on_answer is None:
            return any(future.done() for future in sent)
        for future in sent:
            future.add_done_callback(self._wake_lander)
        return False

    def _wake_lander(self, _answered: object = None) -> None:
        """Have ``on_answer`` called on the landing thread (started at first); only signals."""
        with self._lock:
            self._woken = True
            if self._lander is None and not self._stopping:
                self._lander = threading.Thread(target=self._land_answers, daemon=True,
                                                name="tieredkv-remote-land")
                self._lander.start()
            self._wake.notify()
            stopped = self._stopping and not (self._lander and self._lander.is_alive())
        callback = self.on_answer
        if stopped and callback is not None:  # closed: no thread lands for it any more
            callback()

    def _land_answers(self) -> None:
        """The landing thread: ``on_answer`` (which polls, so lands) each time one came."""
        while True:
            with self._lock:
                self._wake.wait_for(lambda: self._woken or self._stopping)
                if not self._woken:
                    return
                self._woken = False
            callback = self.on_answer
            try:
                if callback is not None:
                    callback()
            except Exception:  # noqa: BLE001 - the owner's bug; keep landing the next answers
                logger.exception("tieredkv remote tier: on_answer raised")

    def poll(self) -> list[JobResult]:
        """Results of reads answered since the last poll; verified values land in their slots.

        Never blocks on the network and never raises. A value that is absent or failed to
        arrive reads as a miss with the batch's cause (``timeout``, ``io_error``,
        ``unavailable``, ``cancelled``). The batches that may go out while answered ones land
        are sent first; each landed batch sends the next.
        """
        out: list[JobResult] = []
        while True:
            with self._lock:
                stopping = self._stopping
                out += self._ready
                self._ready = []
                arrived: list[_Batch] = []
                waiting: list[_Batch] = []
                for batch in self._batches:
                    assert batch.future is not None
                    (arrived if batch.future.done() else waiting).append(batch)
                self._batches = waiting
                self._landing += sum(len(batch.jobs) for batch in arrived)
                sent = self._send_locked()
            again = self._watch(sent)
            for batch in arrived:  # outside the lock: verify and copy (the slots stay busy)
                out += self._finish(batch)
            # With a landing thread, report what landed now: it polls again for what arrived
            # meanwhile (each sent batch wakes it), so a request whose chunks landed first is
            # not held back by the stream. Closing (or no thread): take everything.
            if (not arrived and not again) or (arrived and self.on_answer is not None and not stopping):
                return out

    def _finish(self, batch: _Batch) -> list[JobResult]:
        """Land one taken batch (outside the lock), then free its slots and budget."""
        assert batch.future is not None
        result = None
        try:
            result = batch.future.result(0)
            values, cause = result.values, result.cause
            if len(values) != len(batch.jobs):
                raise ValueError(f"{len(values)} values for {len(batch.jobs)} keys")
        except Exception:  # noqa: BLE001 - the store answers one value per key; this is a bug
            logger.exception("tieredkv remote tier: a read batch went wrong")
            values, cause = [None] * len(batch.jobs), FailureCause.UNKNOWN
        landed: list[tuple[JobResult, int] | _Read] = []
        try:
            for read, value in zip(batch.jobs, values, strict=True):
                landed.append(self._land(read, value, cause))
        except Exception:  # noqa: BLE001 - a bug in landing: the rest are misses, never lost
            logger.exception("tieredkv remote tier: landing a read batch went wrong")
            for read in batch.jobs[len(landed):]:
                landed.append((JobResult.fail(read.job_id, FailureCause.UNKNOWN), 0))
        batch.future = None  # its values' buffers go back to the store's pool
        del values, result
        out: list[JobResult] = []
        follows = [item for item in landed if isinstance(item, _Read)]
        with self._lock:
            for read, item in zip(batch.jobs, landed, strict=True):
                if isinstance(item, _Read):
                    continue  # its slot stays busy: the entry it points to is read next
                self._busy.discard(read.slot)
                job_result, size = item
                out.append(job_result)
                if job_result.ok:
                    self._reads_ok += 1
                    self._bytes_read += size
                else:
                    self._reads_failed[(job_result.failure or FailureCause.UNKNOWN).value] += 1
            self._landing -= len(batch.jobs)
            if follows:  # ahead of reads not sent yet: these requests waited a round trip
                names = [self._redis_name(read.key) for read in follows]
                self._unsent.extendleft(reversed(self._cut(follows, names)))
            self._landed.notify_all()
            sent = self._send_locked()
        self._watch(sent)  # a poll after this one lands what is answered already
        return out

    def _rows_bytes(self, rows: int) -> int | None:
        return rows_bytes(rows, self.slot_rows, self.row_spans, self.host.payload_bytes)

    def _land(
        self, read: _Read, value: Head | None, cause: FailureCause | None,
    ) -> tuple[JobResult, int] | _Read:
        """Verify one value and copy its rows into the slot, or fail with the reason it is
        unusable: the result and the payload bytes landed (counted by the caller, under the
        lock), or the read to send next when a tail's key holds a pointer."""
        job_id = read.job_id
        if value is None and cause is not None:
            # The call (or its item) failed: a miss by the call's cause, not ``missing``.
            return JobResult.fail(job_id, cause), 0
        if value is None and read.via is not None and self.writes:  # a dangling pointer (kept
            self.store.batch_delete(  # if another writer replaced it since)
                [self._redis_name(read.via[0])], if_equal=[read.via[1]])
        size = self._rows_bytes(read.rows)
        assert size is not None  # start_reads and _follow refused the others
        if value is not None and codec.is_pointer(value.data):
            return self._follow(read, value)
        decoded = codec.decode(
            None if value is None else value.data, fingerprint=self.fingerprint, key=read.key,
            rank=self.rank, expected_len=size, value_len=None if value is None else value.length,
            payload=None if value is None else value.rest)
        if isinstance(decoded, codec.Rejected):
            logger.debug("tieredkv remote read %d rejected: %s", job_id, decoded.detail)
            return JobResult.fail(job_id, decoded.cause), 0
        if len(decoded.payload) != size:  # decode checked it; never copy more than a slot
            return JobResult.fail(job_id, FailureCause.SHORT_READ), 0
        if value is not None and value.rest is not None:  # received in the slot: verified there
            return JobResult.done(job_id), size
        target = np.frombuffer(self.host.slot_memoryview(read.slot), dtype=np.uint8)
        source = np.frombuffer(decoded.payload, dtype=np.uint8)
        if read.land == read.rows and size == self.host.payload_bytes:
            np.copyto(target[:size], source)
        else:  # a tail's rows of each layer, from a tail's packed value or a whole slot's
            land_rows(target, source, read.land,
                      None if size == self.host.payload_bytes else read.rows, self.row_spans)
        return JobResult.done(job_id), self._rows_bytes(read.land) or size

    def _follow(self, read: _Read, value: Head) -> tuple[JobResult, int] | _Read:
        """A tail's key holds a pointer: the read of the longer entry it names, or a miss."""
        hop = codec.next_hop(value.data, fingerprint=self.fingerprint, key=read.key,
                             rank=self.rank, rows=read.rows, slot_rows=self.slot_rows or 0,
                             value_len=value.length)
        if isinstance(hop, codec.Pointer):
            return _Read(read.job_id, hop.target, read.slot, hop.rows, read.land,
                         (read.key, bytes(value.data[:codec.POINTER_BYTES])))
        logger.debug("tieredkv remote read %d rejected: %s", read.job_id, hop.detail)
        return JobResult.fail(read.job_id, hop.cause), 0

    # -- writes ------------------------------------------------------------------------------

    def write(self, writes: Sequence[WriteJob]) -> list[JobResult]:
        """Queue each ``(job_id, key, slot, rows, holes, supersedes)``'s payload for the
        store; never blocks.

        Accepted: ``done`` (queued, not yet stored); no room or store down/closing: ``dropped``.
        A slot out of range or still being read into fails ``copy_error``. Every row of a
        value is the entry's own: an entry that holds fewer than all ``slot_rows`` rows (a
        prompt's tail) sends only those rows of each layer (its slot's other rows hold
        whatever the slot held before), the rows it leaves empty (``holes``) are written as
        zeros, and a write naming rows the value cannot hold fails ``wrong_key``. Once the
        value is stored, each of ``supersedes`` (keys of shorter tails of its chunk) that
        Redis holds becomes a pointer to it.
        """
        size = self.host.payload_bytes
        out: list[JobResult] = []
        queued: list[tuple[int, bytes, bytes, tuple[tuple[bytes, bytes], ...]]] = []
        payload_bytes: list[int] = []
        with self._lock:
            for job_id, key, slot, rows, holes, supersedes in writes:
                if not self._usable(slot):
                    self._writes_failed[FailureCause.COPY_ERROR.value] += 1
                    out.append(JobResult.fail(job_id, FailureCause.COPY_ERROR))
                    continue
                try:
                    payload = entry_payload(self.host.slot_memoryview(slot)[:size], rows, holes,
                                            self.slot_rows, self.row_spans)
                    if payload is None:
                        logger.error(
                            "tieredkv remote write %d refused: its entry holds %d of the slot's "
                            "%s rows (%d empty); the others are not its own", job_id, rows,
                            self.slot_rows, len(holes))
                        self._writes_failed[FailureCause.WRONG_KEY.value] += 1
                        out.append(JobResult.fail(job_id, FailureCause.WRONG_KEY))
                        continue
                    value = codec.encode(payload, fingerprint=self.fingerprint, key=key, rank=self.rank)
                    pointers = tuple(
                        (self._redis_name(old), codec.encode_pointer(
                            fingerprint=self.fingerprint, key=old, rank=self.rank, target=key,
                            rows=rows)) for old in supersedes)
                    queued.append((job_id, self._redis_name(key), value, pointers))
                    payload_bytes.append(len(payload))
                except ValueError as exc:
                    logger.error("tieredkv remote write %d: %s", job_id, exc)
                    self._writes_failed[FailureCause.UNKNOWN.value] += 1
                    out.append(JobResult.fail(job_id, FailureCause.UNKNOWN))
        accepted = 0
        if queued:
            accepted = self.store.submit_writes([(n, v, p) for _, n, v, p in queued], self.ttl_s)
        with self._lock:
            self._writes_ok += accepted
            self._bytes_written += sum(payload_bytes[:accepted])
            self._writes_dropped += len(queued) - accepted
        # The queue keeps a prefix of each offer: the first ``accepted`` went in.
        out += [JobResult.done(j) for j, *_ in queued[:accepted]]
        out += [JobResult.fail(j, FailureCause.DROPPED) for j, *_ in queued[accepted:]]
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
        it could not answer as ``cancelled`` (and answers batches not sent yet so at once).
        Batches another thread is landing finish there (through ``on_answer``), waited for
        within ``timeout_s`` (landing is local work), so after this no slot is busy.
        """
        deadline = time.monotonic() + timeout_s
        self.store.close(timeout_s)
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
            lander = self._lander
        out = self.poll()
        with self._lock:
            if not self._landed.wait_for(lambda: not self._landing,
                                         max(0.0, deadline - time.monotonic())):
                logger.warning("tieredkv remote tier: reads still landing at close")
        if lander is not None and lander is not threading.current_thread():
            lander.join(max(0.0, deadline - time.monotonic()))
        return out
