"""RemoteJobs against real redis-server processes: verified reads into host slots, bounded
writes out of them, and every failure a miss with its cause that leaves the slot alone."""

from __future__ import annotations

import hashlib
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from tests.helpers import HANG_S, finishes, make_key
from tests.remote.remote_helpers import FAST, OTHER_FINGERPRINT, RedisServer, sent_bytes, wait_up
from tieredkv.protocol import FailureCause, JobResult
from tieredkv.remote.codec import HEADER_BYTES, encode, remote_key, value_bytes
from tieredkv.remote.threaded import ThreadedRemoteStore
from tieredkv.remote_url import parse_remote_url
from tieredkv.transfer.host_pool import HostPool
from tieredkv.transfer.remote_jobs import RemoteJobs

FINGERPRINT = hashlib.sha256(b"tieredkv tests/transfer remote namespace").digest()
PAYLOAD = 5000  # not a 4 KiB multiple: slots carry padding a value must never reach
SENTINEL = 0xAB
ROWS = 4  # rows of a slot (a tail's entry holds fewer)
NEVER = (FailureCause.TIMEOUT, FailureCause.IO_ERROR, FailureCause.UNAVAILABLE)

MakeJobs = Callable[..., tuple[RemoteJobs, ThreadedRemoteStore]]


@pytest.fixture
def own_server(fresh_server: Callable[..., RedisServer]) -> RedisServer:
    """A server this test alone uses (to kill or stall)."""
    return fresh_server()


@pytest.fixture
def host() -> Iterator[HostPool]:
    pool = HostPool(8, PAYLOAD, pin=False)
    pool.buffer.fill_(SENTINEL)
    yield pool
    pool.close()


@pytest.fixture
def make_jobs(host: HostPool) -> Iterator[MakeJobs]:
    """Factory: RemoteJobs on a started store (``prefix`` is this test's own)."""
    made: list[RemoteJobs] = []
    prefix = f"t{uuid.uuid4().hex[:10]}"  # this test's own keys on a shared server

    def make(url: str, *, rank: int = 0, timeout_s: float = 2.0, jobs_options: dict | None = None,
             **store_options: object) -> tuple[RemoteJobs, ThreadedRemoteStore]:
        store = ThreadedRemoteStore(parse_remote_url(url), **{**FAST, **store_options})
        assert wait_up(store, 10), store.stats()
        jobs = RemoteJobs(store, host, fingerprint=FINGERPRINT, rank=rank, prefix=prefix,
                          ttl_s=60.0, timeout_s=timeout_s, slot_rows=ROWS, **(jobs_options or {}))
        made.append(jobs)
        return jobs, store

    yield make
    for jobs in made:
        jobs.close(1.0)


def busy_slots(jobs: RemoteJobs) -> frozenset[int]:
    """Slots a read still owns (until its answer was polled): not to be reused yet."""
    with jobs._lock:
        return frozenset(jobs._busy)


def reads_waiting(jobs: RemoteJobs) -> int:
    """Reads not sent yet: behind batches still out (``read_batch_bytes``)."""
    with jobs._lock:
        return sum(len(batch.jobs) for batch in jobs._unsent)


