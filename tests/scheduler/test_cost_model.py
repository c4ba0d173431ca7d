"""The cost model (issue 25 point 2): a lower tier's hit is taken only when reading it is
predicted faster than recomputing its tokens. A fake clock drives every estimate: nothing here
times anything."""

from __future__ import annotations

import pytest

from tieredkv.metrics.specs import Count, Counts
from tieredkv.protocol import Tier
from tieredkv.scheduler.policies import (
    EXPLORE_INTERVAL_S,
    MIN_SAMPLES,
    CostModel,
    ReadEstimate,
)

CHUNK_TOKENS = 64
DISK, REMOTE = Tier.DISK.value, Tier.REMOTE.value
SLOWER = Count.HITS_DECLINED_SLOWER


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def model(clock: Clock, counters: Counts | None = None, **kw) -> CostModel:
    return CostModel(counters if counters is not None else Counts(), chunk_tokens=CHUNK_TOKENS,
                     chunk_bytes=1 << 20, clock=clock, **kw)


def learn_rate(cost: CostModel, clock: Clock, tokens_per_s: float) -> None:
    """Prefill steps of ten chunks at ``tokens_per_s``."""
    for _ in range(MIN_SAMPLES):
        cost.step_scheduled(10 * CHUNK_TOKENS)
        clock.now += 10 * CHUNK_TOKENS / tokens_per_s
        cost.step_done()


_job_ids = iter(range(1, 1 << 30))


def learn_reads(cost: CostModel, clock: Clock, tier: str, seconds: float, chunks: int = 2,
                rounds: int = MIN_SAMPLES) -> None:
    """``rounds`` fill rounds of ``chunks`` chunks of ``tier``, each taking ``seconds``."""
    for _ in range(rounds):
        ids = [next(_job_ids) for _ in range(chunks)]
        cost.fills_started(tier, ids)
        clock.now += seconds
        for job_id in ids:
            cost.fill_done(job_id)


RUN = [b"h0", b"d1", b"d2", b"r3", b"r4"]  # host, disk, disk, remote, remote (chunks 0..4)
TIERS = ((REMOTE, {b"r3", b"r4"}), (DISK, {b"d1", b"d2"}))


def keep(cost: CostModel, req: str = "r", run=RUN, tiers=TIERS, limit=5 * CHUNK_TOKENS) -> int:
    return cost.affordable(req, run, tiers, 0, 0, limit)


def test_the_read_estimate_fits_latency_and_bandwidth_and_ignores_an_outlier():
    reads = ReadEstimate()
    for chunks, seconds in ((1, 0.11), (2, 0.12), (4, 0.14), (8, 0.18), (4, 9.0), (2, 0.12)):
        reads.add(chunks, seconds)
    latency, per_chunk = reads.fit()
    assert latency == pytest.approx(0.10, abs=1e-6)
    assert per_chunk == pytest.approx(0.01, abs=1e-6)
    assert reads.predict(10) == pytest.approx(0.20, abs=1e-6)


def test_rounds_of_one_size_give_a_per_chunk_time():
    reads = ReadEstimate()
    for seconds in (0.4, 0.5, 0.6):
        reads.add(4, seconds)
    assert reads.fit() == (0.0, pytest.approx(0.125))


def test_bandwidth_is_bytes_per_second_from_the_chunk_size():
    clock = Clock()
    cost = model(clock)
    assert cost.bandwidth(DISK) is None
    learn_reads(cost, clock, DISK, 0.5, chunks=2)
    assert cost.bandwidth(DISK) == pytest.approx((1 << 20) / 0.25)


def test_without_samples_every_hit_is_taken():
    clock = Clock()
    counters = Counts()
    cost = model(clock, counters)
    assert keep(cost) == len(RUN)  # nothing known
    learn_reads(cost, clock, DISK, 100.0)
    assert keep(cost) == len(RUN)  # a slow disk, but no prefill rate yet
    cost2 = model(clock, counters)
    learn_rate(cost2, clock, 1e6)
    learn_reads(cost2, clock, DISK, 100.0, rounds=MIN_SAMPLES - 1)
    assert keep(cost2) == len(RUN)  # too few rounds
    assert not counters


