"""What a prompt's tail may put into the shared tier: nothing but its own rows (issues #23, 4
and #25, 1).

A tail entry holds the first blocks of its chunk; the other rows of its host slot still hold
whatever the slot held before, another tenant's KV included. A tail goes to Redis as a value
of only its own rows. Planner + transfer engine + a real redis-server, no vLLM: tenant B
(another ``cache_salt``) fills the host slots first, then tenant A's prompt (one whole chunk
and a one-block tail) is stored into the slots B's chunks left; every value in Redis is read
back and checked row by row.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest

from tests.remote.remote_helpers import FAST, wait_up
from tests.scheduler.test_planner import BLOCK, CHUNK_BLOCKS, CHUNK_TOKENS, FP, keys_for
from tests.transfer.transfer_helpers import drain, layout_caches, run_step
from tieredkv.config import TieredKVConfig
from tieredkv.keys import LazyChunkKeys
from tieredkv.protocol import FULL, SLIDING, FailureCause, Job, JobResult, KVGroup, SlotRows
from tieredkv.remote.codec import Pointer, Verified, decode, decode_pointer, value_bytes
from tieredkv.remote.threaded import ThreadedRemoteStore
from tieredkv.remote_url import parse_remote_url
from tieredkv.scheduler.planner import Planner
from tieredkv.scheduler.remote_tier import RemoteProbe, RemoteTier
from tieredkv.testing.hashing import sha256_block_hashes
from tieredkv.transfer.backends.torch_backend import TorchCopyBackend
from tieredkv.transfer.engine import TransferEngine
from tieredkv.transfer.host_pool import HostPool
from tieredkv.transfer.kv_views import KVViews
from tieredkv.transfer.remote_jobs import RemoteJobs

FINGERPRINT = hashlib.sha256(b"tests/scheduler remote tail writes").digest()
NUM_BLOCKS = 24
HOST_SLOTS = 2
A_TOKENS = list(range(CHUNK_TOKENS + 2 * BLOCK + 5))  # one whole chunk, two full blocks, 5 tokens
B_TOKENS = list(range(1000, 1000 + 2 * CHUNK_TOKENS))  # two whole chunks
A_BLOCKS = [0, 1, 2, 3, 4, 5]
B_BLOCKS = [6, 7, 8, 9, 10, 11, 12, 13]  # A's neighbours on the device


class Harness:
    """One engine: a planner, a CPU transfer engine whose RemoteJobs write to ``url``."""

    def __init__(self, url: str, prefix: str, layout: SlotRows | None = None) -> None:
        self.probe_store = ThreadedRemoteStore(parse_remote_url(url), **FAST)
        self.worker_store = ThreadedRemoteStore(parse_remote_url(url), **FAST)
        config = TieredKVConfig.from_dict({"chunk_blocks": CHUNK_BLOCKS, "host_bytes": "64MiB"})
        probe = RemoteProbe(self.probe_store, FINGERPRINT, 1, prefix=prefix, deadline_s=2.0)
        tier = RemoteTier(probe, is_up=lambda: self.probe_store.up, writes=True, admission=1,
                          seen_limit=1024, server_info=lambda: None)
        self.kv = KVViews.from_kv_caches(layout_caches(num_blocks=NUM_BLOCKS, seed=5), NUM_BLOCKS)
        rows = CHUNK_BLOCKS if layout is None else layout.rows
        self.host = HostPool(HOST_SLOTS, self.kv.slot_payload_bytes(rows), pin=False)
        self.jobs = RemoteJobs(self.worker_store, self.host, fingerprint=FINGERPRINT, rank=0,
                               prefix=prefix, ttl_s=None, timeout_s=2.0)
        self.engine = TransferEngine(self.kv, self.host, None, backend=TorchCopyBackend(),
                                     remote=self.jobs)
        self.planner = Planner(config, block_size=BLOCK, num_host_slots=HOST_SLOTS, remote=tier,
                               slot_rows=layout)
        for store in (self.probe_store, self.worker_store):
            assert wait_up(store, 5.0), store.stats()

    def step(self) -> None:
        run_step(self.planner, self.engine)

    def compute_and_store(self, req: str, tokens: list[int], blocks: list[int], salt: str,
                          keys: LazyChunkKeys | None = None) -> None:
        self.planner.set_block_ids(req, blocks, replace=True)
        keys = keys_for(tokens, salt) if keys is None else keys
        self.planner.plan_stores(req, keys, len(tokens), tail=True)
        for _ in range(50):
            self.step()
            if not self.planner.has_pending_work():
                break
        assert self.jobs.flush_writes(10.0)
        self.planner.finished(req)

    def close(self) -> None:
        self.engine.shutdown(timeout_s=2.0)
        self.probe_store.close(1.0)


@pytest.fixture
def harness(redis_server, prefix: str) -> Iterator[Harness]:
    made = Harness(redis_server.url, prefix)
    yield made
    made.close()


def _device_rows(kv: KVViews, blocks: list[int]) -> set[bytes]:
    return {bytes(kv.rows[layer][b].numpy().tobytes()) for layer in range(kv.num_layers)
            for b in blocks}


def _value_rows(kv: KVViews, payload: memoryview, per_layer: int = CHUNK_BLOCKS) -> list[bytes]:
    """A chunk value's payload as its rows: layer-major, ``per_layer`` rows each."""
    data, rows, at = bytes(payload), [], 0
    for block_bytes in kv.block_bytes:
        for _ in range(per_layer):
            rows.append(data[at:at + block_bytes])
            at += block_bytes
    assert at == len(data)
    return rows


