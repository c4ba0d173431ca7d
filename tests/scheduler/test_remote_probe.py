"""RemoteProbe against real redis-server processes: one round trip per prompt, never a wait.

Nothing is mocked but the probe's clock (``FakeClock``), which moves only when a test says
so: deadlines are tested without sleeping, and a slow machine cannot make a probe time out.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import pytest

from tests.remote.remote_helpers import (
    FINGERPRINT,
    OTHER_FINGERPRINT,
    RedisClusterProcs,
    RedisServer,
    chunk_items,
    free_port,
    wait_up,
)
from tieredkv.protocol import FailureCause
from tieredkv.scheduler.remote_tier import RemoteProbe

DEADLINE = 1.0  # fake seconds
FAILED = {FailureCause.IO_ERROR.value, FailureCause.TIMEOUT.value, FailureCause.UNAVAILABLE.value}
OpenThreaded = Callable[..., Any]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def write_chunks(
    store: Any, prefix: str, count: int, *, world_size: int = 2, start: int = 0,
    fingerprint: bytes = FINGERPRINT, skip: Collection[tuple[int, int]] = (),
) -> list[bytes]:
    """Write every rank's shard of chunks ``start..start+count`` except ``skip`` (chunk, rank)."""
    items: list[tuple[bytes, bytes]] = []
    keys: list[bytes] = []
    for rank in range(world_size):
        rows = chunk_items(prefix, count, 64, rank=rank, fingerprint=fingerprint, start=start)
        keys = [key for key, _, _ in rows]
        items += [(name, value) for i, (_, name, value) in enumerate(rows, start)
                  if (i, rank) not in skip]
    assert store.batch_set(items, timeout_s=10.0).result(15).ok
    return keys


def answer(probe: RemoteProbe, req_id: str, keys: Sequence[bytes], limit_s: float = 10.0) -> int:
    """Poll the way the scheduler does, once a step, until the probe answers."""
    give_up = time.monotonic() + limit_s
    while (found := probe.poll(req_id, keys)) is None:
        assert time.monotonic() < give_up, "the probe never answered"
        time.sleep(0.002)
    return found


def make_probe(store: Any, prefix: str, clock: FakeClock, **options: Any) -> RemoteProbe:
    options = {"world_size": 2, "deadline_s": DEADLINE, "store_timeout_s": 5.0, **options}
    return RemoteProbe(store, options.pop("fingerprint", FINGERPRINT), prefix=prefix,
                       clock=clock, **options)


def masters(redis_deployment: RedisServer | RedisClusterProcs) -> int:
    return len(redis_deployment.servers) if isinstance(redis_deployment, RedisClusterProcs) else 1


def test_a_500_chunk_prompt_is_one_call_and_a_missing_shard_ends_the_prefix(
    redis_deployment: RedisServer | RedisClusterProcs, open_threaded: OpenThreaded, prefix: str
) -> None:
    store = open_threaded(redis_deployment.url)
    assert wait_up(store, 10)
    keys = write_chunks(store, prefix, 500, skip={(317, 1)})  # rank 1 lacks chunk 317
    probe = make_probe(store, prefix, FakeClock())
    before = store.stats()

    assert probe.poll("r", keys) is None  # sent, not awaited
    assert answer(probe, "r", keys) == 317
    after = store.stats()
    assert after.calls["exists"] - before.calls.get("exists", 0) == 1
    assert after.round_trips - before.round_trips <= masters(redis_deployment)
    stats = probe.take_stats()
    assert (stats.probes, stats.keys_probed, stats.answered, stats.timeouts) == (1, 500, 1, 0)
    assert not stats.failures and len(stats.latency_s) == 1
    # Every chunk held by both ranks is remembered, the hole is not.
    assert len(probe._known) == 499
    # The answer stands: no second probe for the same request.
    assert probe.poll("r", keys) == 317
    assert store.stats().calls["exists"] == after.calls["exists"]
    assert probe.take_stats().probes == 0


