"""Two replicas sharing a real Redis: planner + transfer engine + KV bytes, no vLLM.

Each replica is what one vLLM engine runs: a :class:`Planner` with the remote tier's probe,
a :class:`TransferEngine` on CPU KV caches whose ``RemoteJobs`` read and write the same
Redis (one node, or a 3-master Cluster). Replica A computes and stores a prompt; replica B,
whose KV caches hold other bytes, must load A's bytes exactly, or miss for a stated cause.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tests.remote.remote_helpers import FAST, wait_up
from tests.scheduler.test_planner import BLOCK, CHUNK_BLOCKS, CHUNK_TOKENS, keys_for
from tests.transfer.transfer_helpers import drain, layout_caches, run_step
from tieredkv.config import TieredKVConfig
from tieredkv.protocol import Move
from tieredkv.remote.codec import HEADER_BYTES, remote_key
from tieredkv.remote_url import parse_remote_url
from tieredkv.scheduler.planner import Planner
from tieredkv.scheduler.remote_tier import RemoteProbe, RemoteTier
from tieredkv.transfer.backends.torch_backend import TorchCopyBackend
from tieredkv.transfer.engine import TransferEngine
from tieredkv.transfer.host_pool import HostPool
from tieredkv.transfer.kv_views import KVViews
from tieredkv.transfer.remote_jobs import RemoteJobs

NUM_BLOCKS = 48
FINGERPRINT = hashlib.sha256(b"tests/scheduler remote replicas").digest()
OTHER_FINGERPRINT = hashlib.sha256(b"another model or setting").digest()
TOKENS = list(range(5 * CHUNK_TOKENS + 9))  # 5 whole chunks and a partial one
B_BLOCKS = list(range(20, 20 + len(TOKENS) // BLOCK + 1))  # B's device blocks for the prompt


@dataclass
class Replica:
    planner: Planner
    engine: TransferEngine
    kv: KVViews
    stores: list[Any]

    def step(self) -> None:
        """One scheduler step: the plan's jobs run on the worker, results come back."""
        run_step(self.planner, self.engine)

    def settle(self) -> None:
        """Step until nothing is in flight (stores, remote writes), then flush the queue."""
        for _ in range(50):
            self.step()
            if not self.planner.has_pending_work():
                break
        remote = self.engine._remote.jobs
        assert remote is not None and remote.flush_writes(10.0)

    def compute_and_store(self, req: str, tokens: list[int], blocks: list[int]) -> None:
        """The prompt was computed into ``blocks``: store its chunks (and tail)."""
        self.planner.set_block_ids(req, blocks, replace=True)
        self.planner.plan_stores(req, keys_for(tokens), len(tokens), tail=True)
        self.settle()
        self.planner.finished(req)

    def lookup(self, req: str, tokens: list[int], limit_s: float = 10.0) -> int:
        """Ask as vLLM does, one step between each "ask again", until an answer comes."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            hit = self.planner.lookup(req, keys_for(tokens), 0, len(tokens))
            if hit is not None:
                return hit
            self.step()
            time.sleep(0.002)
        raise AssertionError(f"lookup of {req} still 'ask again' after {limit_s} s")

    def load(self, req: str, hit: int, blocks: list[int]) -> None:
        self.planner.on_alloc(req, blocks, hit)
        self.step()


@pytest.fixture
def make_replica(prefix: str) -> Iterator[Callable[..., Replica]]:
    """Factory: a replica on ``url`` with its own KV bytes (``seed``) and stores."""
    from tieredkv.remote.threaded import ThreadedRemoteStore

    made: list[Replica] = []

    def make(url: str, *, seed: int, fingerprint: bytes = FINGERPRINT, writes: bool = True,
             timeout_s: float = 2.0, store_options: dict | None = None) -> Replica:
        options = {**FAST, "timeout_s": timeout_s, **(store_options or {})}
        probe_store = ThreadedRemoteStore(parse_remote_url(url), **options)
        worker_store = ThreadedRemoteStore(parse_remote_url(url), **options)
        config = TieredKVConfig.from_dict({"chunk_blocks": CHUNK_BLOCKS, "host_bytes": "64MiB"})
        probe = RemoteProbe(probe_store, fingerprint, 1, prefix=prefix, deadline_s=timeout_s)
        tier = RemoteTier(probe, is_up=lambda: probe_store.up, writes=writes, admission=1,
                          seen_limit=1024,
                          server_info=lambda: probe_store.run(probe_store.store.server_info, None))
        kv = KVViews.from_kv_caches(layout_caches(num_blocks=NUM_BLOCKS, seed=seed), NUM_BLOCKS)
        host = HostPool(16, kv.slot_payload_bytes(CHUNK_BLOCKS), pin=False)
        jobs = RemoteJobs(worker_store, host, fingerprint=fingerprint, rank=0, prefix=prefix,
                          ttl_s=None, timeout_s=timeout_s)
        engine = TransferEngine(kv, host, None, backend=TorchCopyBackend(), remote=jobs)
        planner = Planner(config, block_size=BLOCK, num_host_slots=16, remote=tier)
        replica = Replica(planner, engine, kv, [probe_store, worker_store])
        made.append(replica)
        for store in replica.stores:
            wait_up(store, 5.0)
        return replica

    yield make
    for replica in made:
        replica.engine.shutdown(timeout_s=2.0)
        replica.stores[0].close(1.0)


def _rows(kv: KVViews, blocks: list[int]) -> list[torch.Tensor]:
    return [kv.rows[layer][b].clone() for layer in range(kv.num_layers) for b in blocks]


def _redis(url: str) -> Any:
    import redis

    parsed = parse_remote_url(url)
    if parsed.cluster:
        return redis.RedisCluster(host=parsed.host, port=parsed.port)
    return redis.Redis(host=parsed.host, port=parsed.port, db=parsed.db)


def test_a_prompt_stored_by_one_replica_is_loaded_by_another_bit_exact(make_replica, deployment):
    a = make_replica(deployment, seed=1)
    b = make_replica(deployment, seed=2)
    a_blocks = list(range(len(TOKENS) // BLOCK + 1))
    a.compute_and_store("a", TOKENS, a_blocks)
    assert a.planner.counters["remote_written_chunks"] == 5  # whole chunks only, not the tail
    whole = 5 * CHUNK_TOKENS
    hit = b.lookup("b", TOKENS)
    assert hit == whole
    assert b.planner.counters["remote_read_chunks"] == 5
    assert b.planner.hit_tokens("b") == {}  # nothing is loaded before vLLM allocates
    before = _rows(b.kv, B_BLOCKS[: whole // BLOCK])
    b.load("b", hit, B_BLOCKS)
    assert b.planner.hit_tokens("b") == {"host": 0, "disk": 0, "remote": whole}
    assert b.planner.counters["hit_tokens", "remote"] == whole
    got = _rows(b.kv, B_BLOCKS[: whole // BLOCK])
    assert all(torch.equal(x, y) for x, y in zip(got, _rows(a.kv, a_blocks[: whole // BLOCK]), strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(got, before, strict=True))  # bytes really moved


def test_a_corrupted_or_foreign_value_is_a_miss_counted_by_cause(make_replica, redis_server, prefix):
    url = redis_server.url
    a = make_replica(url, seed=1)
    a.compute_and_store("a", TOKENS, list(range(len(TOKENS) // BLOCK + 1)))
    chunk_keys = keys_for(TOKENS).materialize(5)
    client = _redis(url)
    third = remote_key(FINGERPRINT, 0, chunk_keys[2], prefix)
    value = bytearray(client.get(third))
    value[HEADER_BYTES + 7] ^= 0x40  # one bit of the payload
    client.set(third, bytes(value))
    b = make_replica(url, seed=2)
    assert b.lookup("b", TOKENS) == 2 * CHUNK_TOKENS  # the prefix up to the corrupted chunk
    assert b.planner.counters["remote_read_failed", "checksum"] == 1
    # A value written for another chunk, copied under this chunk's name: wrong key.
    client.set(remote_key(FINGERPRINT, 0, chunk_keys[0], prefix),
               client.get(remote_key(FINGERPRINT, 0, chunk_keys[1], prefix)))
    c = make_replica(url, seed=3)
    assert c.lookup("c", TOKENS) == 0
    assert c.planner.counters["remote_read_failed", "wrong_key"] == 1


def test_another_namespace_never_sees_the_entries(make_replica, redis_server):
    a = make_replica(redis_server.url, seed=1)
    a.compute_and_store("a", TOKENS, list(range(len(TOKENS) // BLOCK + 1)))
    other = make_replica(redis_server.url, seed=2, fingerprint=OTHER_FINGERPRINT)
    assert other.lookup("b", TOKENS) == 0
    other.planner.take_counter_deltas()  # folds the probe's counters in
    assert other.planner.counters["remote_probes"] == 1
    assert other.planner.counters["remote_read_chunks"] == 0


def test_reset_forgets_hints_but_never_flushes_the_shared_tier(make_replica, redis_server, prefix):
    a = make_replica(redis_server.url, seed=1)
    a.compute_and_store("a", TOKENS, list(range(len(TOKENS) // BLOCK + 1)))
    client = _redis(redis_server.url)
    before = len(client.keys(f"{prefix}:*"))
    assert before == 5
    a.planner.reset()
    assert len(client.keys(f"{prefix}:*")) == before
    b = make_replica(redis_server.url, seed=2)
    assert b.lookup("b", TOKENS) == 5 * CHUNK_TOKENS


def test_a_read_only_replica_writes_nothing(make_replica, redis_server, prefix):
    a = make_replica(redis_server.url, seed=1, writes=False)
    a.compute_and_store("a", TOKENS, list(range(len(TOKENS) // BLOCK + 1)))
    assert a.planner.counters["remote_written_chunks"] == 0
    assert _redis(redis_server.url).keys(f"{prefix}:*") == []


def test_redis_down_at_start_answers_at_once_and_serves_local_hits(make_replica, fresh_server):
    server = fresh_server(start=False)  # nothing listens on its port
    a = make_replica(server.url, seed=1)
    assert not a.planner.remote.up
    keys = keys_for(TOKENS)
    assert a.planner.lookup("x", keys, 0, len(TOKENS)) == 0  # no "ask again" while down
    a.planner.finished("x")
    a.planner.set_block_ids("a", list(range(len(TOKENS) // BLOCK + 1)), replace=True)
    a.planner.plan_stores("a", keys, len(TOKENS), tail=True)
    a.step()
    a.planner.finished("a")
    for _ in range(5):
        a.step()  # the writes were dropped (store down), counted
    assert a.planner.counters["remote_writes_dropped"] == 5
    assert a.planner.lookup("b", keys_for(TOKENS), 0, len(TOKENS)) == len(TOKENS) // BLOCK * BLOCK


def test_a_request_preempted_after_a_remote_hit_reads_it_again_once_resumed(make_replica,
                                                                             redis_server):
    # Preempted, a request is looked up again from its first token: if host lost the chunks
    # it read from Redis meanwhile, the shared tier is asked again, not skipped as answered.
    a = make_replica(redis_server.url, seed=1)
    a.compute_and_store("a", TOKENS, list(range(len(TOKENS) // BLOCK + 1)))
    b = make_replica(redis_server.url, seed=2)
    whole = 5 * CHUNK_TOKENS
    hit = b.lookup("b", TOKENS)
    assert hit == whole
    b.load("b", hit, B_BLOCKS)
    for n in range(4):  # other prompts take every host slot (16)
        other = [t + 100_000 * (n + 1) for t in TOKENS]
        b.compute_and_store(f"o{n}", other, list(range(len(other) // BLOCK + 1)))
    assert not any(b.planner.host.is_ready(k) for k in keys_for(TOKENS).materialize(5))
    b.planner.preempted("b")
    b.step()
    assert b.lookup("b", TOKENS) == whole
    assert b.planner.counters["remote_read_chunks"] == 10


def test_redis_partitioned_mid_serving_gives_up_at_the_deadline(make_replica, fresh_server):
    server = fresh_server()
    a = make_replica(server.url, seed=1, timeout_s=0.3)
    a.compute_and_store("a", TOKENS, list(range(len(TOKENS) // BLOCK + 1)))
    # No health pings meanwhile: the lookup itself must find out, within its deadline.
    b = make_replica(server.url, seed=2, timeout_s=0.3, store_options={"health_interval_s": 600})
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)  # a partition: connections hang, nothing answers
    try:
        assert b.lookup("b", TOKENS, limit_s=10.0) == 0
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    b.planner.take_counter_deltas()  # folds the probe's counters in
    failed = {k[1]: v for k, v in b.planner.counters.items()
              if isinstance(k, tuple) and k[0] == "remote_probe_failed"}
    # The deadline passed, or the store's own timeout (or a reset connection) answered first.
    assert sum(failed.values()) == 1 and set(failed) <= {
        "timeout", "io_error", "unavailable"}, failed  # unavailable: a ping found it down first
    assert b.planner.counters["remote_read_chunks"] == 0


def _wait_gauges(replica: Replica, name: str, limit_s: float = 10.0) -> dict[str, int]:
    """The planner's gauges once ``name`` is in them (the server is asked in the background)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        gauges = replica.planner.gauges()
        if name in gauges:
            return gauges
        time.sleep(0.01)
    raise AssertionError(f"{name} never reported")


