"""Hybrid models' tails in the shared tier (#25.1): a remote hit ends where a stored prompt
ended, as host and disk hits do.

A hybrid tail of ``n`` blocks keeps its full-attention rows ``0 .. n-1`` and each sliding
group's window before its end; its other rows are not the first rows of its slot, so it
goes to Redis as a whole slot's value with those rows written as zeros (``holes``), never as
what the slot held before. A fresh replica (empty host) finds it by its key in the same
probe, reads it as a whole slot and loads only the rows the entry kept. Planner + transfer
engine + a real redis-server, no vLLM; the device tables are the ones vLLM 0.32 hands out
(a sliding group gets real blocks only for the window before a hit's end).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import pytest

from tests.remote.remote_helpers import FAST, wait_up
from tests.scheduler.test_planner import BLOCK, CHUNK_BLOCKS
from tests.transfer.transfer_helpers import layout_caches, run_step
from tieredkv.config import TieredKVConfig
from tieredkv.keys import LazyChunkKeys
from tieredkv.protocol import FULL, NO_BLOCK, SLIDING, JobResult, KVGroup, Move, SlotRows
from tieredkv.remote.codec import Verified, decode
from tieredkv.remote.results import BatchResult
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

C = CHUNK_BLOCKS
FP = b"h" * 32
FINGERPRINT = hashlib.sha256(b"tests/scheduler remote hybrid tails").digest()
WINDOW = 2
LAYOUT = SlotRows((KVGroup(SLIDING, WINDOW), KVGroup(FULL)), chunk_blocks=C)
X = NO_BLOCK
NUM_BLOCKS = 48
HOST_SLOTS = 8
# One whole chunk, a 3-block tail, 5 tokens: a repeat and the chat's next turn both hit
# 7 blocks (vLLM's prefix cache: every full block before the last token).
TURN1 = [i for i in range((C + 3) * BLOCK + 5)]
TAIL_HIT = (C + 3) * BLOCK


def keys(tokens: list[int]) -> LazyChunkKeys:
    return LazyChunkKeys(FP, sha256_block_hashes(tokens, BLOCK), C, hashes_per_block=1)


def a_tables(tokens: list[int]) -> list[list[int]]:
    """The writer's device tables: both groups real blocks for every block computed."""
    n = -(-len(tokens) // BLOCK)
    return [list(range(1, 1 + n)), list(range(20, 20 + n))]


def vllm_tables(hit_blocks: int, total_blocks: int) -> list[list[int]]:
    """What vLLM allocates for a hit: the sliding group real blocks only for the window
    before the hit's end (and the new tokens), the full group all."""
    return [[0 if i < hit_blocks - WINDOW else 1 + i for i in range(total_blocks)],
            [20 + i for i in range(total_blocks)]]


# --- the write: a whole slot, its empty rows as holes (no Redis) ------------------------------


class AbsentStore:
    """A store whose every key is absent (the probe's answer does not matter here)."""

    def batch_exists(self, names, *, timeout_s=None) -> Future[BatchResult[bool]]:
        future: Future[BatchResult[bool]] = Future()
        future.set_result(BatchResult([False] * len(names)))
        return future


def test_a_hybrid_tail_is_queued_for_redis_as_a_whole_slot_with_its_empty_rows_as_holes():
    probe = RemoteProbe(AbsentStore(), FP, 1, deadline_s=1.0)
    tier = RemoteTier(probe, is_up=lambda: True, writes=True, admission=1, seen_limit=64)
    planner = Planner(TieredKVConfig.from_dict({"chunk_blocks": C}), block_size=BLOCK,
                      num_host_slots=HOST_SLOTS, remote=tier, slot_rows=LAYOUT)
    planner.set_block_ids("a", a_tables(TURN1), replace=True)
    planner.plan_stores("a", keys(TURN1), len(TURN1), tail=True, computed_tokens=0)
    stores = {job.key: job for job in planner.take_plan().of(Move.STORE)}
    planner.apply([JobResult.done(job.job_id) for job in stores.values()])
    writes = {job.key: job for job in planner.take_plan().of(Move.REMOTE_WRITE)}
    tail_key = keys(TURN1).block_key(C + 2)
    assert set(writes) == set(stores) == {keys(TURN1)[0], tail_key}
    for key, write in writes.items():
        empty = tuple(r for r, b in enumerate(stores[key].src.block_ids) if b == X)
        assert write.dst.rows == LAYOUT.rows, key  # the whole slot, read back as one
        assert write.dst.holes == empty, key  # every row its store left empty
    # The tail: sliding rows 1, 2 (the window before its end), full rows 0..2; nothing else.
    assert writes[tail_key].dst.holes == (0, 3, 7)
    assert writes[keys(TURN1)[0]].dst.holes == (0, 1)


# --- a fresh replica reads it (real Redis) --------------------------------------------------


class Replica:
    """One engine: a hybrid planner with the remote tier, a CPU transfer engine whose
    RemoteJobs read and write ``url``; its own KV bytes (``seed``) and empty host slots."""

    def __init__(self, url: str, prefix: str, seed: int) -> None:
        self.stores = [ThreadedRemoteStore(parse_remote_url(url), **FAST) for _ in range(2)]
        probe_store, worker_store = self.stores
        probe = RemoteProbe(probe_store, FINGERPRINT, 1, prefix=prefix, deadline_s=2.0)
        tier = RemoteTier(probe, is_up=lambda: probe_store.up, writes=True, admission=1,
                          seen_limit=1024, server_info=lambda: None)
        self.kv = KVViews.from_kv_caches(layout_caches(num_blocks=NUM_BLOCKS, seed=seed),
                                         NUM_BLOCKS)
        self.host = HostPool(HOST_SLOTS, self.kv.slot_payload_bytes(LAYOUT.rows), pin=False)
        self.host.buffer.fill_(0x5A)  # what earlier tenants left in every slot
        self.jobs = RemoteJobs(worker_store, self.host, fingerprint=FINGERPRINT, rank=0,
                               prefix=prefix, ttl_s=None, timeout_s=2.0)
        self.engine = TransferEngine(self.kv, self.host, None, backend=TorchCopyBackend(),
                                     remote=self.jobs)
        config = TieredKVConfig.from_dict({"chunk_blocks": C, "host_bytes": "64MiB"})
        self.planner = Planner(config, block_size=BLOCK, num_host_slots=HOST_SLOTS,
                               remote=tier, slot_rows=LAYOUT)
        for store in self.stores:
            assert wait_up(store, 5.0), store.stats()

    def step(self) -> None:
        run_step(self.planner, self.engine)

    def compute_and_store(self, req: str, tokens: list[int]) -> None:
        self.planner.set_block_ids(req, a_tables(tokens), replace=True)
        self.planner.plan_stores(req, keys(tokens), len(tokens), tail=True, computed_tokens=0)
        for _ in range(50):
            self.step()
            if not self.planner.has_pending_work():
                break
        assert self.jobs.flush_writes(10.0)
        self.planner.finished(req)

    def lookup(self, req: str, tokens: list[int], limit_s: float = 10.0) -> int:
        """Ask as vLLM does, one step between each "ask again", until an answer comes."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            hit = self.planner.lookup(req, keys(tokens), 0, len(tokens))
            if hit is not None:
                return hit
            self.step()
            time.sleep(0.002)
        raise AssertionError(f"lookup of {req} still 'ask again' after {limit_s} s")

    def close(self) -> None:
        self.engine.shutdown(timeout_s=2.0)
        self.stores[0].close(1.0)


@pytest.fixture
def make_replica(redis_server, prefix: str) -> Iterator[Callable[[int], Replica]]:
    made: list[Replica] = []

    def make(seed: int) -> Replica:
        made.append(Replica(redis_server.url, prefix, seed))
        return made[-1]

    yield make
    for replica in made:
        replica.close()


def row_bytes(kv: KVViews, block: int) -> list[bytes]:
    return [bytes(kv.rows[layer][block].numpy().tobytes()) for layer in range(kv.num_layers)]


def redis_value(redis_server, prefix: str, key: bytes) -> bytes:
    import redis

    client = redis.Redis(host="127.0.0.1", port=redis_server.port)
    try:
        for name in client.scan_iter(match=f"{prefix}:*"):
            value = client.get(name)
            if value[48:80] == key:  # the header's key field (see tieredkv.remote.codec)
                return value
    finally:
        client.close()
    raise AssertionError(f"{key.hex()} is not in Redis")


def test_the_tails_value_holds_its_rows_and_zeros_never_what_the_slot_held(
        make_replica, redis_server, prefix: str):
    a = make_replica(5)
    a.compute_and_store("a", TURN1)
    assert a.planner.counters["remote_written_chunks"] == 2
    assert a.jobs.take_stats().writes_failed == {}
    tail_key = keys(TURN1).block_key(C + 2)
    decoded = decode(redis_value(redis_server, prefix, tail_key), fingerprint=FINGERPRINT,
                     key=tail_key, rank=0, expected_len=a.host.payload_bytes)
    assert isinstance(decoded, Verified), decoded
    data, at, tables = bytes(decoded.payload), 0, a_tables(TURN1)
    for layer, size in enumerate(a.kv.block_bytes):
        for row in range(LAYOUT.rows):
            g, j = divmod(row, C)
            got, at = data[at:at + size], at + size
            if row in LAYOUT.empty_rows(3):
                assert got == bytes(size), (layer, row)  # zeros, not the slot's 0x5A
            else:
                assert got == row_bytes(a.kv, tables[g][C + j])[layer], (layer, row)
    assert at == len(data)


@pytest.mark.parametrize("extra", [0, 40], ids=["repeat", "next_turn"])
def test_a_fresh_replica_hits_a_hybrid_tail_in_redis_where_the_prompt_ended(
        make_replica, extra: int):
    """The repeat asks for the tail with the chunks (the tail lies in the prompt's last
    chunk); the chat's next turn asks once Redis's run of whole chunks ended before it."""
    a = make_replica(5)
    a.compute_and_store("a", TURN1)
    b = make_replica(9)  # empty host, other KV bytes; only Redis is shared
    tokens = TURN1 + [50_000 + i for i in range(extra)]
    assert b.lookup("b", tokens) == TAIL_HIT
    assert b.planner.counters["remote_read_chunks"] == 2  # the chunk and the tail
    total = -(-len(tokens) // BLOCK)
    tables = vllm_tables(TAIL_HIT // BLOCK, total)
    b.planner.on_alloc("b", tables, TAIL_HIT)
    plan = b.planner.take_plan()
    (load,) = plan.of(Move.LOAD)
    assert not load.src.unserved
    # Only the rows the tail kept, where vLLM gave real blocks: never a row of zeros.
    assert load.src.chunks[-1].block_ids == (X, 6, 7, X, 24, 25, 26, X)
    b.engine.submit([load])
    run_step(b.planner, b.engine)  # the load's result
    assert b.planner.counters.snapshot()["hit_tokens"] == {"remote": TAIL_HIT}
    a_blocks = a_tables(TURN1)
    for offset, chunk in enumerate(load.src.chunks):
        for row, block in enumerate(chunk.block_ids):
            if block != X:
                g, j = divmod(row, C)
                assert row_bytes(b.kv, block) == row_bytes(a.kv, a_blocks[g][offset * C + j])


def test_a_longer_entry_in_redis_keeps_the_hybrid_tail_that_ends_a_hit(make_replica):
    """A longer entry of the tail's chunk holds its blocks but not the window before its end:
    it never supersedes the tail, in Redis as on host and disk. A prompt ending at the tail
    still hits there on a fresh replica, and the longer prompt its own chunks."""
    longer = [i for i in range(2 * C * BLOCK + 3)]  # TURN1's prefix, two whole chunks
    a = make_replica(5)
    a.compute_and_store("a", TURN1)
    a.compute_and_store("long", longer)
    assert a.planner.counters["remote_written_chunks"] == 3  # chunk 0, the tail, chunk 1
    assert a.jobs.store.stats().tails_superseded == 0  # the tail keeps its own value
    b = make_replica(9)
    turn2 = TURN1 + [50_000 + i for i in range(40)]
    assert b.lookup("t2", turn2) == TAIL_HIT
    c = make_replica(11)
    again = longer + [70_000 + i for i in range(30)]
    assert c.lookup("l2", again) == 2 * C * BLOCK


def test_a_repeat_of_a_block_aligned_prompt_hits_the_shorter_tail_not_the_one_past_its_limit(
        make_replica):
    """A prompt ending on a block boundary leaves two tails in Redis: its own (3 blocks) and
    the one a block shorter, where a repeat's hit ends (vLLM never covers the last token).
    The probe asks only for tails ending by that limit: the longer one, found too, would be
    the longest and could not serve (its window ends a block later)."""
    aligned = TURN1[:(C + 3) * BLOCK]
    a = make_replica(5)
    a.compute_and_store("a", aligned)
    assert a.planner.counters["remote_written_chunks"] == 3  # the chunk and both tails
    b = make_replica(9)
    assert b.lookup("b", aligned) == (C + 2) * BLOCK
    assert b.planner.counters["remote_read_chunks"] == 2


# --- the probe's wait, weighed against what the tail saves (cost model on) ----------------------


def test_a_request_waits_for_a_hybrid_tails_probe_as_long_as_the_tail_could_save():
    """Host holds the prompt's whole chunk; only its 3-block tail is in Redis. The probe's
    wait is weighed against recomputing up to the tail's end (48 tokens, 0.75 ms at
    64,000 tokens/s), not the chunk-aligned limit (0 tokens: given up at once)."""
    from tests.scheduler.test_cost_model_planner import Clock, fast_engine
    from tests.scheduler.test_remote_tier import FP as STORE_FP
    from tests.scheduler.test_remote_tier import Store

    clock = Clock()
    store = Store()
    probe = RemoteProbe(store, STORE_FP, 1, deadline_s=10.0, clock=clock)
    tier = RemoteTier(probe, is_up=lambda: True, writes=False, admission=1, seen_limit=64,
                      clock=clock)
    planner = Planner(TieredKVConfig.from_dict({"chunk_blocks": C}), block_size=BLOCK,
                      num_host_slots=HOST_SLOTS, remote=tier, slot_rows=LAYOUT, clock=clock)
    fast_engine(planner, clock)
    head = TURN1[:C * BLOCK + 5]  # the whole chunk only (no tail, no repeat entry)
    planner.set_block_ids("w", a_tables(head), replace=True)
    planner.plan_stores("w", keys(head), len(head), tail=True, computed_tokens=0)
    planner.apply([JobResult.done(job.job_id) for job in planner.take_plan().of(Move.STORE)])
    planner.finished("w")
    tail_key = keys(TURN1).block_key(C + 2)
    store.put(tail_key)
    store.hold = True
    assert planner.lookup("r", keys(TURN1), 0, len(TURN1)) is None  # the probe is out
    clock.now += 0.0005
    assert planner.lookup("r", keys(TURN1), 0, len(TURN1)) is None  # still worth waiting
    store.release()
    assert planner.lookup("r", keys(TURN1), 0, len(TURN1)) is None  # reading the tail
    (read,) = planner.take_plan().of(Move.REMOTE_READ)
    assert (read.key, read.src.rows) == (tail_key, 0)  # a whole slot's value
    planner.apply([JobResult.done(read.job_id)])
    assert planner.lookup("r", keys(TURN1), 0, len(TURN1)) == TAIL_HIT
