"""Superseded tails in Redis (issue #25): a tail whose blocks a longer entry of its chunk now
holds becomes a pointer to that entry, written only once the entry is stored, and a read of
the tail follows it (one hop) and lands only the tail's rows, verified like any value."""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from tests.helpers import HANG_S, finishes, make_key
from tests.remote.remote_helpers import FAST, OTHER_FINGERPRINT, RedisServer, wait_up
from tieredkv.protocol import FailureCause, JobResult
from tieredkv.remote.codec import (
    POINTER_BYTES,
    decode_pointer,
    encode,
    encode_pointer,
    is_pointer,
    remote_key,
)
from tieredkv.remote.threaded import ThreadedRemoteStore
from tieredkv.remote_url import parse_remote_url
from tieredkv.testing.redis_procs import RedisClusterProcs
from tieredkv.transfer.host_pool import HostPool
from tieredkv.transfer.remote_jobs import RemoteJobs

FINGERPRINT = hashlib.sha256(b"tieredkv tests/transfer remote pointers").digest()
ROWS = 4  # rows of a slot
SPANS = ((0, 500), (2000, 300))  # two layers of ROWS rows, of 500 and 300 bytes
PAYLOAD = 2000 + ROWS * 300
ROW_BYTES = 500 + 300  # one row of every layer
SENTINEL = 0xAB

Make = Callable[..., tuple[RemoteJobs, ThreadedRemoteStore]]


@pytest.fixture
def host() -> Iterator[HostPool]:
    pool = HostPool(8, PAYLOAD, pin=False)
    pool.buffer.fill_(SENTINEL)
    yield pool
    pool.close()


@pytest.fixture
def make(host: HostPool) -> Iterator[Make]:
    made: list[RemoteJobs] = []
    prefix = f"p{uuid.uuid4().hex[:10]}"

    def build(url: str, *, writes: bool = True) -> tuple[RemoteJobs, ThreadedRemoteStore]:
        store = ThreadedRemoteStore(parse_remote_url(url), **FAST)
        assert wait_up(store, 10), store.stats()
        jobs = RemoteJobs(store, host, fingerprint=FINGERPRINT, rank=0, prefix=prefix,
                          ttl_s=60.0, timeout_s=2.0, slot_rows=ROWS, writes=writes)
        jobs.row_spans = SPANS
        made.append(jobs)
        return jobs, store

    yield build
    for jobs in made:
        jobs.close(1.0)