def test_a_stalled_server_gets_ask_again_then_nothing_at_the_deadline(
    fresh_server: Callable[..., RedisServer], open_threaded: OpenThreaded, prefix: str
) -> None:
    server = fresh_server()
    # No health pings: they would close the connection under the stalled call.
    store = open_threaded(server.url, health_interval_s=600.0)
    assert wait_up(store, 10)
    keys = write_chunks(store, prefix, 20)
    clock = FakeClock()
    probe = make_probe(store, prefix, clock, store_timeout_s=60.0)
    assert answer(probe, "early", keys[:10]) == 10
    probe.reset()  # so the stalled probes below must ask the server about every key
    probe.take_stats()

    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        for _ in range(50):
            assert probe.poll("new", keys) is None
            assert probe.poll("early", keys) is None  # the extension: keys 10..19
            clock.advance(DEADLINE / 100)
        # poll returned while the store's answer was still outstanding: it never waited.
        assert probe.in_flight("new") and probe.in_flight("early")
        clock.advance(DEADLINE)
        assert probe.poll("new", keys) == 0           # serve what you have: nothing remote
        assert probe.poll("early", keys) == 10        # what was confirmed before the stall
        assert probe.poll("new", keys) == 0 and probe.poll("early", keys) == 10
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    stats = probe.take_stats()
    assert (stats.probes, stats.keys_probed, stats.timeouts, stats.answered) == (2, 30, 2, 0)
    assert not stats.failures


def test_an_idle_step_sleeps_until_a_probe_answers_and_never_past_its_bound(
    fresh_server: Callable[..., RedisServer], open_threaded: OpenThreaded, prefix: str
) -> None:
    """What the scheduler does on a step that computes nothing (rather than spin, holding the
    GIL the store's thread needs): wait returns once a probe is answered, at once with none in
    flight, and at its bound on a stalled server, the probe still pending."""
    server = fresh_server()
    store = open_threaded(server.url, health_interval_s=600.0)
    assert wait_up(store, 10)
    keys = write_chunks(store, prefix, 12)
    probe = make_probe(store, prefix, FakeClock(), store_timeout_s=60.0)
    assert probe.wait(0.001) is False  # nothing in flight
    assert probe.poll("a", keys) is None
    # The store's thread may answer before wait is even called (then there is nothing to wait
    # for); either way, once wait returns the probe is answered, not cut off at the bound.
    probe.wait(30.0)
    assert not probe.in_flight("a")
    assert probe.poll("a", keys) == 12  # answered by the time wait returned
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        assert probe.poll("b", keys[:6] + [b"\x01" * 32]) is None
        assert probe.wait(0.05) is False
        assert probe.in_flight("b")
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    probe.wait(30.0)
    assert not probe.in_flight("b")


