"""The remote tier as the planner sees it, on its own: a real probe over an in-memory store
whose answers the test releases, so nothing waits on a clock or a server (the same tier on a
real redis-server: test_remote_replicas.py, test_remote_tail_writes.py)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

from tieredkv.metrics.specs import Count, Counts
from tieredkv.protocol import FailureCause, Job, Move, StepPlan, Tier
from tieredkv.remote.codec import RemoteKeyNames
from tieredkv.remote.results import BatchResult
from tieredkv.scheduler.lower_tier import LowerTier
from tieredkv.scheduler.remote_tier import INFO_INTERVAL_S, RemoteProbe, RemoteTier

FP = b"f" * 32
K = [bytes([i]) * 32 for i in range(6)]


class Store:
    """Redis keys present in memory; ``hold``: answers wait until :meth:`release`."""

    def __init__(self, world: int = 1) -> None:
        self.names = [RemoteKeyNames(FP, rank) for rank in range(world)]
        self.present: set[bytes] = set()
        self.calls: list[list[bytes]] = []
        self.hold = False
        self._waiting: list[tuple[Future[BatchResult[bool]], BatchResult[bool]]] = []

    def put(self, key: bytes, ranks: Sequence[int] | None = None) -> None:
        for rank in range(len(self.names)) if ranks is None else ranks:
            self.present.add(self.names[rank](key))

    def batch_exists(self, keys: Sequence[bytes], *, timeout_s: float | None = None
                     ) -> Future[BatchResult[bool]]:
        self.calls.append(list(keys))
        future: Future[BatchResult[bool]] = Future()
        answer = BatchResult([key in self.present for key in keys], latency_s=0.002)
        if self.hold:
            self._waiting.append((future, answer))
        else:
            future.set_result(answer)
        return future

    def release(self) -> None:
        for future, answer in self._waiting:
            future.set_result(answer)
        self._waiting.clear()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def remote_tier(store: Store, *, up: bool = True, writes: bool = True, admission: int = 1,
           written_capacity: int = 64, server_info=None, clock: Clock | None = None) -> RemoteTier:
    clock = clock or Clock()
    probe = RemoteProbe(store, FP, len(store.names), deadline_s=10.0, clock=clock)
    return RemoteTier(probe, is_up=lambda: up, writes=writes, admission=admission, seen_limit=64,
                      written_capacity=written_capacity, server_info=server_info, clock=clock)


def answer(tier: RemoteTier, req_id: str, keys: Sequence[bytes]) -> int | None:
    """A lookup's two calls: the first sends the probe (never waits), the next reads it."""
    assert tier.poll(req_id, keys) is None
    return tier.poll(req_id, keys)


def test_the_remote_tier_is_a_lower_tier_without_an_index():
    tier = remote_tier(Store())
    assert isinstance(tier, LowerTier)
    assert (tier.name, tier.fill_move, tier.fill_counter) == (Tier.REMOTE, Move.REMOTE_READ,
                                                              Count.REMOTE_READ_CHUNKS)


def test_poll_never_waits_and_answers_the_leading_chunks_every_rank_holds():
    store = Store(world=2)
    for key in (K[0], K[1], K[3]):
        store.put(key)
    store.put(K[2], ranks=[0])  # rank 1's shard is missing: the run ends there
    store.hold = True
    tier = remote_tier(store)
    assert tier.poll("r", K[:4]) is None  # sent, unanswered: ask again
    assert tier.poll("r", K[:4]) is None and len(store.calls) == 1  # not sent twice
    store.release()
    assert tier.poll("r", K[:4]) == 2
    assert tier.holds_hint(K[0]) and tier.holds_hint(K[3]) and not tier.holds_hint(K[2])
    assert tier.poll("r", []) == 0


def test_a_tier_known_down_answers_zero_without_calling_the_store():
    store = Store()
    store.put(K[0])
    tier = remote_tier(store, up=False)
    assert tier.poll("r", K[:1]) == 0 and store.calls == []
    counters = Counts()
    tier.take_stats(counters)
    assert counters[Count.REMOTE_PROBE_FAILED, FailureCause.UNAVAILABLE] == 1
    assert not tier.up