def payload(i: int) -> bytes:
    seed = hashlib.blake2b(b"%d" % i, digest_size=64).digest()
    return (seed * (PAYLOAD // 64 + 1))[:PAYLOAD]


def fill(host: HostPool, slot: int, data: bytes) -> None:
    host.slot_memoryview(slot)[: len(data)] = data


def slot_payload(host: HostPool, slot: int) -> bytes:
    return bytes(host.slot_memoryview(slot))[:PAYLOAD]


def leading_rows(data: bytes, rows: int) -> bytes:
    """What a slot holds after landing rows 0..rows-1 of every layer of ``data`` (a whole
    slot's payload) into a slot full of SENTINEL."""
    out = bytearray([SENTINEL]) * PAYLOAD
    for offset, row in SPANS:
        out[offset:offset + rows * row] = data[offset:offset + rows * row]
    return bytes(out)


def settle(jobs: RemoteJobs, count: int) -> dict[int, JobResult]:
    results: dict[int, JobResult] = {}
    deadline = time.monotonic() + HANG_S
    while len(results) < count:
        assert time.monotonic() < deadline, results
        for result in finishes(jobs.poll):
            assert result.job_id not in results, "answered twice"
            results[result.job_id] = result
        time.sleep(0.01)
    return results


def get(store: ThreadedRemoteStore, jobs: RemoteJobs, key: bytes) -> bytes | None:
    return store.batch_get([remote_key(jobs.fingerprint, 0, key, jobs.prefix)]).result(5).values[0]


# -- the write side -------------------------------------------------------------------------


def test_a_whole_chunk_replaces_the_tails_it_supersedes_by_pointers_and_creates_none(
    redis_deployment: RedisServer | RedisClusterProcs, host: HostPool, make: Make,
) -> None:
    """Tails of 2 and 3 blocks stored, then their whole chunk superseding them and a 1-block
    tail key Redis never held: the two tails' values are now pointers of 120 bytes (their rows
    are gone from Redis), and no key was created for the third."""
    jobs, store = make(redis_deployment.url)
    fill(host, 0, payload(1))
    blocks = [make_key(10 + i) for i in range(ROWS)]  # the chunk's block keys; its key: last
    assert jobs.write([(1, blocks[1], 0, 2, (), ()), (2, blocks[2], 0, 3, (), ())]) == [
        JobResult.done(1), JobResult.done(2)]
    assert jobs.flush_writes(5)
    assert jobs.write([(3, blocks[3], 0, ROWS, (), (blocks[0], blocks[1], blocks[2]))]) == [
        JobResult.done(3)]
    assert jobs.flush_writes(5)
    for tail in (blocks[1], blocks[2]):
        value = get(store, jobs, tail)
        assert value is not None and len(value) == POINTER_BYTES and is_pointer(value)
        pointer = decode_pointer(value, fingerprint=FINGERPRINT, key=tail, rank=0)
        assert (pointer.target, pointer.rows) == (blocks[3], ROWS)  # type: ignore[union-attr]
    assert get(store, jobs, blocks[0]) is None
    assert store.stats().tails_superseded == 2


def test_a_pointer_is_written_only_once_its_target_is_stored(
    fresh_server: Callable[..., RedisServer], host: HostPool, make: Make,
) -> None:
    """A writer allowed to write the tail's key but not the chunk's (an ACL): the chunk's SET
    fails, so the tail keeps its own value; a pointer to a value that is not there would turn
    a hit into a miss on every replica."""
    server = fresh_server()
    jobs, store = make(server.url)
    fill(host, 0, payload(2))
    tail, chunk = make_key(20), make_key(21)
    assert jobs.write([(1, tail, 0, 2, (), ())]) == [JobResult.done(1)]
    assert jobs.flush_writes(5)
    before = get(store, jobs, tail)
    tail_name = remote_key(FINGERPRINT, 0, tail, jobs.prefix).decode()
    server.cli("ACL", "SETUSER", "tailonly", "on", ">tail-only-pw", f"~{tail_name}", "+@all")
    url = server.url.replace("redis://", "redis://tailonly:tail-only-pw@")
    limited, _ = make(url)
    assert limited.write([(2, chunk, 0, ROWS, (), (tail,))]) == [JobResult.done(2)]
    assert limited.flush_writes(5)
    assert limited.store.stats().writes_failed == 1  # the chunk: NOPERM
    assert get(store, jobs, chunk) is None
    assert get(store, jobs, tail) == before  # not a pointer
    assert limited.store.stats().tails_superseded == 0


# -- the read side --------------------------------------------------------------------------


def _plant(store: ThreadedRemoteStore, jobs: RemoteJobs, key: bytes, value: bytes) -> None:
    name = remote_key(FINGERPRINT, 0, key, jobs.prefix)
    assert store.batch_set([(name, value)]).result(5).values == [True]


def _pointer(key: bytes, target: bytes, rows: int, fingerprint: bytes = FINGERPRINT) -> bytes:
    return encode_pointer(fingerprint=fingerprint, key=key, rank=0, target=target, rows=rows)


def test_a_tails_read_follows_its_pointer_and_lands_only_its_rows(
    redis_deployment: RedisServer | RedisClusterProcs, host: HostPool, make: Make,
) -> None:
    """Tails of 2 and 3 rows, then their whole chunk written from another slot (other bytes,
    to tell which value landed): each tail's read lands the chunk's leading rows of every
    layer (layers of different row sizes), and nothing else of its slot changes."""
    jobs, _ = make(redis_deployment.url)
    fill(host, 0, payload(30))
    blocks = [make_key(30 + i) for i in range(ROWS)]
    assert jobs.write([(1, blocks[1], 0, 2, (), ()), (2, blocks[2], 0, 3, (), ())]) == [
        JobResult.done(1), JobResult.done(2)]
    assert jobs.flush_writes(5)
    fill(host, 1, payload(31))
    assert jobs.write([(3, blocks[3], 1, ROWS, (), (blocks[1], blocks[2]))]) == [JobResult.done(3)]
    assert jobs.flush_writes(5)
    host.buffer.fill_(SENTINEL)
    jobs.take_stats()
    jobs.start_reads([(4, blocks[1], 2, 2), (5, blocks[2], 3, 3)])
    assert settle(jobs, 2) == {4: JobResult.done(4), 5: JobResult.done(5)}
    assert slot_payload(host, 2) == leading_rows(payload(31), 2)
    assert slot_payload(host, 3) == leading_rows(payload(31), 3)
    stats = jobs.take_stats()
    assert (stats.reads_ok, stats.bytes_read) == (2, 2 * ROW_BYTES + 3 * ROW_BYTES)


def test_a_pointer_to_a_longer_tail_lands_from_its_packed_rows(
    redis_server: RedisServer, host: HostPool, make: Make,
) -> None:
    jobs, _ = make(redis_server.url)
    fill(host, 0, payload(40))
    blocks = [make_key(40 + i) for i in range(ROWS)]
    assert jobs.write([(1, blocks[1], 0, 2, (), ())]) == [JobResult.done(1)]
    assert jobs.flush_writes(5)
    fill(host, 0, payload(41))
    assert jobs.write([(2, blocks[2], 0, 3, (), (blocks[1],))]) == [JobResult.done(2)]
    assert jobs.flush_writes(5)
    host.buffer.fill_(SENTINEL)
    jobs.start_reads([(3, blocks[1], 1, 2)])
    assert settle(jobs, 1) == {3: JobResult.done(3)}
    assert slot_payload(host, 1) == leading_rows(payload(41), 2)


def test_a_chain_left_by_two_writers_racing_is_followed_while_it_grows(
    redis_server: RedisServer, host: HostPool, make: Make,
) -> None:
    """Writer A's pointers (2 rows -> the 3-row tail) land after writer B's (3 rows -> the
    whole chunk): the 2-row tail's read follows both and lands the chunk's rows."""
    jobs, store = make(redis_server.url)
    fill(host, 0, payload(50))
    blocks = [make_key(50 + i) for i in range(ROWS)]
    assert jobs.write([(1, blocks[2], 0, 3, (), ())]) == [JobResult.done(1)]
    assert jobs.flush_writes(5)
    fill(host, 0, payload(51))
    assert jobs.write([(2, blocks[3], 0, ROWS, (), (blocks[2],))]) == [JobResult.done(2)]
    assert jobs.flush_writes(5)
    _plant(store, jobs, blocks[1], _pointer(blocks[1], blocks[2], 3))  # A's, late
    host.buffer.fill_(SENTINEL)
    jobs.start_reads([(3, blocks[1], 1, 2)])
    assert settle(jobs, 1) == {3: JobResult.done(3)}
    assert slot_payload(host, 1) == leading_rows(payload(51), 2)


def _gone(store: ThreadedRemoteStore, jobs: RemoteJobs, key: bytes) -> bool:
    deadline = time.monotonic() + HANG_S
    while get(store, jobs, key) is not None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.parametrize("writes", [True, False])
def test_a_pointer_whose_entry_is_gone_is_a_miss_and_deleted_unless_read_only(
    redis_deployment: RedisServer | RedisClusterProcs, host: HostPool, make: Make, writes: bool,
) -> None:
    """Redis evicted the whole chunk, not the pointer: the probe would see the tail present
    and every read would miss after two round trips, on every replica, for good. A reader
    that may write deletes it; a read-only replica (``remote_writes: false``) leaves it."""
    jobs, store = make(redis_deployment.url, writes=writes)
    tail, chunk = make_key(60), make_key(61)
    _plant(store, jobs, tail, _pointer(tail, chunk, ROWS))
    jobs.start_reads([(1, tail, 1, 2)])
    assert settle(jobs, 1) == {1: JobResult.fail(1, FailureCause.MISSING)}
    assert slot_payload(host, 1) == bytes([SENTINEL]) * PAYLOAD
    if writes:
        assert _gone(store, jobs, tail)
    else:
        assert jobs.flush_writes(5) and get(store, jobs, tail) is not None


def test_pointers_that_cannot_serve_are_misses_that_leave_the_slot_alone(
    redis_server: RedisServer, host: HostPool, make: Make,
) -> None:
    """A chain whose rows do not grow, a pointer to fewer rows than the tail, one of another
    namespace, one with a flipped byte, one under a whole chunk's key: each a miss with its
    cause, the slot untouched; a good pointer beside them lands (the control)."""
    jobs, store = make(redis_server.url)
    k = [make_key(70 + i) for i in range(12)]
    flipped = bytearray(_pointer(k[6], k[7], ROWS))
    flipped[90] ^= 1
    _plant(store, jobs, k[11], encode(payload(70), fingerprint=FINGERPRINT, key=k[11], rank=0))
    _plant(store, jobs, k[0], _pointer(k[0], k[1], 3))  # -> a pointer to 2 rows: shrinks
    _plant(store, jobs, k[1], _pointer(k[1], k[4], 2))
    _plant(store, jobs, k[2], _pointer(k[2], k[11], 1))  # fewer rows than the tail's 2
    _plant(store, jobs, k[3], _pointer(k[3], k[11], ROWS, OTHER_FINGERPRINT))
    _plant(store, jobs, k[6], bytes(flipped))
    _plant(store, jobs, k[8], _pointer(k[8], k[11], ROWS))  # asked as a whole chunk
    _plant(store, jobs, k[9], _pointer(k[9], k[11], ROWS))
    host.buffer.fill_(SENTINEL)
    jobs.start_reads([(1, k[0], 1, 2), (2, k[2], 2, 2), (3, k[3], 3, 2), (4, k[6], 4, 2),
                      (5, k[8], 5, 0), (6, k[9], 6, 3)])
    results = settle(jobs, 6)
    assert {j: r.failure for j, r in results.items()} == {
        1: FailureCause.MISSING, 2: FailureCause.MISSING, 3: FailureCause.WRONG_NAMESPACE,
        4: FailureCause.CHECKSUM, 5: FailureCause.MISSING, 6: None}
    for slot in range(1, 6):
        assert slot_payload(host, slot) == bytes([SENTINEL]) * PAYLOAD, slot
    assert slot_payload(host, 6) == leading_rows(payload(70), 3)
    with jobs._lock:
        assert not jobs._busy


def test_a_value_another_writer_put_under_a_dangling_pointers_key_is_not_deleted(
    redis_server: RedisServer, host: HostPool, make: Make,
) -> None:
    """Between the reader's GET of a pointer and its finding the entry gone, another replica
    wrote the tail again as a value of its own: the delete compares before it deletes."""
    jobs, store = make(redis_server.url)
    tail, chunk = make_key(80), make_key(81)
    _plant(store, jobs, tail, _pointer(tail, chunk, ROWS))  # the chunk was evicted
    fresh = encode(payload(80)[:2 * ROW_BYTES], fingerprint=FINGERPRINT, key=tail, rank=0)
    land, delete = jobs._land, store.batch_delete
    deletes: list = []

    def racing_land(read, value, cause):  # the real landing, after the other writer's SET
        if read.via is not None:
            _plant(store, jobs, tail, fresh)
        return land(read, value, cause)

    def recorded_delete(*args, **kwargs):
        deletes.append(delete(*args, **kwargs))
        return deletes[-1]

    jobs._land, store.batch_delete = racing_land, recorded_delete  # type: ignore[method-assign]
    jobs.start_reads([(1, tail, 1, 2)])
    assert settle(jobs, 1) == {1: JobResult.fail(1, FailureCause.MISSING)}
    assert len(deletes) == 1 and deletes[0].result(HANG_S).values == [False]
    assert get(store, jobs, tail) == fresh
