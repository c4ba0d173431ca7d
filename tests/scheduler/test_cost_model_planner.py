"""The cost model inside the planner: a disk that reads slower than the engine recomputes has
its hits declined (the lookup answers without them) and counted; once it reads fast again,
its hits return. A fake clock drives the model: nothing here times anything."""

from __future__ import annotations

from test_planner import BLOCK, CHUNK_BLOCKS, CHUNK_TOKENS, FP, keys_for, ok_all, store_prompt
from test_remote_tier import Store

from tieredkv.config import TieredKVConfig
from tieredkv.metrics.specs import Count
from tieredkv.protocol import JobResult, Move, Tier
from tieredkv.scheduler.planner import Planner
from tieredkv.scheduler.policies import EXPLORE_INTERVAL_S, MIN_SAMPLES
from tieredkv.scheduler.remote_tier import RemoteProbe, RemoteTier

DECLINED_DISK = (Count.HITS_DECLINED_SLOWER, Tier.DISK)


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def make(clock: Clock, remote: RemoteTier | None = None, host_slots: int = 2, **extra) -> Planner:
    cfg = TieredKVConfig.from_dict({"chunk_blocks": CHUNK_BLOCKS, **extra})
    return Planner(cfg, block_size=BLOCK, num_host_slots=host_slots, num_disk_slots=64,
                   clock=clock, remote=remote)


def prompt(n: int) -> list[int]:
    """Two whole chunks and one token: a hit of two chunks."""
    return [t + 100_000 * n for t in range(2 * CHUNK_TOKENS + 1)]


def on_disk_only(planner: Planner, n: int) -> list[int]:
    """Prompt ``n`` spilled to disk, then pushed out of the two host slots."""
    tokens = prompt(n)
    store_prompt(planner, f"w{n}", tokens)
    ok_all(planner, planner.take_plan())  # its spills
    store_prompt(planner, f"f{n}", prompt(1000 + n))  # a filler takes the host slots
    ok_all(planner, planner.take_plan())
    assert not any(planner.host.is_ready(k) for k in keys_for(tokens))
    assert planner.disk is not None and all(planner.disk.is_ready(k) for k in keys_for(tokens))
    return tokens


def fast_engine(planner: Planner, clock: Clock) -> None:
    """Prefill steps at 64,000 tokens/s: a chunk recomputes in 1 ms."""
    for _ in range(MIN_SAMPLES):
        planner.step_scheduled(10 * CHUNK_TOKENS)
        clock.now += 10 * CHUNK_TOKENS / 64_000
        planner.step_done()


def hit_after_fills(planner: Planner, clock: Clock, req: str, tokens: list[int],
                    read_s: float) -> tuple[int, int, int]:
    """Look ``tokens`` up; fills take ``read_s``. Returns (promotions the request waited
    for, promotions read in the background after it got its answer, the hit)."""
    keys = keys_for(tokens)
    answer = planner.lookup(req, keys, 0, len(tokens))
    promotions = 0
    while answer is None:
        plan = planner.take_plan()
        promotions += len(plan.of(Move.PROMOTE))
        clock.now += read_s
        ok_all(planner, plan)
        answer = planner.lookup(req, keys, 0, len(tokens))
    planner.finished(req)
    plan = planner.take_plan()  # an exploration: read while the request computes
    background = len(plan.of(Move.PROMOTE))
    if background:
        clock.now += read_s
        ok_all(planner, plan)
    return promotions, background, answer