def test_the_prefill_rate_counts_only_prefill_sized_steps():
    clock = Clock()
    cost = model(clock)
    for _ in range(10):  # decode steps: a few tokens over a long step
        cost.step_scheduled(4)
        clock.now += 1.0
        cost.step_done()
    assert cost.prefill_tokens_per_s is None
    learn_rate(cost, clock, 10_000)
    cost.step_scheduled(10 * CHUNK_TOKENS)  # a step whose output never came back: no sample
    cost.step_scheduled(10 * CHUNK_TOKENS)
    clock.now += 10 * CHUNK_TOKENS / 10_000
    cost.step_done()
    cost.step_done()
    assert cost.prefill_tokens_per_s == pytest.approx(10_000)
    assert cost.recompute_seconds(1000) == pytest.approx(0.1)


def test_the_rate_pairs_each_output_with_its_own_step_under_async_scheduling():
    """vLLM's async scheduling schedules step k+1 before step k's output comes back: each
    output belongs to the oldest step still out, not to the latest one scheduled."""
    clock = Clock()
    cost = model(clock)
    for _ in range(MIN_SAMPLES):
        cost.step_scheduled(2 * CHUNK_TOKENS)  # step k: a prefill
        clock.now += 0.001
        cost.step_scheduled(1)  # step k+1, a decode, scheduled before k's output
        clock.now += 0.2
        cost.step_done()  # k's output: two chunks' tokens over 0.201 s
        clock.now += 0.01
        cost.step_done()  # k+1's output: a decode, no sample
    assert cost.prefill_tokens_per_s == pytest.approx(2 * CHUNK_TOKENS / 0.201)


def test_an_output_is_paired_with_the_step_whose_number_it_echoes():
    """A step that ran no forward has no output when nothing is reported, so pairing by age
    would time a later prefill from an older, idle step: its rate would be several steps'
    time too low. The workers echo each step's number: every prefill is timed alone."""
    clock = Clock()
    cost = model(clock)
    for _ in range(MIN_SAMPLES):
        idle = cost.step_scheduled(0)  # requests wait for their loads: no forward
        clock.now += 0.5
        prefill = cost.step_scheduled(2 * CHUNK_TOKENS)
        assert prefill == idle + 1
        clock.now += 0.2
        cost.step_done(prefill)  # the idle step's output never came
    assert cost.prefill_tokens_per_s == pytest.approx(2 * CHUNK_TOKENS / 0.2)
    cost.step_done(prefill)  # reported twice, or a step already dropped: no sample
    cost.step_done(idle)
    assert cost.prefill_tokens_per_s == pytest.approx(2 * CHUNK_TOKENS / 0.2)


@pytest.mark.parametrize("in_flight", [1, 2, 5, 9])
def test_the_rate_is_learnt_with_many_steps_in_flight(in_flight: int) -> None:
    """Pipeline parallelism keeps up to pp + 1 steps in flight (vLLM's batch queue): the
    output of the oldest comes back only then, ``in_flight`` steps of 0.1 s after it was
    scheduled. Each is still paired with its own step."""
    clock = Clock()
    cost = model(clock)
    pending: list[int] = []
    for _ in range(in_flight + 40):  # the window's median then holds steady-state steps only
        pending.append(cost.step_scheduled(10 * CHUNK_TOKENS))
        if len(pending) == in_flight:
            clock.now += 0.1
            cost.step_done(pending.pop(0))
    assert cost.prefill_tokens_per_s == pytest.approx(10 * CHUNK_TOKENS / (0.1 * in_flight))