def _written(redis_server, prefix: str) -> dict[bytes, bytes]:
    """Every value under this test's prefix, by the chunk key its header names."""
    import redis

    client = redis.Redis(host="127.0.0.1", port=redis_server.port)
    out: dict[bytes, bytes] = {}
    for name in client.scan_iter(match=f"{prefix}:*"):
        value = client.get(name)
        key = value[48:80]  # the header's key field (see tieredkv.remote.codec)
        out[key] = value
    client.close()
    return out


def test_a_tail_never_reaches_redis_with_another_tenants_rows(
    harness: Harness, redis_server, prefix: str,
) -> None:
    kv = harness.kv
    harness.compute_and_store("b", B_TOKENS, B_BLOCKS, salt="tenant-b")
    assert harness.planner.counters["remote_written_chunks"] == 2  # B's own two chunks
    b_values = set(_written(redis_server, prefix))
    # A's chunk and tail evict B's chunks: A's tail slot still holds B's rows 2..3.
    harness.compute_and_store("a", A_TOKENS, A_BLOCKS, salt="tenant-a")
    assert harness.planner.counters["stored_partial_chunks"] == 1  # the tail was stored

    a_keys = keys_for(A_TOKENS, "tenant-a")
    a_values = {k: v for k, v in _written(redis_server, prefix).items() if k not in b_values}
    foreign = _device_rows(kv, B_BLOCKS)
    tail_key = a_keys.block_key(CHUNK_BLOCKS + 1)  # a tail is keyed by its last block
    assert set(a_values) == {a_keys[0], tail_key}
    for key, value in a_values.items():
        blocks = CHUNK_BLOCKS if key == a_keys[0] else 2
        decoded = decode(value, fingerprint=FINGERPRINT, key=key, rank=0,
                         expected_len=blocks * sum(kv.block_bytes))
        assert isinstance(decoded, Verified), decoded
        rows = _value_rows(kv, decoded.payload, per_layer=blocks)
        leaked = sum(row in foreign for row in rows)
        assert not leaked, f"{leaked} rows of tenant B's KV written to Redis under A's key"
        first = 0 if key == a_keys[0] else CHUNK_BLOCKS
        want = [bytes(kv.rows[layer][b].numpy().tobytes()) for layer in range(kv.num_layers)
                for b in A_BLOCKS[first:first + blocks]]
        assert rows == want  # A's own blocks, exactly


def test_a_one_block_tail_stays_local(harness: Harness, redis_server, prefix: str) -> None:
    """A one-block tail has no aliases, like a whole chunk promoted after a restart whose
    disk header could not keep every alias: neither is written (a one-row value under a
    whole chunk's key would be a miss for every replica that reads it)."""
    tokens = list(range(CHUNK_TOKENS + BLOCK + 3))
    harness.compute_and_store("a", tokens, A_BLOCKS, salt="a")
    assert harness.planner.counters["stored_partial_chunks"] == 1
    assert set(_written(redis_server, prefix)) == {keys_for(tokens, "a")[0]}