def test_keys_redis_evicts_are_misses_and_counted(make_replica, fresh_server, prefix):
    server = fresh_server("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")
    a = make_replica(server.url, seed=1)
    a.compute_and_store("a", TOKENS, list(range(len(TOKENS) // BLOCK + 1)))
    gauges = _wait_gauges(a, "remote_used_bytes")
    assert gauges["remote_capacity_bytes"] == 4 * 1024 * 1024 and gauges["remote_used_bytes"] > 0
    assert gauges["remote_up"] == 1
    client = _redis(server.url)
    # Another tenant's writes: Redis's (sampled, approximate) LRU evicts A's older chunks.
    for i in range(2000):
        client.set(f"filler:{i}", b"x" * (128 << 10))
        if i >= 64 and not client.keys(f"{prefix}:*"):
            break
    assert client.keys(f"{prefix}:*") == []
    b = make_replica(server.url, seed=2)
    assert b.lookup("b", TOKENS) == 0
    deadline = time.monotonic() + 15.0
    while a.planner.counters["evictions", "remote"] == 0 and time.monotonic() < deadline:
        a.planner.remote._info_at = float("-inf")  # type: ignore[union-attr] # now, not in 5 s
        a.planner.gauges()
        time.sleep(0.05)
    assert a.planner.counters["evictions", "remote"] >= 5


def test_a_probe_sent_on_arrival_saves_the_first_ask_again(make_replica, redis_server):
    a = make_replica(redis_server.url, seed=1)
    a.compute_and_store("a", TOKENS, list(range(len(TOKENS) // BLOCK + 1)))
    b = make_replica(redis_server.url, seed=2)
    b.planner.prefetch_remote("b", keys_for(TOKENS), len(TOKENS))  # vLLM's on_new_request
    probe = b.planner.remote.probe  # type: ignore[union-attr]
    deadline = time.monotonic() + 10.0
    while probe.in_flight("b") and time.monotonic() < deadline:
        time.sleep(0.002)  # the forward pass vLLM runs meanwhile
    # The first lookup already knows what Redis holds: it reads the chunks at once.
    assert b.planner.lookup("b", keys_for(TOKENS), 0, len(TOKENS)) is None
    plan = b.planner.take_plan()
    assert len(plan.of(Move.REMOTE_READ)) == 5
    b.engine.submit(plan.of(Move.REMOTE_READ))
    assert drain(b.engine, 10.0)
    b.planner.apply(b.engine.poll())
    assert b.planner.lookup("b", keys_for(TOKENS), 0, len(TOKENS)) == 5 * CHUNK_TOKENS
    b.planner.take_counter_deltas()
    assert b.planner.counters["remote_probes"] == 1


@pytest.mark.parametrize("tokens", [
    5 * CHUNK_TOKENS + 2 * BLOCK + 7,  # five chunks and a two-block tail
    2 * CHUNK_TOKENS + (CHUNK_BLOCKS - 1) * BLOCK + 1,  # the longest tail a chunk has
    2 * BLOCK + 5,  # shorter than a chunk: the tail is all there is
    3 * CHUNK_TOKENS + BLOCK // 2,  # no full block past the chunks: nothing more to find
])
def test_a_prompts_tail_in_redis_makes_the_hit_as_long_as_vllms_prefix_cache(
        make_replica, deployment, tokens):
    """Replica B's hit for replica A's prompt ends where vLLM's own prefix cache would end
    (the last full block before the prompt's last token), not at the last whole chunk: A's
    tail is in Redis as a value of its own rows, B finds it in the same probe, reads it into
    a host slot and loads A's bytes exactly."""
    prompt = list(range(7, 7 + tokens))
    a = make_replica(deployment, seed=1)
    b = make_replica(deployment, seed=2)
    blocks = -(-tokens // BLOCK)
    a_blocks, b_blocks = list(range(blocks)), list(range(20, 20 + blocks))
    a.compute_and_store("a", prompt, a_blocks)
    prefix_cache_hit = (tokens - 1) // BLOCK * BLOCK  # vLLM's: full blocks, never the last token
    hit = b.lookup("b", prompt)
    assert hit == prefix_cache_hit
    if hit == 0:
        return
    b.load("b", hit, b_blocks)
    assert b.planner.hit_tokens("b") == {"host": 0, "disk": 0, "remote": hit}
    n = hit // BLOCK
    got = _rows(b.kv, b_blocks[:n])
    assert all(torch.equal(x, y) for x, y in zip(got, _rows(a.kv, a_blocks[:n]), strict=True))


@pytest.mark.parametrize("turn1", [
    2 * CHUNK_TOKENS + 2 * BLOCK + 5,  # a two-block tail in chunk 2
    CHUNK_TOKENS + (CHUNK_BLOCKS - 1) * BLOCK,  # the longest tail a chunk has
])
def test_a_chats_next_turn_on_another_replica_hits_the_previous_turns_tail(
        make_replica, deployment, turn1):
    """A chat's next turn on replica B: replica A stored turn 1 (whole chunks and a tail);
    turn 2 is turn 1 and more, so its whole-chunk run in Redis ends at the chunk holding
    turn 1's tail. B asks for that chunk's block keys once the chunks answered, and its hit
    ends where turn 1's full blocks end, as vLLM's prefix cache would on A."""
    first = list(range(11, 11 + turn1))
    second = first + list(range(5000, 5000 + 3 * CHUNK_TOKENS + 7))  # the answer and a new message
    a = make_replica(deployment, seed=1)
    b = make_replica(deployment, seed=2)
    a_blocks = list(range(-(-turn1 // BLOCK)))
    a.compute_and_store("a", first, a_blocks)
    hit = b.lookup("b", second)
    assert hit == turn1 // BLOCK * BLOCK
    b_blocks = list(range(20, 20 + -(-len(second) // BLOCK)))
    b.load("b", hit, b_blocks)
    assert b.planner.hit_tokens("b") == {"host": 0, "disk": 0, "remote": hit}
    n = hit // BLOCK
    got = _rows(b.kv, b_blocks[:n])
    assert all(torch.equal(x, y) for x, y in zip(got, _rows(a.kv, a_blocks[:n]), strict=True))
    b.planner.take_counter_deltas()
    assert b.planner.counters["remote_probes"] == 2  # the chunks, then the tail inside


def test_a_tail_that_could_add_no_token_is_never_asked_for(make_replica, redis_server):
    """vLLM's own cache already covers every block a hit could use: the lookup answers 0 at
    once instead of waiting for a probe of the tail (review of #25)."""
    prompt = list(range(3, 3 + 2 * CHUNK_TOKENS + 2 * BLOCK + 5))
    a = make_replica(redis_server.url, seed=1)
    a.compute_and_store("a", prompt, list(range(-(-len(prompt) // BLOCK))))
    b = make_replica(redis_server.url, seed=2)
    limit = (len(prompt) - 1) // BLOCK * BLOCK
    assert b.planner.lookup("b", keys_for(prompt), limit, len(prompt)) == 0
    b.planner.take_counter_deltas()
    assert b.planner.counters["remote_probes"] == 0


def test_a_local_tail_serving_every_usable_block_wins_over_a_remote_one(make_replica, redis_server):
    """Redis holds a three-block tail whose last block the hit cannot use (the prompt ends on
    that block's boundary); host holds a two-block tail of the same prefix: the hit is served
    from host at once, no remote read (review of #25)."""
    prompt = list(range(9, 9 + CHUNK_TOKENS + 3 * BLOCK))
    a = make_replica(redis_server.url, seed=1)
    a.compute_and_store("a", prompt, list(range(len(prompt) // BLOCK)))
    b = make_replica(redis_server.url, seed=2)
    shorter = prompt[:CHUNK_TOKENS + 2 * BLOCK + 5]
    b.compute_and_store("s", shorter, list(range(20, 20 + -(-len(shorter) // BLOCK))))
    hit = b.planner.lookup("b", keys_for(prompt), 0, len(prompt))
    assert hit == CHUNK_TOKENS + 2 * BLOCK
    assert b.planner.take_plan().of(Move.REMOTE_READ) == []


def test_a_shorter_prompt_still_hits_its_tail_after_the_chat_moved_on(make_replica, redis_server):
    """Replica A served turn 1 (a tail in chunk 1), then turn 2 stored chunk 1 whole: a
    retry of turn 1 on replica B still hits all of turn 1's full blocks from Redis (the tail
    stays there; B could never find turn 2's longer entry under turn 1's keys)."""
    turn1 = list(range(4, 4 + CHUNK_TOKENS + 2 * BLOCK + 3))
    turn2 = turn1 + list(range(900, 900 + CHUNK_TOKENS))
    a = make_replica(redis_server.url, seed=1)
    a.compute_and_store("t1", turn1, list(range(-(-len(turn1) // BLOCK))))
    a.compute_and_store("t2", turn2, list(range(-(-len(turn2) // BLOCK))))
    b = make_replica(redis_server.url, seed=2)
    assert b.lookup("b", turn1) == (len(turn1) - 1) // BLOCK * BLOCK