def test_a_slow_tier_is_declined_once_per_request_and_explored_in_the_background():
    clock = Clock()
    counters = Counts()
    cost = model(clock, counters)
    learn_rate(cost, clock, 64_000)  # a chunk recomputes in 1 ms
    learn_reads(cost, clock, DISK, 1.0)  # two chunks read in 1 s
    # First decline: the run stops before the disk's chunks, and the disk is due to be
    # measured again: the lookup reads one of its chunks in the background.
    assert keep(cost, "a") == 1
    assert cost.take_explorations() == {DISK} and cost.take_explorations() == set()
    assert counters[SLOWER, DISK] == 1
    # Asked again, the same request gets the same answer, counted once.
    assert keep(cost, "a") == 1 and keep(cost, "a") == 1
    assert counters[SLOWER, DISK] == 1
    # Another request within the exploration interval: declined, nothing explored.
    assert keep(cost, "b") == 1 and cost.take_explorations() == set()
    assert counters[SLOWER, DISK] == 2
    # After the interval, the disk is explored again (still never on a request's path).
    clock.now += EXPLORE_INTERVAL_S
    assert keep(cost, "c") == 1 and cost.take_explorations() == {DISK}
    assert counters == Counts({(SLOWER, DISK): 3})


def test_a_fast_tier_is_taken_and_the_margin_decides_a_close_call():
    clock = Clock()
    counters = Counts()
    cost = model(clock, counters, margin=0.2)
    learn_rate(cost, clock, 1000)  # 4 chunks (256 tokens) recompute in 0.256 s
    learn_reads(cost, clock, DISK, 0.001)
    assert keep(cost, "fast", RUN[:3], TIERS[1:], 3 * CHUNK_TOKENS) == 3
    close = model(clock, counters, margin=0.2)
    learn_rate(close, clock, 1000)
    learn_reads(close, clock, DISK, 0.06)  # 2 chunks: 0.06 s against 0.128 s x 0.5
    assert keep(close, "x", RUN[:3], TIERS[1:], 3 * CHUNK_TOKENS) == 3
    learn_reads(close, clock, DISK, 0.12, rounds=2 * MIN_SAMPLES)  # 0.12 x 1.2 > 0.128
    assert keep(close, "y", RUN[:3], TIERS[1:], 3 * CHUNK_TOKENS) < 3
    no_margin = model(clock, Counts(), margin=0.0)
    learn_rate(no_margin, clock, 1000)
    learn_reads(no_margin, clock, DISK, 0.12)
    assert keep(no_margin, "z", RUN[:3], TIERS[1:], 3 * CHUNK_TOKENS) == 3


def test_a_slow_remote_tier_is_cut_before_a_fast_disk_one():
    clock = Clock()
    counters = Counts()
    cost = model(clock, counters)
    learn_rate(cost, clock, 64_000)
    learn_reads(cost, clock, DISK, 0.0001)
    learn_reads(cost, clock, REMOTE, 2.0)
    assert keep(cost, "a") == 3  # disk kept, remote declined (and due to be explored)
    assert cost.take_explorations() == {REMOTE}
    assert keep(cost, "b") == 3  # disk kept, remote declined
    assert counters == Counts({(SLOWER, REMOTE): 2})


def test_an_exploration_is_timed_by_the_workers_not_by_the_steps_beside_it():
    """A background read runs while the request that declined it computes: the steps' time
    is the compute's, not the read's. Timed by the workers, a disk that recovered is seen to
    have recovered; a read a request waited for is still timed as the request waited."""
    clock = Clock()
    cost = model(clock)
    learn_rate(cost, clock, 64_000)
    learn_reads(cost, clock, DISK, 1.0, chunks=1)  # slow: a chunk in 1 s
    assert keep(cost, "a") == 1 and cost.take_explorations() == {DISK}
    job = next(_job_ids)
    cost.fills_started(DISK, [job], background=True)
    clock.now += 2.0  # the compute step the read ran beside
    cost.fill_done(job, worker_s=0.001)  # the read itself: 1 ms
    assert keep(cost, "b") == len(RUN)  # recovered: the whole hit again
    waited = model(clock)
    for _ in range(MIN_SAMPLES):  # reads requests waited for: timed as they waited
        job = next(_job_ids)
        waited.fills_started(DISK, [job])
        clock.now += 0.5
        waited.fill_done(job, worker_s=0.001)
    assert waited.read_seconds(DISK, 1) == pytest.approx(0.5)