@pytest.mark.parametrize("tail_blocks", [2, CHUNK_BLOCKS - 1])
def test_a_tail_is_written_as_its_own_rows_whatever_its_length(
    harness: Harness, redis_server, prefix: str, tail_blocks: int,
) -> None:
    tokens = list(range(CHUNK_TOKENS + tail_blocks * BLOCK + 3))
    harness.compute_and_store("a", tokens, list(range(2 * CHUNK_BLOCKS)), salt="a")
    assert harness.planner.counters["stored_partial_chunks"] == 1
    assert harness.planner.counters["remote_written_chunks"] == 2
    keys = keys_for(tokens, "a")
    written = _written(redis_server, prefix)
    assert set(written) == {keys[0], keys.block_key(CHUNK_BLOCKS + tail_blocks - 1)}
    row_bytes = sum(harness.kv.block_bytes)
    assert sorted(len(v) for v in written.values()) == sorted(
        value_bytes(n * row_bytes) for n in (tail_blocks, CHUNK_BLOCKS))


def test_a_longer_entry_written_turns_the_tail_it_grew_from_into_a_pointer(
    harness: Harness, redis_server, prefix: str,
) -> None:
    """A chat's next turn grows the tail into a whole chunk: Redis keeps one copy of the
    tail's rows. Its key stays (a prompt ending at the tail asks for its own block keys
    only), but its value becomes a pointer naming the whole chunk."""
    short = list(range(CHUNK_TOKENS + 2 * BLOCK + 3))  # chunk 0 and a two-block tail
    longer = list(range(2 * CHUNK_TOKENS + 1))  # the same prefix, now two whole chunks
    harness.compute_and_store("a", short, A_BLOCKS, salt="a")
    keys = keys_for(longer, "a")
    tail_key = keys.block_key(CHUNK_BLOCKS + 1)
    assert set(_written(redis_server, prefix)) == {keys[0], tail_key}
    harness.compute_and_store("b", longer, A_BLOCKS + [6, 7], salt="a")
    written = _written(redis_server, prefix)
    assert set(written) == {keys[0], tail_key, keys[1]}
    pointer = decode_pointer(written[tail_key], fingerprint=FINGERPRINT, key=tail_key, rank=0)
    assert pointer == Pointer(keys[1], CHUNK_BLOCKS)
    assert harness.jobs.store.stats().tails_superseded == 1


def test_a_longer_entry_names_only_the_tails_this_engine_knows_are_in_redis(
    harness: Harness, redis_server, prefix: str,
) -> None:
    """A tail another engine wrote and this one never read is not named: asking Redis about
    every shorter tail of every chunk written would cost a command each, nearly all for
    keys that were never written. That tail stays a copy of its own (and still serves)."""
    short = list(range(CHUNK_TOKENS + 2 * BLOCK + 3))
    longer = list(range(2 * CHUNK_TOKENS + 1))
    harness.compute_and_store("a", short, A_BLOCKS, salt="a")
    other = Harness(redis_server.url, prefix)
    try:
        other.compute_and_store("b", longer, A_BLOCKS + [6, 7], salt="a")
        keys = keys_for(longer, "a")
        tail_key = keys.block_key(CHUNK_BLOCKS + 1)
        written = _written(redis_server, prefix)
        assert set(written) == {keys[0], tail_key, keys[1]}
        assert isinstance(decode(written[tail_key], fingerprint=FINGERPRINT, key=tail_key, rank=0,
                                 expected_len=2 * sum(harness.kv.block_bytes)), Verified)
        assert other.jobs.store.stats().tails_superseded == 0
    finally:
        other.close()


def test_whole_chunks_under_keys_that_name_no_blocks_are_still_written(
    harness: Harness, redis_server, prefix: str,
) -> None:
    """Keys that are not block-granular (hybrid models, odd hash block sizes) give a whole
    chunk no aliases, like a one-block tail: there, no tail exists and the chunk is whole."""
    tokens = list(range(CHUNK_TOKENS + BLOCK + 3))
    keys = LazyChunkKeys(FP, sha256_block_hashes(tokens, BLOCK, "a"), CHUNK_BLOCKS)
    harness.compute_and_store("a", tokens, A_BLOCKS, salt="a", keys=keys)
    assert harness.planner.counters["stored_partial_chunks"] == 0
    assert harness.planner.counters["remote_written_chunks"] == 1
    assert set(_written(redis_server, prefix)) == {keys[0]}