def payload(i: int, rank: int = 0) -> bytes:
    seed = hashlib.blake2b(f"{i}/{rank}".encode(), digest_size=64).digest()
    return (seed * (PAYLOAD // 64 + 1))[:PAYLOAD]


def whole(items: list[tuple[int, bytes, int]]) -> list[tuple[int, bytes, int, int, tuple, tuple]]:
    """Writes of entries that hold every row of their slots, none of them empty."""
    return [(job_id, key, slot, ROWS, (), ()) for job_id, key, slot in items]


def fill(host: HostPool, slot: int, data: bytes) -> None:
    host.slot_memoryview(slot)[: len(data)] = data


def slot_bytes(host: HostPool, slot: int) -> bytes:
    """The whole padded slot: padding must stay untouched too."""
    return bytes(host.slot_memoryview(slot))


def untouched(host: HostPool, slot: int) -> bool:
    return slot_bytes(host, slot) == bytes([SENTINEL]) * host.slot_bytes


def settle(jobs: RemoteJobs, count: int, within_s: float = HANG_S) -> dict[int, JobResult]:
    """Poll until ``count`` results arrived (``within_s`` only turns a hang into a failure).

    That a poll never waits for the network is asserted where the server is stalled: a poll
    that returns nothing while the reads are still in flight."""
    results: dict[int, JobResult] = {}
    deadline = time.monotonic() + within_s
    while len(results) < count:
        assert time.monotonic() < deadline, f"only {len(results)} of {count} results: {results}"
        got = finishes(jobs.poll)
        for result in got:
            assert result.job_id not in results
            results[result.job_id] = result
        time.sleep(0.01)
    return results


def causes(results: dict[int, JobResult]) -> dict[int, str | None]:
    return {job_id: r.failure for job_id, r in results.items()}


def stall(server: RedisServer) -> None:
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)


# -- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("deployment", ["redis_server", "redis_cluster"])
def test_round_trip_from_one_slot_into_another(
    deployment: str, request: pytest.FixtureRequest, host: HostPool, make_jobs: MakeJobs
) -> None:
    jobs, store = make_jobs(request.getfixturevalue(deployment).url)
    keys = [make_key(i) for i in range(4)]
    for slot in range(4):
        fill(host, slot, payload(slot))
    written = jobs.write(whole([(10 + i, k, i) for i, k in enumerate(keys)]))
    assert written == [JobResult.done(10 + i) for i in range(4)]
    for slot in range(4):  # the payload was copied at call time: the slot is free at once
        fill(host, slot, bytes(PAYLOAD))
    assert jobs.flush_writes(5)

    calls = store.stats().calls.get("get", 0)
    jobs.start_reads([(20 + i, k, 4 + i, 0) for i, k in enumerate(keys)])
    assert busy_slots(jobs) == {4, 5, 6, 7}
    results = settle(jobs, 4)
    assert store.stats().calls.get("get", 0) == calls + 1  # one batch_get for the batch
    assert results == {20 + i: JobResult.done(20 + i) for i in range(4)}
    for i in range(4):
        assert slot_bytes(host, 4 + i)[:PAYLOAD] == payload(i)
        assert slot_bytes(host, 4 + i)[PAYLOAD:] == bytes([SENTINEL]) * (host.slot_bytes - PAYLOAD)
    assert busy_slots(jobs) == frozenset()
    stats = jobs.take_stats()
    assert (stats.reads_ok, stats.reads_failed, stats.bytes_read) == (4, {}, 4 * PAYLOAD)
    assert (stats.writes_ok, stats.writes_dropped, stats.bytes_written) == (4, 0, 4 * PAYLOAD)
    assert jobs.take_stats().reads_ok == 0  # taking resets


def test_each_rank_reads_only_its_own_shard(
    redis_server: RedisServer, host: HostPool, make_jobs: MakeJobs
) -> None:
    rank0, _ = make_jobs(redis_server.url, rank=0)
    rank1, _ = make_jobs(redis_server.url, rank=1)
    key = make_key(1)
    fill(host, 0, payload(1, rank=0))
    assert rank0.write(whole([(1, key, 0)])) == [JobResult.done(1)]
    assert rank0.flush_writes(5)
    rank1.start_reads([(2, key, 1, 0)])
    assert causes(settle(rank1, 1, 5)) == {2: FailureCause.MISSING}
    assert untouched(host, 1)
    assert rank1.take_stats().reads_failed == {"missing": 1}


# -- verification -----------------------------------------------------------------------------


def _corrupt(value: bytes, key: bytes) -> dict[str, tuple[bytes, FailureCause]]:
    """Values that must not reach a slot, by case: (value stored under ``key``'s name, cause)."""
    good = payload(7)
    return {
        "other rank": (encode(good, fingerprint=FINGERPRINT, key=key, rank=1), FailureCause.WRONG_KEY),
        "other key": (encode(good, fingerprint=FINGERPRINT, key=make_key(8), rank=0),
                      FailureCause.WRONG_KEY),
        "other namespace": (encode(good, fingerprint=OTHER_FINGERPRINT, key=key, rank=0),
                            FailureCause.WRONG_NAMESPACE),
        "truncated": (value[:-100], FailureCause.SHORT_READ),
        "header only, cut": (value[: HEADER_BYTES - 1], FailureCause.SHORT_READ),
        "trailing bytes": (value + b"x", FailureCause.CHECKSUM),
        # Bigger than the slot, yet well formed: refused on its length, never copied.
        "bigger than the slot": (encode(good * 2, fingerprint=FINGERPRINT, key=key, rank=0),
                                 FailureCause.WRONG_NAMESPACE),
        "not ours": (b"hello", FailureCause.SHORT_READ),
        # GETRANGE answers an empty string for an empty value and for none: both read as absent.
        "empty": (b"", FailureCause.MISSING),
    }


@pytest.mark.parametrize("case", list(_corrupt(b"", make_key(0))))
def test_a_value_that_is_not_the_asked_for_shard_is_a_miss_and_the_slot_stays(
    case: str, redis_server: RedisServer, host: HostPool, make_jobs: MakeJobs
) -> None:
    jobs, store = make_jobs(redis_server.url)
    key = make_key(7)
    name = remote_key(FINGERPRINT, 0, key, jobs.prefix)
    good = encode(payload(7), fingerprint=FINGERPRINT, key=key, rank=0)
    value, cause = _corrupt(good, key)[case]
    assert store.batch_set([(name, value)]).result(5).ok
    jobs.start_reads([(1, key, 2, 0)])
    assert causes(settle(jobs, 1)) == {1: cause}
    assert all(untouched(host, slot) for slot in range(host.num_slots) if slot != 2)
    # A value exactly a slot's value long is received in the slot itself (verified there, then
    # refused: never promised); any other is refused before a byte of it reaches the slot.
    assert untouched(host, 2) or len(value) == len(good)
    assert slot_bytes(host, 2)[host.payload_bytes:] == bytes([SENTINEL]) * (
        host.slot_bytes - host.payload_bytes)  # never past the payload, whatever it was
    assert not jobs._busy
    assert jobs.take_stats().reads_failed == {cause.value: 1}


@pytest.mark.parametrize("offset", [HEADER_BYTES + 1234, 40], ids=["payload", "header"])
def test_one_byte_flipped_in_redis_is_a_checksum_miss(
    offset: int, redis_server: RedisServer, host: HostPool, make_jobs: MakeJobs
) -> None:
    jobs, _ = make_jobs(redis_server.url)
    key = make_key(3)
    fill(host, 0, payload(3))
    assert jobs.write(whole([(1, key, 0)])) == [JobResult.done(1)]
    assert jobs.flush_writes(5)
    name = remote_key(FINGERPRINT, 0, key, jobs.prefix).decode()
    was = encode(payload(3), fingerprint=FINGERPRINT, key=key, rank=0)[offset]
    assert redis_server.cli("SETRANGE", name, str(offset), "A" if was != ord("A") else "B")
    jobs.start_reads([(2, key, 1, 0)])
    assert causes(settle(jobs, 1)) == {2: FailureCause.CHECKSUM}
    # Received in slot 1 itself (never promised, the slot free again); no other slot touched
    # (slot 0 holds what was written).
    assert all(untouched(host, slot) for slot in range(2, host.num_slots))
    assert not jobs._busy


def test_a_missing_key_is_a_missing_miss(
    redis_server: RedisServer, host: HostPool, make_jobs: MakeJobs
) -> None:
    jobs, _ = make_jobs(redis_server.url)
    jobs.start_reads([(1, make_key(100), 0, 0), (2, make_key(101), 1, 0)])
    assert causes(settle(jobs, 2)) == {1: FailureCause.MISSING, 2: FailureCause.MISSING}
    assert untouched(host, 0) and untouched(host, 1)
    assert jobs.take_stats().reads_failed == {"missing": 2}


# -- outages ----------------------------------------------------------------------------------


def test_a_server_killed_mid_read_fails_the_reads_with_a_cause_and_writes_drop(
    own_server: RedisServer, host: HostPool, make_jobs: MakeJobs
) -> None:
    jobs, store = make_jobs(own_server.url, timeout_s=3.0)
    keys = [make_key(i) for i in range(3)]
    for slot in range(3):
        fill(host, slot, payload(slot))
    assert all(r.ok for r in jobs.write(whole([(i, k, i) for i, k in enumerate(keys)])))
    assert jobs.flush_writes(5)
    stall(own_server)
    jobs.start_reads([(10 + i, k, 4 + i, 0) for i, k in enumerate(keys)])
    assert busy_slots(jobs) == {4, 5, 6}
    assert finishes(jobs.poll) == []  # in flight on a stalled server: a poll does not wait
    own_server.kill()  # SIGKILL ends a stopped process too: the reads lose their connection
    results = settle(jobs, 3)
    assert all(r.failure in NEVER for r in results.values()), results
    assert all(untouched(host, slot) for slot in (4, 5, 6, 7))
    assert busy_slots(jobs) == frozenset()
    assert sum(jobs.take_stats().reads_failed.values()) == 3

    # The store knows it is down now: writes are dropped at once, and reads answer at once.
    assert not store.up
    fill(host, 7, payload(7))
    round_trips = store.stats().round_trips
    assert jobs.write(whole([(20, keys[0], 7)])) == [JobResult.fail(20, FailureCause.DROPPED)]
    jobs.start_reads([(21, keys[0], 4, 0)])
    assert causes(settle(jobs, 1)) == {21: FailureCause.UNAVAILABLE}
    assert store.stats().round_trips == round_trips  # answered without asking the server
    assert untouched(host, 4)
    stats = jobs.take_stats()
    assert (stats.writes_dropped, stats.reads_failed) == (1, {"unavailable": 1})


def test_a_stalled_server_times_reads_out_and_their_slots_stay_busy_until_then(
    own_server: RedisServer, host: HostPool, make_jobs: MakeJobs
) -> None:
    # The store's own health ping waits 2 s (FAST): a 0.5 s read deadline fires first.
    jobs, _ = make_jobs(own_server.url, timeout_s=0.5)
    key = make_key(1)
    fill(host, 0, payload(1))
    assert jobs.write(whole([(1, key, 0)])) == [JobResult.done(1)]
    assert jobs.flush_writes(5)
    stall(own_server)
    jobs.start_reads([(2, key, 3, 0), (3, make_key(2), 4, 0)])
    assert busy_slots(jobs) == {3, 4}
    # A busy slot is refused to a second read and to a write; the first read is unaffected.
    jobs.start_reads([(4, key, 3, 0), (5, key, 5, 0), (6, key, 5, 0), (7, key, 99, 0)])
    assert jobs.write(whole([(8, key, 4), (9, key, 99)])) == [
        JobResult.fail(8, FailureCause.COPY_ERROR), JobResult.fail(9, FailureCause.COPY_ERROR)
    ]
    assert causes(settle(jobs, 3)) == dict.fromkeys((4, 6, 7), FailureCause.COPY_ERROR)
    assert busy_slots(jobs) == {3, 4, 5}
    assert finishes(jobs.poll) == [] and busy_slots(jobs) == {3, 4, 5}  # a poll does not wait
    results = settle(jobs, 3)
    assert causes(results) == dict.fromkeys((2, 3, 5), FailureCause.TIMEOUT)
    assert busy_slots(jobs) == frozenset()
    assert all(untouched(host, slot) for slot in range(1, host.num_slots))
    stats = jobs.take_stats()
    assert stats.reads_failed == {"timeout": 3, "copy_error": 3}
    assert stats.writes_failed == {"copy_error": 2}


def test_close_cancels_reads_in_flight_without_touching_their_slots(
    own_server: RedisServer, host: HostPool, make_jobs: MakeJobs
) -> None:
    jobs, store = make_jobs(own_server.url, timeout_s=30.0)
    stall(own_server)
    jobs.start_reads([(1, make_key(1), 0, 0), (2, make_key(2), 1, 0)])
    assert busy_slots(jobs) == {0, 1}
    results = finishes(lambda: jobs.close(1.0))  # not the reads' 30 s deadline: cancelled
    assert results == [JobResult.fail(1, FailureCause.CANCELLED),
                       JobResult.fail(2, FailureCause.CANCELLED)]
    assert busy_slots(jobs) == frozenset() and jobs.poll() == []
    assert untouched(host, 0) and untouched(host, 1)
    # After close: reads are cancelled at once and writes dropped.
    jobs.start_reads([(3, make_key(1), 0, 0)])
    assert causes(settle(jobs, 1)) == {3: FailureCause.CANCELLED}
    assert jobs.write(whole([(4, make_key(1), 2)])) == [JobResult.fail(4, FailureCause.DROPPED)]
    assert untouched(host, 0)


# -- bounded writes ---------------------------------------------------------------------------


def test_writes_beyond_a_full_queue_are_dropped_and_counted(
    redis_server: RedisServer, host: HostPool, make_jobs: MakeJobs
) -> None:
    jobs, store = make_jobs(redis_server.url, write_queue_items=2)
    keys = [make_key(i) for i in range(5)]
    for slot in range(5):
        fill(host, slot, payload(slot))
    results = jobs.write(whole([(i, k, i) for i, k in enumerate(keys)]))
    # The queue keeps a prefix of one offer: the first two go in, the rest drop.
    assert results == [JobResult.done(0), JobResult.done(1)] + [
        JobResult.fail(i, FailureCause.DROPPED) for i in (2, 3, 4)
    ]
    assert jobs.flush_writes(5)
    stats = jobs.take_stats()
    assert (stats.writes_ok, stats.writes_dropped, stats.bytes_written) == (2, 3, 2 * PAYLOAD)
    assert store.stats().writes_dropped == 3 and store.stats().writes_done == 2
    jobs.start_reads([(10 + i, k, 5 + i % 3, 0) for i, k in enumerate(keys[1:3])])
    assert causes(settle(jobs, 2)) == {10: None, 11: FailureCause.MISSING}


def test_writes_to_a_stalled_server_never_block_and_the_excess_drops(
    own_server: RedisServer, host: HostPool, make_jobs: MakeJobs
) -> None:
    jobs, store = make_jobs(own_server.url, write_queue_items=4, writers=1, write_timeout_s=10.0)
    for slot in range(4):
        fill(host, slot, payload(slot))
    stall(own_server)
    results: list[JobResult] = []
    for round_ in range(5):
        batch = [(round_ * 4 + s, make_key(round_ * 4 + s), s) for s in range(4)]
        # Each call returns its results while the server is stalled: it never waits on it.
        results += finishes(lambda batch=batch: jobs.write(whole(batch)))
        time.sleep(0.05)
    assert store.stats().writes_done == 0  # nothing reached the stalled server meanwhile
    done = [r for r in results if r.ok]
    dropped = [r for r in results if r.failure == FailureCause.DROPPED]
    assert len(done) + len(dropped) == 20
    assert 4 <= len(done) <= 8 and len(dropped) >= 12  # one batch in flight, one queued
    stats = jobs.take_stats()
    assert (stats.writes_ok, stats.writes_dropped) == (len(done), len(dropped))
    assert store.stats().writes_dropped == len(dropped)


# -- bounded reads (issue #23, 5) -------------------------------------------------------------

PLANTED = 32 << 20


@pytest.mark.parametrize("deployment", ["redis_server", "redis_cluster"])
def test_a_planted_oversized_value_is_a_counted_miss_that_costs_one_values_bytes(
    deployment: str, request: pytest.FixtureRequest, host: HostPool, make_jobs: MakeJobs
) -> None:
    """Anyone who can write to Redis can plant a huge value under a chunk's name: the read
    takes at most one value's bytes of it (measured by the server) and misses by cause."""
    servers = request.getfixturevalue(deployment)
    jobs, store = make_jobs(servers.url)
    keys = [make_key(40 + i) for i in range(3)]
    names = [remote_key(FINGERPRINT, 0, k, jobs.prefix) for k in keys]
    good = encode(payload(40), fingerprint=FINGERPRINT, key=keys[0], rank=0)
    bigger = encode(payload(41) * (PLANTED // PAYLOAD), fingerprint=FINGERPRINT, key=keys[1], rank=0)
    planted = {
        keys[0]: (good + bytes(PLANTED), FailureCause.CHECKSUM),  # trailing bytes
        keys[1]: (bigger, FailureCause.WRONG_NAMESPACE),  # well formed, another length
        keys[2]: (b"\x07" * PLANTED, FailureCause.CHECKSUM),  # not a tieredkv value
    }
    assert store.batch_set([(n, planted[k][0]) for n, k in zip(names, keys, strict=True)]).result(30).ok

    before = sent_bytes(servers)
    jobs.start_reads([(i, k, i, 0) for i, k in enumerate(keys)])
    results = settle(jobs, 3)
    sent = sent_bytes(servers) - before

    assert causes(results) == {i: planted[k][1] for i, k in enumerate(keys)}
    assert sent < 1 << 20, f"{sent} bytes sent to read three values of {len(good)} bytes"
    assert all(untouched(host, slot) for slot in range(host.num_slots))
    stats = jobs.take_stats()
    assert stats.reads_ok == 0
    assert stats.reads_failed == {"checksum": 2, "wrong_namespace": 1}


def test_reads_past_the_batch_budget_wait_until_earlier_ones_landed(
    own_server: RedisServer, host: HostPool, make_jobs: MakeJobs
) -> None:
    value_len = HEADER_BYTES + PAYLOAD
    jobs, store = make_jobs(own_server.url, timeout_s=30.0,
                            jobs_options={"read_batch_bytes": 2 * value_len})
    keys = [make_key(60 + i) for i in range(5)]
    for slot in range(5):
        fill(host, slot, payload(60 + slot))
    assert all(r.ok for r in jobs.write(whole([(i, k, i) for i, k in enumerate(keys)])))
    assert jobs.flush_writes(5)
    host.buffer.fill_(SENTINEL)
    calls = store.stats().calls.get("get", 0)

    stall(own_server)
    jobs.start_reads([(10 + i, k, i, 0) for i, k in enumerate(keys)])
    assert busy_slots(jobs) == {0, 1, 2, 3, 4}
    # Batches are half the budget (one lands while the next is read): two batches of one
    # value are out; the other three reads wait for them to land.
    assert reads_waiting(jobs) == 3
    assert finishes(jobs.poll) == [] and reads_waiting(jobs) == 3
    assert own_server.proc is not None
    os.kill(own_server.proc.pid, signal.SIGCONT)

    results = settle(jobs, 5)
    assert results == {10 + i: JobResult.done(10 + i) for i in range(5)}
    assert store.stats().calls["get"] == calls + 5  # five batches of one value
    for slot in range(5):
        assert slot_bytes(host, slot)[:PAYLOAD] == payload(60 + slot)
    assert reads_waiting(jobs) == 0 and busy_slots(jobs) == frozenset()


def test_close_answers_reads_that_were_never_sent(
    own_server: RedisServer, host: HostPool, make_jobs: MakeJobs
) -> None:
    jobs, _ = make_jobs(own_server.url, timeout_s=30.0,
                        jobs_options={"read_batch_bytes": HEADER_BYTES + PAYLOAD})
    stall(own_server)
    jobs.start_reads([(1, make_key(1), 0, 0), (2, make_key(2), 1, 0), (3, make_key(3), 2, 0)])
    assert reads_waiting(jobs) == 2
    results = finishes(lambda: jobs.close(1.0))
    assert sorted(results, key=lambda r: r.job_id) == [
        JobResult.fail(i, FailureCause.CANCELLED) for i in (1, 2, 3)
    ]
    assert busy_slots(jobs) == frozenset() and reads_waiting(jobs) == 0
    assert all(untouched(host, slot) for slot in range(3))


# -- every row of a value is the entry's own (issue #23, 4) -------------------------------------


def test_a_write_that_does_not_cover_its_slot_or_cannot_blank_its_holes_is_refused(
    redis_server: RedisServer, host: HostPool, make_jobs: MakeJobs
) -> None:
    jobs, store = make_jobs(redis_server.url)
    fill(host, 0, payload(70))
    key = make_key(70)
    results = jobs.write([
        (1, key, 0, ROWS - 1, (), ()),  # a tail, but where its rows lie is not known
        (2, key, 0, ROWS, (1,), ()),  # an empty row, but where rows lie is not known
    ])
    jobs.row_spans = ((0, PAYLOAD // ROWS),)
    results += jobs.write([(3, key, 0, ROWS, (ROWS,), ())])  # a row the slot does not have
    assert results == [JobResult.fail(i, FailureCause.WRONG_KEY) for i in (1, 2, 3)]
    assert jobs.flush_writes(5)
    assert store.batch_exists([remote_key(FINGERPRINT, 0, key, jobs.prefix)]).result(5).values == [False]
    assert jobs.take_stats().writes_failed == {"wrong_key": 3}


def test_an_entrys_empty_rows_are_written_as_zeros(
    redis_server: RedisServer, host: HostPool, make_jobs: MakeJobs
) -> None:
    jobs, _ = make_jobs(redis_server.url)
    row = PAYLOAD // ROWS
    jobs.row_spans = ((0, row),)  # one layer of ROWS rows (the 5000-byte payload's last bytes
    fill(host, 0, payload(71))    # past 4 rows are outside every row and stay as they are)
    key = make_key(71)
    assert jobs.write([(1, key, 0, ROWS, (0, 2), ())]) == [JobResult.done(1)]
    assert slot_bytes(host, 0)[:PAYLOAD] == payload(71)  # zeros in the value, not the slot
    assert jobs.flush_writes(5)
    host.buffer.fill_(SENTINEL)
    jobs.start_reads([(2, key, 1, 0)])
    assert causes(settle(jobs, 1)) == {2: None}
    want = bytearray(payload(71))
    want[0:row] = bytes(row)
    want[2 * row:3 * row] = bytes(row)
    assert slot_bytes(host, 1)[:PAYLOAD] == bytes(want)


def test_a_tail_is_written_as_only_its_rows_and_read_back_into_them(
    redis_server: RedisServer, host: HostPool, make_jobs: MakeJobs
) -> None:
    """A prompt's tail holds rows 0..n-1: its value carries those rows of every layer and
    nothing of the slot's other rows (a previous tenant's bytes); a read expecting a tail
    lands exactly those rows, and a value of another length is a miss."""
    jobs, store = make_jobs(redis_server.url)
    row = 500
    jobs.row_spans = ((0, row), (2500, row))  # two layers of ROWS rows each
    fill(host, 0, payload(72))
    key, whole = make_key(72), make_key(73)
    assert jobs.write([(1, key, 0, 2, (), ()), (2, whole, 0, ROWS, (), ())]) == [
        JobResult.done(1), JobResult.done(2)]
    assert jobs.flush_writes(5)
    value = store.batch_get([remote_key(FINGERPRINT, 0, key, jobs.prefix)]).result(5).values[0]
    assert value is not None and len(value) == value_bytes(2 * 2 * row)  # 2 rows x 2 layers
    assert jobs.take_stats().bytes_written == 2 * 2 * row + PAYLOAD
    host.buffer.fill_(SENTINEL)
    jobs.start_reads([(3, key, 1, 2), (4, whole, 2, 2), (5, key, 3, 0), (6, key, 4, ROWS + 1)])
    # A key names its last block, so it always holds the same rows: another length is
    # another geometry (``wrong_namespace``), never bytes to land.
    assert causes(settle(jobs, 4)) == {3: None, 4: FailureCause.WRONG_NAMESPACE,
                                       5: FailureCause.WRONG_NAMESPACE, 6: FailureCause.COPY_ERROR}
    want = bytearray([SENTINEL]) * PAYLOAD
    want[0:2 * row] = payload(72)[0:2 * row]
    want[2500:2500 + 2 * row] = payload(72)[2500:2500 + 2 * row]
    assert slot_bytes(host, 1)[:PAYLOAD] == bytes(want)
    assert slot_bytes(host, 2)[:PAYLOAD] == bytes([SENTINEL]) * PAYLOAD  # misses land nothing