def test_a_chunk_is_written_once_admitted_unless_it_is_known_there():
    store = Store()
    tier = remote_tier(store, admission=2)
    assert not tier.note_seen(K[0]) and not tier.admits(K[0])
    assert tier.note_seen(K[0]) and tier.admits(K[0])
    tier.remember(K[0])  # written by this engine
    assert not tier.note_seen(K[0])  # there already: no second write
    store.put(K[1])
    assert answer(tier, "r", K[1:2]) == 1  # a probe saw it there
    tier.note_seen(K[1])
    assert not tier.note_seen(K[1])
    read_only = remote_tier(Store(), writes=False)
    assert not any(read_only.note_seen(K[2]) for _ in range(3)) and not read_only.admits(K[2])


def test_a_fill_is_a_remote_read_and_its_outcome_keeps_or_forgets_the_hint():
    store = Store()
    store.put(K[0])
    store.put(K[1])
    tier = remote_tier(store)
    assert answer(tier, "r", K[:2]) == 2
    plan = StepPlan()
    tier.plan_fill(plan, 9, K[0], 4, "r")
    assert plan.of(Move.REMOTE_READ) == [Job.remote_read(9, K[0], 4, req_id="r")]
    assert tier.fill_aliases(K[0]) is None  # the host entry takes the request's block keys
    tier.fill_done(K[0], ok=True)
    tier.fill_done(K[1], ok=False)  # gone or bad after all: not there, may be written again
    assert tier.holds_hint(K[0]) and not tier.holds_hint(K[1])


def test_only_the_most_recent_writes_are_remembered():
    tier = remote_tier(Store(), written_capacity=2)
    for key in K[:3]:
        tier.remember(key)
    assert [tier.holds_hint(key) for key in K[:3]] == [False, True, True]
    tier.forget_key(K[2])
    assert not tier.holds_hint(K[2])


def test_a_reset_forgets_every_hint_not_the_shared_data():
    store = Store()
    store.put(K[0])
    tier = remote_tier(store, admission=1)
    assert answer(tier, "r", K[:1]) == 1
    tier.remember(K[1])
    tier.note_seen(K[2])
    tier.reset()
    assert not tier.holds_hint(K[0]) and not tier.holds_hint(K[1]) and not tier.admits(K[2])
    assert answer(tier, "s", K[:1]) == 1  # still there for any replica to read


def test_probe_counters_and_latencies_are_taken_once():
    store = Store()
    store.put(K[0])
    store.put(K[1])
    tier = remote_tier(store)
    counters = Counts()
    assert answer(tier, "r", K[:2]) == 2
    assert answer(tier, "s", K[:3]) == 2  # two known from the last probe, one asked
    assert tier.take_stats(counters) == [0.002, 0.002]
    assert counters[Count.REMOTE_PROBES] == 2
    assert counters[Count.REMOTE_PROBE_KEYS] == 3
    assert counters[Count.REMOTE_PROBE_KNOWN_HITS] == 2
    assert tier.take_stats(counters) == [] and counters[Count.REMOTE_PROBES] == 2


def test_server_gauges_never_wait_and_count_the_servers_evictions_since_the_last_reading():
    asked: list[Future[dict[str, int] | None]] = []

    def server_info() -> Future[dict[str, int] | None]:
        asked.append(Future())
        return asked[-1]

    clock = Clock()
    tier = remote_tier(Store(), server_info=server_info, clock=clock)
    counters = Counts()
    assert tier.server_gauges(counters) == {} and len(asked) == 1  # asked, not awaited
    asked[0].set_result({"used_memory": 100, "maxmemory": 1000, "evicted_keys": 5})
    assert tier.server_gauges(counters) == {"remote_used_bytes": 100, "remote_capacity_bytes": 1000}
    assert counters[Count.EVICTIONS, Tier.REMOTE] == 0  # the first reading is the baseline
    clock.now += INFO_INTERVAL_S / 2
    tier.server_gauges(counters)
    assert len(asked) == 1  # not due yet
    clock.now += INFO_INTERVAL_S
    tier.server_gauges(counters)
    asked[1].set_result({"used_memory": 300, "maxmemory": 1000, "evicted_keys": 8})
    assert tier.server_gauges(counters)["remote_used_bytes"] == 300
    assert counters[Count.EVICTIONS, Tier.REMOTE] == 3
    clock.now += INFO_INTERVAL_S
    tier.server_gauges(counters)
    asked[2].set_result(None)  # down or failed: the last reading stays
    assert tier.server_gauges(counters)["remote_used_bytes"] == 300