@pytest.mark.parametrize("rows", [0, CHUNK_BLOCKS + 1])
def test_the_writer_refuses_a_job_that_names_rows_no_slot_has(
    harness: Harness, redis_server, prefix: str, rows: int,
) -> None:
    """Whatever the scheduler asks, the worker writes only values every row of which is the
    entry's: a write naming no rows (unknown) or more than a slot holds is refused."""
    harness.host.slot_memoryview(0)[:harness.host.payload_bytes] = b"\x5a" * harness.host.payload_bytes  # foreign rows
    job = Job.remote_write(7, keys_for(A_TOKENS, "tenant-a").block_key(0), 0, rows=rows)
    harness.engine.submit([job])
    assert drain(harness.engine, 10.0)
    assert harness.engine.poll() == [JobResult.fail(7, FailureCause.WRONG_KEY)]
    assert harness.jobs.flush_writes(10.0)
    assert _written(redis_server, prefix) == {}
    stats = harness.jobs.take_stats()
    assert (stats.writes_ok, stats.writes_failed) == (0, {"wrong_key": 1})


def test_the_writer_writes_a_job_that_covers_every_row(
    harness: Harness, redis_server, prefix: str,
) -> None:
    key = keys_for(A_TOKENS, "tenant-a")[0]
    harness.host.slot_memoryview(1)[:harness.host.payload_bytes] = b"\x33" * harness.host.payload_bytes
    harness.engine.submit([Job.remote_write(8, key, 1, rows=CHUNK_BLOCKS)])
    assert drain(harness.engine, 10.0)
    assert harness.engine.poll() == [JobResult.done(8)]
    assert harness.jobs.flush_writes(10.0)
    assert set(_written(redis_server, prefix)) == {key}


def test_a_hybrid_models_whole_chunks_are_written_with_zeros_in_their_empty_rows(
    redis_server, prefix: str,
) -> None:
    """A hybrid slot has ``chunk_blocks`` rows per KV-cache group; a sliding window keeps
    only its last rows and the others are never copied into the slot. The scheduler and the
    worker count the rows alike, so whole chunks reach Redis, and the rows the store left
    empty go out as zeros, never as what the slot held before (another tenant's rows)."""
    layout = SlotRows((KVGroup(SLIDING, 2), KVGroup(FULL)), chunk_blocks=CHUNK_BLOCKS)
    harness = Harness(redis_server.url, prefix, layout)
    kv = harness.kv
    try:
        harness.host.buffer.fill_(0x5A)  # what earlier tenants left in every slot
        tokens = list(range(2 * CHUNK_TOKENS + 5))
        keys = LazyChunkKeys(FP, sha256_block_hashes(tokens, BLOCK), CHUNK_BLOCKS)
        n = len(tokens) // BLOCK + 1
        tables = [list(range(1, 1 + n)), list(range(12, 12 + n))]
        harness.planner.set_block_ids("h", tables, replace=True)
        harness.planner.plan_stores("h", keys, len(tokens), computed_tokens=0)
        for _ in range(50):
            harness.step()
            if not harness.planner.has_pending_work():
                break
        assert harness.jobs.flush_writes(10.0)
        assert harness.planner.counters["remote_written_chunks"] == 2
        assert harness.jobs.take_stats().writes_failed == {}
        written = _written(redis_server, prefix)
        assert set(written) == {keys[0], keys[1]}

        for chunk in (0, 1):
            decoded = decode(written[keys[chunk]], fingerprint=FINGERPRINT, key=keys[chunk],
                             rank=0, expected_len=harness.host.payload_bytes)
            assert isinstance(decoded, Verified), decoded
            got = _value_rows(kv, decoded.payload, layout.rows)
            want = []
            for layer in range(kv.num_layers):
                for g, table in enumerate(tables):
                    for j in range(CHUNK_BLOCKS):
                        if g == 0 and j < CHUNK_BLOCKS - 2:  # the window keeps rows 2 and 3
                            want.append(bytes(kv.block_bytes[layer]))
                        else:
                            block = table[chunk * CHUNK_BLOCKS + j]
                            want.append(bytes(kv.rows[layer][block].numpy().tobytes()))
            stale = sum(row == b"\x5a" * len(row) for row in got)
            assert not stale, f"{stale} rows of what the slot held before written to Redis"
            assert got == want
    finally:
        harness.close()