def test_a_killed_or_absent_server_answers_nothing_with_the_cause_counted(
    fresh_server: Callable[..., RedisServer], open_threaded: OpenThreaded, prefix: str
) -> None:
    server = fresh_server()
    store = open_threaded(server.url, timeout_s=0.5)
    assert wait_up(store, 10)
    keys = write_chunks(store, prefix, 8)
    probe = make_probe(store, prefix, FakeClock())
    server.kill()
    assert answer(probe, "a", keys) == 0
    assert answer(probe, "b", keys) == 0  # by now the store knows it is down
    stats = probe.take_stats()
    assert stats.probes == 2 and stats.answered == 0 and stats.timeouts == 0
    assert sum(stats.failures.values()) == 2 and set(stats.failures) <= FAILED

    nowhere = open_threaded(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens
    absent = make_probe(nowhere, prefix, FakeClock())
    assert absent.poll("c", keys) is None
    assert answer(absent, "c", keys) == 0
    assert absent.take_stats().failures == {FailureCause.UNAVAILABLE.value: 1}


def test_known_present_chunks_are_not_probed_again_until_reset(
    redis_server: RedisServer, open_threaded: OpenThreaded, prefix: str
) -> None:
    store = open_threaded(redis_server.url)
    assert wait_up(store, 10)
    keys = write_chunks(store, prefix, 50)
    probe = make_probe(store, prefix, FakeClock())

    assert answer(probe, "a", keys[:40]) == 40
    assert probe.take_stats().keys_probed == 40
    assert probe.poll("b", keys) is None  # shares 40 chunks, adds 10
    assert answer(probe, "b", keys) == 50
    stats = probe.take_stats()
    assert (stats.probes, stats.keys_probed, stats.known_hits) == (1, 10, 40)
    # Everything known: answered at once, no call at all.
    assert probe.poll("c", keys[:30]) == 30
    assert probe.take_stats().probes == 0

    probe.reset()
    assert len(probe._known) == 0
    assert probe.poll("d", keys) is None
    assert answer(probe, "d", keys) == 50
    assert probe.take_stats().keys_probed == 50


def test_absence_is_never_remembered(
    redis_server: RedisServer, open_threaded: OpenThreaded, prefix: str
) -> None:
    store = open_threaded(redis_server.url)
    assert wait_up(store, 10)
    keys = write_chunks(store, prefix, 10, skip={(4, 0)})
    probe = make_probe(store, prefix, FakeClock())
    assert answer(probe, "a", keys) == 4
    write_chunks(store, prefix, 1, start=4)  # another replica stores chunk 4 meanwhile
    probe.take_stats()
    assert probe.poll("b", keys) is None
    assert answer(probe, "b", keys) == 10
    assert probe.take_stats().keys_probed == 1  # only the chunk that was absent


def test_a_growing_prompt_probes_only_what_is_new(
    redis_server: RedisServer, open_threaded: OpenThreaded, prefix: str
) -> None:
    store = open_threaded(redis_server.url)
    assert wait_up(store, 10)
    keys = write_chunks(store, prefix, 30)
    holed = write_chunks(store, prefix, 20, start=100, skip={(105, 1)})
    probe = make_probe(store, prefix, FakeClock(), known_capacity=0)  # no cache: per request

    assert answer(probe, "a", keys[:20]) == 20
    assert probe.poll("a", keys[:20]) == 20
    assert probe.poll("a", keys) is None  # ten more chunks after more tokens
    assert answer(probe, "a", keys) == 30
    assert probe.poll("a", keys[:12]) == 12  # a shorter view of the same prompt
    stats = probe.take_stats()
    assert (stats.probes, stats.keys_probed) == (2, 30)

    assert answer(probe, "h", holed[:10]) == 5
    assert probe.poll("h", holed) == 5  # the hole already ends the prefix: no probe
    assert probe.take_stats().probes == 1

    # Growth while a probe is in flight: the new keys follow in one more probe.
    assert probe.poll("g", keys[:10]) is None
    assert answer(probe, "g", keys) == 30
    stats = probe.take_stats()
    assert (stats.probes, stats.keys_probed) == (2, 30)

    # Another prompt under the same id starts over; so does a forgotten request.
    assert probe.poll("a", holed) is None
    assert answer(probe, "a", holed) == 5
    probe.forget("a")
    assert probe.poll("a", holed) is None
    assert answer(probe, "a", holed) == 5
    assert probe.take_stats().probes == 2


def test_another_namespace_is_never_counted_present(
    redis_deployment: RedisServer | RedisClusterProcs, open_threaded: OpenThreaded, prefix: str
) -> None:
    """cache_salt and model isolation are by key: the fingerprint is part of every name."""
    store = open_threaded(redis_deployment.url)
    assert wait_up(store, 10)
    keys = write_chunks(store, prefix, 20, fingerprint=FINGERPRINT)
    other = make_probe(store, prefix, FakeClock(), fingerprint=OTHER_FINGERPRINT)
    assert answer(other, "r", keys) == 0
    assert len(other._known) == 0
    owner = make_probe(store, prefix, FakeClock())
    assert answer(owner, "r", keys) == 20


def test_arguments_are_checked(redis_server: RedisServer, open_threaded: OpenThreaded) -> None:
    store = open_threaded(redis_server.url)
    with pytest.raises(ValueError):
        RemoteProbe(store, FINGERPRINT, 0, deadline_s=1.0)
    with pytest.raises(ValueError):
        RemoteProbe(store, FINGERPRINT, 1, deadline_s=0.0)
    with pytest.raises(ValueError):
        RemoteProbe(store, FINGERPRINT[:8], 1, deadline_s=1.0)
    with pytest.raises(ValueError):
        RemoteProbe(store, FINGERPRINT, 1, prefix="a{b}", deadline_s=1.0)
    probe = RemoteProbe(store, FINGERPRINT, 1, deadline_s=1.0)
    assert probe.poll("r", []) == 0
    with pytest.raises(ValueError):
        probe.poll("r", [b"short"])
