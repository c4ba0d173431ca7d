"""remote_throughput's tieredkv GET: the worker's real read path, not a re-implementation.

A pass drives :class:`~tieredkv.transfer.remote_driver.RemoteDriver` the way the transfer
engine does: ``submit_reads`` of ``Job.remote_read`` entries, the driver's ``pump`` as
:class:`~tieredkv.transfer.remote_jobs.RemoteJobs`' ``on_answer`` (answers landed on its own
thread while the store's thread receives the next batch), the engine's default read budget,
every value received into (a whole chunk's: straight into) and verified by ``codec.decode`` in
a slot of a real :class:`~tieredkv.transfer.host_pool.HostPool`. Only the engine itself is replaced, by
:class:`PassRuntime`, which records each job's one result the way ``TransferEngine.finish``
does and wakes the pass when a prompt's reads are all answered.

Concurrency is raw redis-py's: one prompt (one batch of the case, ``shard.batch`` chunk
reads) per ``submit_reads`` call, ``clients`` prompts outstanding, the next one submitted as
soon as one has all its answers; RemoteJobs then cuts and paces the reads as it does for
users. The store is this reader's own (a worker rank's store is its own too).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from benchmarks.remote.workload import CALL_TIMEOUT_S, FINGERPRINT, PREFIX, RANK, BenchError, Case
from tieredkv.protocol import FailureCause, Job, JobResult, Move
from tieredkv.remote.threaded import ThreadedRemoteStore
from tieredkv.remote_url import RemoteURL
from tieredkv.transfer.host_pool import HostPool, SlotGuard
from tieredkv.transfer.remote_driver import RemoteDriver
from tieredkv.transfer.remote_jobs import RemoteJobs
from tieredkv.transfer.runtime import Entry, TransferStats

BLOCK_TOKENS = 16  # vLLM's default block size: a chunk's rows


@dataclass
class ReadPass:
    """One GET pass as the worker saw it: what RemoteJobs landed and what it refused."""

    seconds: float
    reads: int
    reads_ok: int  # RemoteJobs' own count of values verified in a slot
    bytes_landed: int  # payload bytes RemoteJobs landed in host slots
    failed: dict[str, int] = field(default_factory=dict)  # by cause, as the engine sees them

    def check(self, case: Case) -> None:
        """Raise unless every read landed: a failed job is reported, never counted as moved."""
        want = case.count("get")
        if self.failed or self.reads_ok != want or self.bytes_landed != want * case.shard.payload_bytes:
            raise BenchError(
                f"tieredkv get: {sum(self.failed.values())} of {self.reads} reads failed "
                f"{dict(self.failed)}; RemoteJobs landed {self.reads_ok} values, "
                f"{self.bytes_landed} payload bytes (want {want})")


class PassRuntime:
    """The engine as the remote driver sees it (``stats`` and ``finish``), for one pass at a
    time: counts results by cause and tells the pass which lane's prompt is complete."""

    def __init__(self, batch: int) -> None:
        self.stats = TransferStats()
        self.closed = False
        self._batch = batch
        self._cond = threading.Condition()
        self._left: dict[int, int] = {}  # lane -> reads of its prompt not answered yet
        self._complete: list[int] = []
        self._seen: set[int] = set()
        self.failed: Counter[str] = Counter()

    def start(self, lane: int, reads: int) -> None:
        with self._cond:
            self._left[lane] = reads

    def finish(self, entry: Entry, result: JobResult) -> None:
        """Record a job's one result (as ``TransferEngine.finish``: later ones are ignored)."""
        with self._cond:
            if result.job_id in self._seen:
                return
            self._seen.add(result.job_id)
            if not result.ok:
                self.failed[(result.failure or FailureCause.UNKNOWN).value] += 1
            lane = entry.job.host_slot // self._batch
            self._left[lane] -= 1
            if not self._left[lane]:
                self._complete.append(lane)
                self._cond.notify_all()
        self.stats.finished(entry.job.move, result, time.monotonic() - entry.t0)

    def wait_complete(self, timeout_s: float) -> list[int]:
        """Lanes whose prompt got every answer since the last call (waits for one)."""
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._complete), timeout_s):
                raise BenchError(f"tieredkv get: no prompt completed in {timeout_s:.0f} s "
                                 f"(reads left per lane: {self._left})")
            done, self._complete = self._complete, []
            return done

    def reset(self) -> None:
        with self._cond:
            self._left.clear()
            self._complete.clear()
            self._seen.clear()
            self.failed.clear()