def test_a_slow_disk_hit_is_declined_and_counted_and_returns_once_the_disk_is_fast():
    clock = Clock()
    planner = make(clock)
    fast_engine(planner, clock)
    full = 2 * CHUNK_TOKENS
    # Learning: no estimate yet, every disk hit is taken (each read takes 1 s).
    for n in range(MIN_SAMPLES):
        assert hit_after_fills(planner, clock, f"learn{n}", on_disk_only(planner, n), 1.0) == (
            2, 0, full)
    assert planner.counters[DECLINED_DISK] == 0
    # The disk reads 2 chunks in 1 s, the engine recomputes them in 2 ms: declined. The first
    # decline explores one chunk in the background (the request never waits for it: it
    # computes its prompt); the next request gets no disk chunk and explores nothing.
    assert hit_after_fills(planner, clock, "explore", on_disk_only(planner, 10), 1.0) == (0, 1, 0)
    assert hit_after_fills(planner, clock, "declined", on_disk_only(planner, 11), 1.0) == (0, 0, 0)
    assert planner.counters[DECLINED_DISK] == 2
    deltas = planner.take_counter_deltas()
    assert deltas["hits_declined_slower_than_recompute"] == {"disk": 2}
    # The disk recovers: the next exploration reads fast, and hits return in full.
    clock.now += EXPLORE_INTERVAL_S
    assert hit_after_fills(planner, clock, "recovering", on_disk_only(planner, 12), 0.0001) == (
        0, 1, 0)
    assert hit_after_fills(planner, clock, "back", on_disk_only(planner, 13), 0.0001) == (2, 0, full)
    assert planner.counters[DECLINED_DISK] == 3


def test_with_the_cost_model_off_a_slow_disk_is_still_used():
    clock = Clock()
    planner = make(clock, cost_model=False)
    fast_engine(planner, clock)
    for n in range(MIN_SAMPLES + 2):
        assert hit_after_fills(planner, clock, f"r{n}", on_disk_only(planner, n), 1.0) == (
            2, 0, 2 * CHUNK_TOKENS)
    assert planner.counters[DECLINED_DISK] == 0


def slow_probe_planner(clock: Clock, **extra) -> tuple[Planner, Store, list[int]]:
    """A planner whose remote tier holds a ten-chunk prompt and answers probes only when the
    test releases them (the probe's own deadline: 10 s)."""
    store = Store()
    store.hold = True
    probe = RemoteProbe(store, FP, 1, deadline_s=10.0, clock=clock)
    remote = RemoteTier(probe, is_up=lambda: True, writes=False, admission=1, seen_limit=64,
                        clock=clock)
    planner = make(clock, remote=remote, host_slots=16, **extra)
    tokens = [t + 7 for t in range(10 * CHUNK_TOKENS + 1)]
    for key in keys_for(tokens).materialize(10):
        store.put(key)
    fast_engine(planner, clock)
    return planner, store, tokens


def test_a_request_waits_for_the_remote_probe_no_longer_than_the_hit_could_save():
    clock = Clock()
    planner, store, tokens = slow_probe_planner(clock)
    keys = keys_for(tokens)
    # Ten chunks recompute in 10 ms: the request waits for the probe that long, then computes.
    assert planner.lookup("a", keys, 0, len(tokens)) is None
    clock.now += 0.009
    assert planner.lookup("a", keys, 0, len(tokens)) is None
    clock.now += 0.002
    assert planner.lookup("a", keys, 0, len(tokens)) == 0
    assert not planner.take_plan().of(Move.REMOTE_READ)
    # The decline is counted once the answer shows Redis held the prompt (it did).
    store.release()
    planner.finished("a")
    assert planner.counters[Count.HITS_DECLINED_PROBE_WAIT, Tier.REMOTE] == 1
    # A prompt host already covers is never made to wait for the probe: no probe is sent.
    store_prompt(planner, "w", tokens)
    sent = len(store.calls)
    assert planner.lookup("b", keys, 0, len(tokens)) == 10 * CHUNK_TOKENS
    assert len(store.calls) == sent


def test_a_request_redis_has_nothing_for_is_no_declined_hit_when_its_probe_is_not_waited_for():
    # A cold prompt, asked while its probe is out: the wait is cut short as for a hit, but the
    # answer says Redis held nothing, so no hit was declined (unanswered: not counted either).
    clock = Clock()
    planner, store, _ = slow_probe_planner(clock)
    for req, n in (("cold", 1), ("never-answered", 2)):
        cold = [t + 500_000 * n for t in range(10 * CHUNK_TOKENS + 1)]
        keys = keys_for(cold)
        assert planner.lookup(req, keys, 0, len(cold)) is None
        clock.now += 0.011
        assert planner.lookup(req, keys, 0, len(cold)) == 0
        if req == "cold":
            store.release()
        planner.finished(req)
    assert planner.counters[Count.HITS_DECLINED_PROBE_WAIT, Tier.REMOTE] == 0