def test_the_model_turned_off_takes_every_hit():
    clock = Clock()
    counters = Counts()
    cost = model(clock, counters, enabled=False)
    learn_rate(cost, clock, 64_000)
    learn_reads(cost, clock, DISK, 10.0)
    assert keep(cost) == len(RUN)
    assert cost.may_wait_for_probe("a", REMOTE, 64, 1)
    clock.now += 100
    assert cost.may_wait_for_probe("a", REMOTE, 64, 1)
    assert not counters


def test_a_recovered_tier_is_used_again_after_one_fast_exploration():
    clock = Clock()
    counters = Counts()
    cost = model(clock, counters)
    learn_rate(cost, clock, 64_000)
    learn_reads(cost, clock, DISK, 1.0)
    assert keep(cost, "a") == 1 and cost.take_explorations() == {DISK}  # d1 read aside
    learn_reads(cost, clock, DISK, 0.0001, chunks=1, rounds=1)  # the exploration was fast
    assert keep(cost, "a") == 1  # "a" keeps its answer
    assert keep(cost, "b") == len(RUN)  # a new request takes the whole hit again
    cost.forget("a")
    assert keep(cost, "a") == len(RUN)


def test_a_tier_turning_slow_and_fast_again_is_logged_once_each_way(caplog):
    """An operator sees why hits stopped, and that they came back: one warning each way, not
    one per declined request or per exploration that found the tier still slow."""
    clock = Clock()
    cost = model(clock)
    learn_rate(cost, clock, 64_000)
    learn_reads(cost, clock, DISK, 1.0)
    with caplog.at_level("WARNING", logger="tieredkv.scheduler.policies"):
        assert keep(cost, "a") == 1 and keep(cost, "b") == 1
        learn_reads(cost, clock, DISK, 0.9, chunks=2, rounds=1)  # explored: still slow
        clock.now += EXPLORE_INTERVAL_S
        assert keep(cost, "c") == 1
        assert [r.getMessage() for r in caplog.records] == [
            "tieredkv: disk hits predicted slower than recomputing them are declined; one chunk "
            "is read every 5 s to measure the tier again (a 2-chunk read predicted 1.000 s, "
            "recomputing 0.004 s)"]
        learn_reads(cost, clock, DISK, 0.001, chunks=1, rounds=1)  # explored: fast
        learn_reads(cost, clock, DISK, 0.001, chunks=1, rounds=1)
        assert keep(cost, "d") == len(RUN) and keep(cost, "e") == len(RUN)
        assert [r.getMessage() for r in caplog.records][1:] == [
            "tieredkv: disk hits are taken again (a 2-chunk read predicted n/a, recomputing "
            "0.004 s)"]


def test_a_tier_taken_again_without_an_exploration_is_logged_too(caplog):
    """The prefill rate fell (a bigger model, a busier engine): the same reads are now worth
    it, with no exploration round to say so; the turn is still logged, and the next turn to
    slow again is logged as well."""
    clock = Clock()
    cost = model(clock)
    learn_rate(cost, clock, 64_000)
    learn_reads(cost, clock, DISK, 1.0)
    with caplog.at_level("WARNING", logger="tieredkv.scheduler.policies"):
        assert keep(cost, "a") == 1
        for _ in range(5):  # the rate's median moves: recomputing 256 tokens takes 2.56 s
            learn_rate(cost, clock, 100)
        assert keep(cost, "b") == len(RUN)
        for _ in range(6):
            learn_rate(cost, clock, 64_000)
        assert keep(cost, "c") == 1
    turns = [r.getMessage().split(" (")[0] for r in caplog.records]
    assert turns == ["tieredkv: disk hits predicted slower than recomputing them are declined; "
                     "one chunk is read every 5 s to measure the tier again",
                     "tieredkv: disk hits are taken again",
                     "tieredkv: disk hits predicted slower than recomputing them are declined; "
                     "one chunk is read every 5 s to measure the tier again"]


