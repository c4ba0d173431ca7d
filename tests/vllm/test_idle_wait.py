"""A step that computes nothing sleeps on the remote probes in flight instead of spinning.

While a request waits for its probe, vLLM runs empty steps back to back; each holds the GIL
the store's thread needs to send and receive, so a loopback probe took ~12 ms instead of ~1
(e2e_ttft trace). Driven through :class:`SchedulerHalf` with a real vLLM ``Request`` and a
real redis-server, paused (SIGSTOP) so that the probe's answer comes only when the test says.
No time is asserted: only whether the probe was answered when the step returned."""

from __future__ import annotations

import os
import signal
import threading
from types import SimpleNamespace

from tests.vllm.test_kv_events import half, request
from tieredkv.vllm.scheduler_side import SchedulerHalf


def empty_step(h: SchedulerHalf, tokens: int = 0) -> None:
    """A step that schedules ``tokens`` tokens of requests the half does not track."""
    h.build_connector_meta(SimpleNamespace(
        preempted_req_ids=(), scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set()),
        num_scheduled_tokens={}, total_num_scheduled_tokens=tokens))


def test_an_idle_step_returns_once_the_probe_answered_a_busy_step_never_waits(
        fresh_server, monkeypatch) -> None:
    server = fresh_server()
    h = half(remote_url=server.url, remote_timeout_s=30)
    probe = h.planner.remote.probe
    monkeypatch.setattr("tieredkv.vllm.scheduler_side.IDLE_WAIT_S", 60.0)  # only the answer ends it
    os.kill(server.proc.pid, signal.SIGSTOP)
    resumed = threading.Timer(0.3, os.kill, (server.proc.pid, signal.SIGCONT))
    try:
        h.on_new_request(request("a", list(range(1, 300))))  # its probe is sent on arrival
        assert probe.in_flight("a")
        empty_step(h, tokens=64)  # a step that computes: returns with the probe unanswered
        assert probe.in_flight("a")
        resumed.start()
        empty_step(h)  # computes nothing: sleeps until the answer
        assert not probe.in_flight("a")
        empty_step(h)  # nothing in flight: returns at once (60 s would time the test out)
    finally:
        resumed.cancel()
        os.kill(server.proc.pid, signal.SIGCONT)
        h.shutdown()
