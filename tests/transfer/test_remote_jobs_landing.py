"""RemoteJobs as the engine drives it: answers reported through ``on_answer`` (on the store's
thread), reads past the batch budget sent from there, and every job answered exactly once."""

from __future__ import annotations

import hashlib
import threading
import uuid
from collections.abc import Callable, Iterator

import pytest

from tests.helpers import HANG_S, finishes, make_key
from tests.remote.remote_helpers import FAST, RedisServer, wait_up
from tieredkv.protocol import JobResult
from tieredkv.remote.codec import HEADER_BYTES, encode
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


@pytest.fixture
def host() -> Iterator[HostPool]:
    pool = HostPool(SLOTS, PAYLOAD, pin=False)
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
        jobs = RemoteJobs(store, host, fingerprint=FINGERPRINT, rank=0, prefix=prefix,
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
    redis_server: RedisServer, host: HostPool, make_jobs: Callable[..., tuple[RemoteJobs, ThreadedRemoteStore]],
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