def test_the_probe_wait_is_bounded_by_what_the_remote_hit_could_save():
    clock = Clock()
    counters = Counts()
    cost = model(clock, counters, probe_timeout_s=0.5)
    # No prefill rate: the probe's own deadline applies.
    assert cost.may_wait_for_probe("a", REMOTE, 640, 10)
    clock.now += 10.0
    assert cost.may_wait_for_probe("a", REMOTE, 640, 10)
    learn_rate(cost, clock, 6400)  # 640 tokens recompute in 0.1 s
    start = clock.now
    assert cost.may_wait_for_probe("b", REMOTE, 640, 10)
    clock.now = start + 0.1
    assert cost.may_wait_for_probe("b", REMOTE, 640, 10)
    clock.now = start + 0.11
    assert not cost.may_wait_for_probe("b", REMOTE, 640, 10)
    # Not counted here: whether a hit was declined is known once the probe answers (planner).
    assert counters[Count.HITS_DECLINED_PROBE_WAIT, REMOTE] == 0
    # The known read time comes off the saving.
    learn_reads(cost, clock, REMOTE, 0.05, chunks=10)
    start = clock.now
    assert cost.may_wait_for_probe("c", REMOTE, 640, 10)
    clock.now = start + 0.06
    assert not cost.may_wait_for_probe("c", REMOTE, 640, 10)
    # Never longer than remote_timeout_s, however much the hit could save.
    start = clock.now
    assert cost.may_wait_for_probe("d", REMOTE, 640_000, 10)
    clock.now = start + 0.5
    assert cost.may_wait_for_probe("d", REMOTE, 640_000, 10)
    clock.now = start + 0.51
    assert not cost.may_wait_for_probe("d", REMOTE, 640_000, 10)


def test_a_tier_flapping_near_break_even_is_not_a_log_flood(caplog):
    """Reads with a fixed latency: one-chunk hits lose to recomputing, twenty-chunk hits win,
    so the tier turns with every request's size. Three warnings a minute at most; the next
    one, once the minute has passed, says how many turns went unlogged and where it stands."""
    clock = Clock()
    cost = model(clock)
    learn_rate(cost, clock, 64_000)  # a chunk recomputes in 1 ms
    for chunks in (1, 4, 8):  # 5 ms latency + 0.1 ms per chunk
        learn_reads(cost, clock, DISK, 0.005 + 0.0001 * chunks, chunks=chunks, rounds=1)

    def ask(req: str, chunks: int) -> int:
        run = [b"h0", *(b"d%d" % j for j in range(1, chunks + 1))]
        return keep(cost, req, run, ((DISK, set(run[1:])),), (chunks + 1) * CHUNK_TOKENS)

    with caplog.at_level("WARNING", logger="tieredkv.scheduler.policies"):
        for n in range(10):
            assert ask(f"small{n}", 1) == 1  # declined
            assert ask(f"big{n}", 20) == 21  # taken
        assert len(caplog.records) == 3
        clock.now += 61.0
        assert ask("big-later", 20) == 21  # no turn: the state it is in, and the turns missed
    assert [r.getMessage() for r in caplog.records][3] == (
        "tieredkv: disk hits are taken again (a 20-chunk read predicted 0.007 s, recomputing "
        "0.020 s); 17 turns since the last warning were not logged")