class WorkerReads:
    """One case's reader: a store of its own, RemoteJobs with the engine's defaults, and a
    HostPool of ``clients`` prompts' slots (written once, so a pass times the copy, not the
    kernel mapping fresh pages)."""

    def __init__(self, url: RemoteURL, case: Case, clients: int) -> None:
        shard = case.shard
        self.case, self.clients = case, clients
        self.store = ThreadedRemoteStore(url, thread_name="bench-tieredkv-reads",
                                         timeout_s=CALL_TIMEOUT_S, connect_timeout_s=10.0,
                                         socket_timeout_s=CALL_TIMEOUT_S,
                                         write_timeout_s=CALL_TIMEOUT_S)
        self.host = HostPool(clients * shard.batch, shard.payload_bytes)
        try:
            self.host.buffer.fill_(1)
            self.jobs = RemoteJobs(self.store, self.host, fingerprint=FINGERPRINT, rank=RANK,
                                   prefix=PREFIX, ttl_s=None, timeout_s=CALL_TIMEOUT_S)
            self.runtime = PassRuntime(shard.batch)
            self.driver = RemoteDriver(self.jobs, SlotGuard(), self.runtime, shard.payload_bytes,
                                       chunk_rows=max(1, shard.tokens // BLOCK_TOKENS))
        except BaseException:
            self.store.close(5.0)
            self.host.close()
            raise
        self._ids = itertools.count()

    def wait_connected(self, timeout_s: float) -> bool:
        """Wait for the store's first connection (the engine itself never waits)."""
        deadline = time.monotonic() + timeout_s
        while not self.store.up and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.store.up

    def _submit(self, lane: int, indices: list[int] | range) -> None:
        case, now = self.case, time.monotonic()
        entries = []
        for position, i in enumerate(indices):
            job_id = next(self._ids)
            slot = lane * case.shard.batch + position
            entries.append(Entry(job_id, Job.remote_read(job_id, case.chunk_keys[i], slot), now))
        self.runtime.start(lane, len(entries))
        self.driver.submit_reads(entries)

    def run_pass(self) -> ReadPass:
        """Read every key of the case once, ``clients`` prompts outstanding."""
        prompts = iter(self.case.batches("get"))
        self.jobs.take_stats()
        self.runtime.stats.take({})
        self.runtime.reset()
        busy = 0
        start = time.perf_counter()
        for lane, indices in zip(range(self.clients), prompts, strict=False):
            self._submit(lane, indices)
            busy += 1
        while busy:
            for lane in self.runtime.wait_complete(CALL_TIMEOUT_S):
                busy -= 1
                following = next(prompts, None)
                if following is not None:
                    self._submit(lane, following)
                    busy += 1
        seconds = time.perf_counter() - start
        landed = self.jobs.take_stats()
        moved = self.runtime.stats.take({})
        if moved["bytes"][Move.REMOTE_READ.direction] != landed.reads_ok * self.case.shard.payload_bytes:
            raise BenchError(f"tieredkv get: the driver counted {moved['bytes']} bytes, "
                             f"RemoteJobs {landed.reads_ok} values")
        return ReadPass(seconds, self.case.count("get"), landed.reads_ok, landed.bytes_read,
                        dict(self.runtime.failed))

    def rate(self) -> float:
        """Reads per second of one pass; raises if any read failed."""
        result = self.run_pass()
        result.check(self.case)
        return result.reads / result.seconds

    def close(self) -> None:
        """Close the driver (and so RemoteJobs and its store), then free the host slots."""
        try:
            self.driver.close(10.0)
        finally:
            self.host.close()