def test_with_the_cost_model_off_the_probe_deadline_alone_bounds_the_wait():
    clock = Clock()
    planner, _store, tokens = slow_probe_planner(clock, cost_model=False)
    keys = keys_for(tokens)
    assert planner.lookup("a", keys, 0, len(tokens)) is None
    clock.now += 1.0
    assert planner.lookup("a", keys, 0, len(tokens)) is None
    assert planner.counters[Count.HITS_DECLINED_PROBE_WAIT, Tier.REMOTE] == 0


def test_a_slow_remote_tier_hit_is_declined_and_counted():
    clock = Clock()
    planner, store, _ = slow_probe_planner(clock)
    store.hold = False  # probes answer at once; the remote reads are what is slow

    def remote_hit(req: str, n: int) -> tuple[int, int]:
        tokens = [t + 7 + 100_000 * n for t in range(4 * CHUNK_TOKENS + 1)]
        keys = keys_for(tokens)
        for key in keys.materialize(4):
            store.put(key)
        reads, answer = 0, planner.lookup(req, keys, 0, len(tokens))
        while answer is None:
            plan = planner.take_plan()
            jobs = plan.of(Move.REMOTE_READ)
            reads += len(jobs)
            clock.now += 1.0  # four chunks take a second; they recompute in 4 ms
            planner.apply([JobResult(job.job_id, ok=1) for job in jobs])
            answer = planner.lookup(req, keys, 0, len(tokens))
        planner.finished(req)
        aside = planner.take_plan().of(Move.REMOTE_READ)  # an exploration, not waited for
        if aside:
            clock.now += 1.0
            planner.apply([JobResult(job.job_id, ok=1) for job in aside])
        return reads + 100 * len(aside), answer

    for n in range(MIN_SAMPLES):
        assert remote_hit(f"learn{n}", n) == (4, 4 * CHUNK_TOKENS)
    # Known slow, due to be explored: the probe is waited for, one chunk is read in the
    # background (100 x reads aside), the request computes its prompt.
    assert remote_hit("explore", 10) == (100, 0)
    assert planner.counters[Count.HITS_DECLINED_SLOWER, Tier.REMOTE] == 1
    # Known slow, explored a moment ago: the hit could save nothing, so its probe is not even
    # waited for; the request computes its prompt.
    assert remote_hit("declined", 11) == (0, 0)
    assert planner.counters[Count.HITS_DECLINED_PROBE_WAIT, Tier.REMOTE] == 1
    assert planner.counters[Count.HITS_DECLINED_SLOWER, Tier.REMOTE] == 1
    assert planner.counters[DECLINED_DISK] == 0


