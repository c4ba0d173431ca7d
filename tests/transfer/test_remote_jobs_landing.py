"""RemoteJobs as the engine drives it: answers reported through ``on_answer`` (on the landing
thread), reads past the batch budget sent from there, each landed batch reported before the
next lands, and every job answered exactly once."""

from __future__ import annotations

import hashlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import pytest

from tests.helpers import HANG_S, finishes, make_key
from tests.remote.remote_helpers import FAST, RedisServer, wait_up
from tieredkv.protocol import FailureCause, JobResult
from tieredkv.remote.codec import HEADER_BYTES, encode
from tieredkv.remote.results import BatchResult
from tieredkv.remote.store import Head
from tieredkv.remote.threaded import ThreadedRemoteStore
from tieredkv.remote_url import parse_remote_url
from tieredkv.transfer.host_pool import HostPool
from tieredkv.transfer.remote_jobs import RemoteJobs

FINGERPRINT = hashlib.sha256(b"tieredkv tests/transfer remote landing").digest()
PAYLOAD = 5000
SLOTS = 8
SENTINEL = 0xAB


def payload(i: int) -> bytes:
    seed = hashlib.blake2b(b"%d" % i, digest_size=64).digest()
    return (seed * (PAYLOAD // 64 + 1))[:PAYLOAD]


class Answers:
    """The engine's side of ``on_answer``: polls on whichever thread is told, keeps every
    result, and fails the test on a job answered twice."""

    def __init__(self, jobs: RemoteJobs) -> None:
        self.jobs = jobs
        self.results: dict[int, JobResult] = {}
        self.twice: list[int] = []
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        jobs.on_answer = self.pump

    def pump(self) -> None:
        self.take(self.jobs.poll())

    def take(self, results: list[JobResult]) -> None:
        with self._changed:
            for result in results:
                if result.job_id in self.results:
                    self.twice.append(result.job_id)
                self.results[result.job_id] = result
            self._changed.notify_all()

    def wait(self, count: int) -> dict[int, JobResult]:
        with self._changed:
            assert self._changed.wait_for(lambda: len(self.results) >= count, HANG_S), (
                f"only {len(self.results)} of {count} answers: {self.results}")
            assert not self.twice, f"jobs answered twice: {self.twice}"
            return dict(self.results)


class GatedLanding(RemoteJobs):
    """RemoteJobs whose landing of a value (its verification, and a tail's copy) first asks
    its host's ``landing`` gate: the test acts while a batch lands."""

    def _land(self, read, value, cause):  # type: ignore[no-untyped-def]
        self.host.landing(read.slot)  # type: ignore[attr-defined]
        return super()._land(read, value, cause)


class GatedHost(HostPool):
    """A host pool whose slot ``gated`` is held up the first time a thread other than the
    test's lands a read into it: the test acts while that batch lands."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.gated: int | None = None
        self.reached = threading.Event()
        self.gate = threading.Event()
        self._test_thread = threading.current_thread()

    def landing(self, slot: int) -> None:
        if slot == self.gated and threading.current_thread() is not self._test_thread:
            self.gated = None
            self.reached.set()
            assert self.gate.wait(HANG_S), "the test never opened the gate"


@pytest.fixture
def host() -> Iterator[GatedHost]:
    pool = GatedHost(SLOTS, PAYLOAD, pin=False)
    pool.buffer.fill_(SENTINEL)
    yield pool
    pool.close()


@pytest.fixture
def make_jobs(host: HostPool) -> Iterator[Callable[..., tuple[RemoteJobs, ThreadedRemoteStore]]]:
    made: list[RemoteJobs] = []
    prefix = f"t{uuid.uuid4().hex[:10]}"

    def make(url: str, **options: object) -> tuple[RemoteJobs, ThreadedRemoteStore]:
        store = ThreadedRemoteStore(parse_remote_url(url), **FAST)
        assert wait_up(store, 10), store.stats()
        jobs = GatedLanding(store, host, fingerprint=FINGERPRINT, rank=0, prefix=prefix,
                            ttl_s=60.0, timeout_s=30.0, slot_rows=4, **options)  # type: ignore[arg-type]
        made.append(jobs)
        return jobs, store

    yield make
    for jobs in made:
        finishes(lambda jobs=jobs: jobs.close(1.0))


def put(jobs: RemoteJobs, store: ThreadedRemoteStore, keys: list[bytes],
        values: dict[int, bytes] | None = None) -> None:
    """Store ``payload(i)`` under ``keys[i]`` (or the raw value ``values[i]``)."""
    items = []
    for i, key in enumerate(keys):
        value = (values or {}).get(i)
        if value is None:
            value = encode(payload(i), fingerprint=FINGERPRINT, key=key, rank=0)
        items.append((jobs._redis_name(key), value))
    assert store.batch_set(items).result(HANG_S).ok


def test_reads_past_the_budget_are_sent_from_the_answer_callback_and_all_land(
    redis_server: RedisServer, host: GatedHost,
    make_jobs: Callable[..., tuple[RemoteJobs, ThreadedRemoteStore]],
) -> None:
    """One value per batch: each later batch is sent by the poll ``on_answer`` runs on the
    store's thread (it hung there: the store held its lock while running callbacks)."""
    jobs, store = make_jobs(redis_server.url, read_batch_bytes=HEADER_BYTES + PAYLOAD)
    keys = [make_key(300 + i) for i in range(6)]
    put(jobs, store, keys)
    answers = Answers(jobs)
    jobs.start_reads([(10 + i, key, i, 0) for i, key in enumerate(keys)])
    results = answers.wait(6)
    assert results == {10 + i: JobResult.done(10 + i) for i in range(6)}
    for i in range(6):
        assert bytes(host.slot_memoryview(i))[:PAYLOAD] == payload(i)
    assert store.stats().calls["get"] >= 6
    assert jobs.take_stats().reads_ok == 6


def busy(jobs: RemoteJobs) -> frozenset[int]:
    with jobs._lock:
        return frozenset(jobs._busy)


def test_a_corrupted_value_fails_only_its_job_and_the_batches_around_it_land(
    redis_server: RedisServer, host: GatedHost,
    make_jobs: Callable[..., tuple[RemoteJobs, ThreadedRemoteStore]],
) -> None:
    """Batches of one value: batch 1's value has a flipped payload byte; it is a checksum
    miss (received in its slot, never promised: the slot is free again), while batches 0, 2
    and 3 land verified."""
    jobs, store = make_jobs(redis_server.url, read_batch_bytes=2 * (HEADER_BYTES + PAYLOAD))
    keys = [make_key(400 + i) for i in range(4)]
    bad = bytearray(encode(payload(1), fingerprint=FINGERPRINT, key=keys[1], rank=0))
    bad[HEADER_BYTES + 17] ^= 0xFF
    put(jobs, store, keys, {1: bytes(bad)})
    answers = Answers(jobs)
    jobs.start_reads([(20 + i, key, i, 0) for i, key in enumerate(keys)])
    results = answers.wait(4)
    assert results == {20: JobResult.done(20), 21: JobResult.fail(21, FailureCause.CHECKSUM),
                       22: JobResult.done(22), 23: JobResult.done(23)}
    for i in (0, 2, 3):
        assert bytes(host.slot_memoryview(i))[:PAYLOAD] == payload(i)
    stats = jobs.take_stats()
    assert (stats.reads_ok, stats.reads_failed) == (3, {"checksum": 1})
    assert busy(jobs) == frozenset()


def test_a_slot_stays_busy_until_its_value_has_landed(
    redis_server: RedisServer, host: GatedHost,
    make_jobs: Callable[..., tuple[RemoteJobs, ThreadedRemoteStore]],
) -> None:
    """The value arrived, but until it is copied and reported its slot is the read's: no
    write copies from it and no other read lands into it; after, it is free again."""
    jobs, store = make_jobs(redis_server.url, read_batch_bytes=2 * (HEADER_BYTES + PAYLOAD))
    keys = [make_key(500 + i) for i in range(3)]
    put(jobs, store, keys)
    answers = Answers(jobs)
    host.gated = 0
    jobs.start_reads([(30, keys[0], 0, 0)])
    assert host.reached.wait(HANG_S)  # slot 0's value is landing now
    assert 0 in busy(jobs) and 30 not in answers.results
    assert jobs.write([(31, keys[1], 0, 4, (), ())]) == [JobResult.fail(31, FailureCause.COPY_ERROR)]
    jobs.start_reads([(32, keys[2], 0, 0), (33, keys[1], 1, 0)])
    host.gate.set()
    results = answers.wait(3)
    assert results == {30: JobResult.done(30), 32: JobResult.fail(32, FailureCause.COPY_ERROR),
                       33: JobResult.done(33)}
    assert bytes(host.slot_memoryview(0))[:PAYLOAD] == payload(0)
    assert bytes(host.slot_memoryview(1))[:PAYLOAD] == payload(1)
    assert busy(jobs) == frozenset()
    assert jobs.write([(34, keys[0], 0, 4, (), ())]) == [JobResult.done(34)]


def test_close_while_a_batch_lands_answers_every_job_once_and_frees_every_slot(
    redis_server: RedisServer, host: GatedHost,
    make_jobs: Callable[..., tuple[RemoteJobs, ThreadedRemoteStore]],
) -> None:
    """Close comes while batch 0 is landing and later batches wait for it: the landing batch
    finishes verified, the rest are answered (landed or cancelled), each job exactly once,
    and close returns only after the landing finished (no slot left busy)."""
    jobs, store = make_jobs(redis_server.url, read_batch_bytes=2 * (HEADER_BYTES + PAYLOAD))
    keys = [make_key(600 + i) for i in range(5)]
    put(jobs, store, keys)
    answers = Answers(jobs)
    host.gated = 0
    jobs.start_reads([(40 + i, key, i, 0) for i, key in enumerate(keys)])
    assert host.reached.wait(HANG_S)
    closed: list[list[JobResult]] = []
    order: list[str] = []

    def close() -> None:
        closed.append(jobs.close(HANG_S))
        order.append("closed")

    closer = threading.Thread(target=close, daemon=True)
    closer.start()
    deadline = time.monotonic() + HANG_S
    while not store._closed:  # close is under way (the store refuses new calls) ...
        assert time.monotonic() < deadline, "close never started"
        time.sleep(0.001)
    # A close that did not wait for the landing would return in this while (never a false
    # failure: a close that waits stays blocked on the gate however long this is).
    closer.join(0.5)
    order.append("landing")
    host.gate.set()  # ... before the batch being landed finishes
    closer.join(HANG_S)
    assert order == ["landing", "closed"], "close returned while a batch was still landing"
    assert answers.results.get(40) == JobResult.done(40)  # landed before close returned
    answers.take(closed[0])
    results = answers.wait(5)
    assert set(results) == {40, 41, 42, 43, 44}
    assert all(r.ok or r.failure is FailureCause.CANCELLED for r in results.values()), results
    for job_id, result in results.items():
        if result.ok:  # a cancelled one's slot may hold part of its value: never promised
            assert bytes(host.slot_memoryview(job_id - 40))[:PAYLOAD] == payload(job_id - 40)
    assert busy(jobs) == frozenset()



class HeldStore:
    """A store whose GET batches are answered only when the test says so (``answer(k)``, the
    k-th call), as the store's thread would: on a thread of its own."""

    def __init__(self, values: dict[str, bytes]) -> None:
        self.values = values
        self.calls: list[tuple[Future[BatchResult[Head | None]], list[str]]] = []
        self.sent = threading.Condition()

    def batch_get_bounded(self, names: list[str], max_len: int, *, timeout_s: float | None = None,
                          into: list[memoryview | None] | None = None, into_offset: int = 0,
                          ) -> Future[BatchResult[Head | None]]:
        future: Future[BatchResult[Head | None]] = Future()
        with self.sent:
            self.calls.append((future, list(names), into or [None] * len(names), into_offset))
            self.sent.notify_all()
        return future

    def answer(self, k: int) -> None:
        """As the real store receives: a value of a named buffer's length goes into it."""
        with self.sent:
            assert self.sent.wait_for(lambda: len(self.calls) > k, HANG_S), "batch never sent"
            future, names, into, offset = self.calls[k]
        heads = []
        for name, dest in zip(names, into, strict=True):
            value = self.values[name]
            if dest is not None and len(value) == offset + len(dest):
                dest[:] = value[offset:]
                heads.append(Head(memoryview(value[:offset]), len(value), dest))
            else:
                heads.append(Head(memoryview(bytearray(value)), len(value)))
        answering = threading.Thread(target=future.set_result, args=(BatchResult(heads),))
        answering.start()
        answering.join(HANG_S)

    def close(self, timeout_s: float = 2.0) -> bool:
        for future, names, *_ in self.calls:
            if not future.done():
                future.set_result(BatchResult([None] * len(names), FailureCause.CANCELLED, len(names)))
        return True



class SlotGates(HostPool):
    """Landing into slot ``s`` (on a thread other than the test's) waits for ``open[s]``,
    after setting ``reached[s]`` (through :class:`GatedLanding`)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.reached = {s: threading.Event() for s in range(2)}
        self.open = {s: threading.Event() for s in range(2)}
        self._test_thread = threading.current_thread()

    def landing(self, slot: int) -> None:
        if slot in self.open and threading.current_thread() is not self._test_thread:
            self.reached[slot].set()
            assert self.open[slot].wait(HANG_S), "the test never opened the gate"


def test_a_landed_batch_is_reported_before_the_next_one_lands() -> None:
    """Batch 1 arrives while batch 0 lands: batch 0's result is reported as soon as it landed,
    not held back until batch 1 has landed too (a request whose chunks came first would wait
    for the whole stream)."""
    host = SlotGates(SLOTS, PAYLOAD, pin=False)
    keys = [make_key(700 + i) for i in range(2)]
    values: dict[str, bytes] = {}
    store = HeldStore(values)
    jobs = GatedLanding(store, host, fingerprint=FINGERPRINT, rank=0, prefix="held",  # type: ignore[arg-type]
                      ttl_s=60.0, timeout_s=30.0, slot_rows=4,
                      read_batch_bytes=2 * (HEADER_BYTES + PAYLOAD))  # batches of one value
    try:
        for i, key in enumerate(keys):
            values[jobs._redis_name(key)] = encode(payload(i), fingerprint=FINGERPRINT, key=key, rank=0)
        answers = Answers(jobs)
        jobs.start_reads([(70, keys[0], 0, 0), (71, keys[1], 1, 0)])
        store.answer(0)
        assert host.reached[0].wait(HANG_S)  # batch 0 is landing
        store.answer(1)  # batch 1 arrives meanwhile
        host.open[0].set()
        # Batch 0's result comes while batch 1 cannot land yet (its gate is shut).
        assert answers.wait(1) == {70: JobResult.done(70)}
        host.open[1].set()
        assert answers.wait(2) == {70: JobResult.done(70), 71: JobResult.done(71)}
        assert bytes(host.slot_memoryview(1))[:PAYLOAD] == payload(1)
        finishes(lambda: jobs.close(1.0))
    finally:
        for gate in host.open.values():
            gate.set()
        host.close()


def test_a_prompts_reads_go_as_several_batches_and_the_first_lands_before_the_last_arrives() -> None:
    """64 values of 100 KB (6.4 MB, far inside the read budget) are not one call whose
    values land only once all of them arrived: the first batch lands while the rest are out."""
    size, count = 100_000, 64
    host = HostPool(count, size, pin=False)
    values: dict[str, bytes] = {}
    store = HeldStore(values)
    jobs = RemoteJobs(store, host, fingerprint=FINGERPRINT, rank=0, prefix="many",  # type: ignore[arg-type]
                      ttl_s=60.0, timeout_s=30.0, slot_rows=4)
    try:
        keys = [make_key(800 + i) for i in range(count)]
        for i, key in enumerate(keys):
            values[jobs._redis_name(key)] = encode(bytes([i]) * size, fingerprint=FINGERPRINT,
                                                   key=key, rank=0)
        answers = Answers(jobs)
        jobs.start_reads([(1000 + i, key, i, 0) for i, key in enumerate(keys)])
        assert len(store.calls) >= 2  # sent at once: the budget holds them all
        store.answer(0)
        first = answers.wait(len(store.calls[0][1]))
        assert first == {1000 + i: JobResult.done(1000 + i) for i in range(len(first))}
        assert bytes(host.slot_memoryview(0))[:size] == bytes([0]) * size
        for k in range(1, len(store.calls)):
            store.answer(k)
        assert len(answers.wait(count)) == count
        finishes(lambda: jobs.close(1.0))
    finally:
        host.close()
