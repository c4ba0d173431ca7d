"""A step that computes nothing sleeps on the remote probes in flight instead of spinning.

While a request waits for its probe, an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
runs empty steps back to back; each holds the GIL the store's thread needs to send and
receive, so a loopback probe took ~12 ms instead of ~1 (e2e_ttft trace). The sleep must never
delay an engine that is computing: not while an earlier step's output is outstanding (async
scheduling, pipeline parallel). Driven through :class:`SchedulerHalf` with a real vLLM
``Request`` and a real redis-server, paused (SIGSTOP) so that the probe's answer comes only
when the test says. No time is asserted: only whether the probe was answered when the step
returned."""

from __future__ import annotations

import os
import signal
import threading
from types import SimpleNamespace

from tests.vllm.test_kv_events import half, request
from tieredkv.vllm.metadata import TieredKVWorkerMetadata
from tieredkv.vllm.scheduler_side import SchedulerHalf

RESUME_AFTER_S = 2.0  # a step that returns at once returns long before this


def empty_step(h: SchedulerHalf, tokens: int = 0) -> int:
    """A step that schedules ``tokens`` tokens of requests the half does not track; its number."""
    meta = h.build_connector_meta(SimpleNamespace(
        preempted_req_ids=(), scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set()),
        num_scheduled_tokens={}, total_num_scheduled_tokens=tokens))
    return meta.plan.step


def output_of(h: SchedulerHalf, step: int) -> None:
    h.update_connector_output(SimpleNamespace(
        kv_connector_worker_meta=TieredKVWorkerMetadata(step=step), kv_connector_stats=None))


def test_an_idle_step_returns_once_the_probe_answered_never_while_a_step_computes(
        fresh_server, monkeypatch) -> None:
    server = fresh_server()
    h = half(remote_url=server.url, remote_timeout_s=30)
    probe = h.planner.remote.probe
    monkeypatch.setattr("tieredkv.vllm.scheduler_side.IDLE_WAIT_S", 60.0)  # only the answer ends it
    os.kill(server.proc.pid, signal.SIGSTOP)
    resumed = threading.Timer(RESUME_AFTER_S, os.kill, (server.proc.pid, signal.SIGCONT))
    try:
        h.on_new_request(request("a", list(range(1, 300))))  # its probe is sent on arrival
        assert probe.in_flight("a")
        computing = empty_step(h, tokens=64)  # a step that computes: returns at once
        assert probe.in_flight("a")
        resumed.start()
        empty_step(h)  # nothing scheduled, but step `computing` has not come back (async
        assert probe.in_flight("a")  # scheduling): vLLM waits on it anyway, no sleep here
        output_of(h, computing)
        output_of(h, computing + 1)
        empty_step(h)  # nothing computes: sleeps until the answer
        assert not probe.in_flight("a")
        empty_step(h)  # nothing in flight: returns at once (60 s would time the test out)
    finally:
        resumed.cancel()
        os.kill(server.proc.pid, signal.SIGCONT)
        h.shutdown()