def test_a_preempted_request_waits_for_its_new_probe_as_long_as_a_new_request_would():
    # Its first probe wait started long ago: resumed, the request's new probe is given the
    # time its hit could save from now, and a decline on resume is not counted twice.
    clock = Clock()
    store = Store()
    store.hold = True
    probe = RemoteProbe(store, FP, 1, deadline_s=10.0, clock=clock)
    remote = RemoteTier(probe, is_up=lambda: True, writes=False, admission=1, seen_limit=64,
                        clock=clock)
    planner = Planner(TieredKVConfig.from_dict({"chunk_blocks": CHUNK_BLOCKS}), block_size=BLOCK,
                      num_host_slots=16, clock=clock, remote=remote)  # no disk tier
    tokens = [t + 7 for t in range(10 * CHUNK_TOKENS + 1)]
    keys = keys_for(tokens)
    for key in keys.materialize(10):
        store.put(key)
    fast_engine(planner, clock)
    assert planner.lookup("a", keys, 0, len(tokens)) is None
    store.release()
    store.hold = False
    assert planner.lookup("a", keys, 0, len(tokens)) is None  # answered: ten reads planned
    reads = planner.take_plan().of(Move.REMOTE_READ)
    assert len(reads) == 10
    planner.apply([JobResult(job.job_id, ok=1) for job in reads])
    hit = planner.lookup("a", keys, 0, len(tokens))
    assert hit == 10 * CHUNK_TOKENS
    planner.on_alloc("a", list(range(len(tokens) // BLOCK + 1)), hit)
    ok_all(planner, planner.take_plan())
    for n in range(2):  # other prompts take the sixteen host slots
        store_prompt(planner, f"o{n}", [t + 900_000 * (n + 1) for t in range(8 * CHUNK_TOKENS + 1)])
        ok_all(planner, planner.take_plan())
    assert not any(planner.host.is_ready(k) for k in keys.materialize(10))
    planner.preempted("a")
    planner.take_plan()
    planner.remote.reset()  # its hints dropped (as a cache reset does): the chunks are probed
    clock.now += 1.0
    store.hold = True
    assert planner.lookup("a", keys, 0, len(tokens)) is None  # waits for its new probe
    clock.now += 0.011  # past what ten chunks could save: computes them
    assert planner.lookup("a", keys, 0, len(tokens)) == 0
    store.release()
    planner.finished("a")
    assert planner.counters[Count.HITS_DECLINED_PROBE_WAIT, Tier.REMOTE] == 1


def test_a_hit_declined_before_and_after_a_preemption_is_counted_once():
    clock = Clock()
    planner, store, tokens = slow_probe_planner(clock)
    keys = keys_for(tokens)
    for _ in range(2):  # the first lookup, then the resumed one: each stops waiting
        assert planner.lookup("a", keys, 0, len(tokens)) is None
        clock.now += 0.011
        assert planner.lookup("a", keys, 0, len(tokens)) == 0
        planner.preempted("a")
        planner.take_plan()
    store.release()
    planner.finished("a")
    assert planner.counters[Count.HITS_DECLINED_PROBE_WAIT, Tier.REMOTE] == 1


def test_a_declined_tail_probe_is_counted_at_the_end_and_no_probe_is_sent_then():
    # Redis holds chunks 0-1 and a 2-block tail of chunk 2 (a previous, shorter turn): the
    # probe of that tail is not waited for; its answer counts, and the end sends nothing.
    clock = Clock()
    planner, store, _ = slow_probe_planner(clock)
    store.hold = False
    tokens = [t + 900_000 for t in range(10 * CHUNK_TOKENS + 1)]
    keys = keys_for(tokens)
    for key in keys.materialize(2):
        store.put(key)
    store.put(keys.block_key(2 * CHUNK_BLOCKS + 1))
    assert planner.lookup("r", keys, 0, len(tokens)) is None  # the tail's probe is out
    store.hold = True
    assert planner.lookup("r", keys, 0, len(tokens)) is None
    clock.now += 1.0  # far past what the tail could save
    assert planner.lookup("r", keys, 0, len(tokens)) is None  # reads of chunks 0-1 go out
    store.release()
    before = len(store.calls)
    planner.finished("r")
    assert len(store.calls) == before
    assert planner.counters[Count.HITS_DECLINED_PROBE_WAIT, Tier.REMOTE] == 1


def test_a_declined_hit_is_counted_even_if_redis_is_down_when_the_request_ends():
    clock = Clock()
    planner, store, tokens = slow_probe_planner(clock)
    up = [True]
    planner.remote._is_up = lambda: up[0]
    keys = keys_for(tokens)
    assert planner.lookup("a", keys, 0, len(tokens)) is None
    clock.now += 0.011
    assert planner.lookup("a", keys, 0, len(tokens)) == 0
    store.release()
    up[0] = False
    planner.finished("a")
    deltas = planner.take_counter_deltas()
    assert not deltas.get("remote_probe_failed")
    assert planner.counters[Count.HITS_DECLINED_PROBE_WAIT, Tier.REMOTE] == 1


def test_a_slower_than_recompute_decline_is_counted_once_across_a_preemption():
    clock = Clock()
    planner = make(clock)
    fast_engine(planner, clock)
    for n in range(MIN_SAMPLES):
        hit_after_fills(planner, clock, f"learn{n}", on_disk_only(planner, n), 1.0)
    hit_after_fills(planner, clock, "explore", on_disk_only(planner, 10), 1.0)
    before = planner.counters[DECLINED_DISK]
    tokens = on_disk_only(planner, 11)
    keys = keys_for(tokens)
    assert planner.lookup("d", keys, 0, len(tokens)) == 0
    assert planner.counters[DECLINED_DISK] == before + 1
    planner.preempted("d")
    planner.take_plan()
    assert planner.lookup("d", keys, 0, len(tokens)) == 0  # resumed: still declined, once
    assert planner.counters[DECLINED_DISK] == before + 1
