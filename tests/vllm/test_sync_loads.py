"""Synchronous loads: on vLLM's CPU build a host-tier hit is loaded before the forward of the
step that schedules it (``sync_loads``), within a per-step byte bound.

Driven through :class:`SchedulerHalf` with real vLLM ``Request`` objects; the worker's side of
a synchronous load is in ``test_worker_side.py``, and real vLLM runs it in tests/e2e."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.vllm.test_kv_events import BLOCK, CHUNK, ok_all, request, step
from tests.vllm.test_worker_side import CHUNK_BLOCKS, fake_configs
from tieredkv.config import TieredKVConfig
from tieredkv.protocol import Move
from tieredkv.vllm.scheduler_side import SchedulerHalf


def on(device: str | None, **extra) -> SchedulerHalf:
    """A scheduler half whose ``device_config.device_type`` is ``device`` (None: a config
    without one, as the other unit tests build)."""
    vllm_config, kv_cache_config = fake_configs()
    vllm_config.kv_transfer_config = SimpleNamespace(kv_load_failure_policy="recompute")
    vllm_config.kv_events_config = None
    if device is not None:
        vllm_config.device_config = SimpleNamespace(device_type=device)
    raw = {"host_bytes": 16 * 128 * 1024, "chunk_blocks": CHUNK_BLOCKS} | extra
    return SchedulerHalf(vllm_config, kv_cache_config, TieredKVConfig.from_dict(raw))


def stored_prompt(h, req_id: str = "a", chunks: int = 2):
    """A prompt of ``chunks`` whole chunks and one token more, computed and stored in host."""
    a = request(req_id, list(range(chunks * CHUNK + 1)))
    ok_all(h, step(h, [a]))
    return a


def alloc(h, req, hit: int) -> None:
    blocks = list(range(40, 40 + hit // BLOCK + 1))
    h.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (blocks,)), hit)


def loads(h) -> list:
    return step(h, []).of(Move.LOAD)


def load_modes(h, *reqs) -> dict[str, bool]:
    """Allocate each request its two-chunk hit, plan the step and finish its loads: whether
    each request's load was planned synchronous."""
    for req in reqs:
        alloc(h, req, 2 * CHUNK)
    plan = step(h, [])
    ok_all(h, plan, Move.LOAD)
    return {job.req_id: job.src.sync for job in plan.of(Move.LOAD)}


def test_on_cpu_a_host_hit_is_answered_synchronous_and_its_load_is_marked_so():
    h = on("cpu")
    stored_prompt(h)
    b = request("b", list(range(2 * CHUNK + 1)))
    assert h.get_num_new_matched_tokens(b, 0) == (2 * CHUNK, False)  # vLLM schedules b now
    alloc(h, b, 2 * CHUNK)
    (load,) = loads(h)
    assert load.req_id == "b" and load.src.sync


@pytest.mark.parametrize("device, extra", [("cuda", {}), (None, {}), ("cpu", {"sync_loads": False})])
def test_elsewhere_or_turned_off_every_load_is_asynchronous(device, extra):
    h = on(device, **extra)
    stored_prompt(h)
    b = request("b", list(range(2 * CHUNK + 1)))
    assert h.get_num_new_matched_tokens(b, 0) == (2 * CHUNK, True)
    alloc(h, b, 2 * CHUNK)
    (load,) = loads(h)
    assert not load.src.sync


def test_a_steps_synchronous_loads_stay_within_the_byte_bound(monkeypatch):
    """Each synchronous load is copied before the step's forward: past the bound (per rank
    and step) a hit is loaded asynchronously, and the next step has the bound again. A
    request asked again in the same step is not counted twice."""
    h = on("cpu")
    stored_prompt(h)
    block_bytes = h._sync_block_bytes
    assert block_bytes == 128 * 1024 // 2  # one block of one rank's chunk
    monkeypatch.setattr("tieredkv.vllm.scheduler_side.INLINE_LOAD_MAX_BYTES", 6 * block_bytes)
    b = request("b", list(range(2 * CHUNK + 1)))  # 4 blocks
    c = request("c", list(range(2 * CHUNK + 2)))  # 4 blocks too: 8 > 6
    assert h.get_num_new_matched_tokens(b, 0) == (2 * CHUNK, False)
    assert h.get_num_new_matched_tokens(b, 0) == (2 * CHUNK, False)  # asked again: 4, not 8
    assert h.get_num_new_matched_tokens(c, 0) == (2 * CHUNK, True)
    assert load_modes(h, b, c) == {"b": True, "c": False}
    d = request("d", list(range(2 * CHUNK + 3)))
    assert h.get_num_new_matched_tokens(d, 0) == (2 * CHUNK, False)  # a new step, a new bound


def test_with_no_other_request_running_a_bigger_hit_is_still_synchronous(monkeypatch):
    """When the last step scheduled no other request (or those it did have finished), the
    copy delays no one's forward, so the larger IDLE_SYNC_LOAD_MAX_BYTES bound applies; while
    another request runs, the per-step bound does."""
    h = on("cpu")
    a = stored_prompt(h)  # "a" was scheduled in that step and has not finished: it runs
    block_bytes = h._sync_block_bytes
    monkeypatch.setattr("tieredkv.vllm.scheduler_side.INLINE_LOAD_MAX_BYTES", 3 * block_bytes)
    monkeypatch.setattr("tieredkv.vllm.scheduler_side.IDLE_SYNC_LOAD_MAX_BYTES", 6 * block_bytes)
    b = request("b", list(range(2 * CHUNK + 1)))  # 4 blocks: over 3, under 6
    assert h.get_num_new_matched_tokens(b, 0) == (2 * CHUNK, True)  # "a" runs: async
    h.request_finished(a)
    assert h.get_num_new_matched_tokens(b, 0) == (2 * CHUNK, False)  # nobody else: sync
    c = request("c", list(range(2 * CHUNK + 2)))  # 4 more: 8 > 6 in the same step
    assert h.get_num_new_matched_tokens(c, 0) == (2 * CHUNK, True)
    assert load_modes(h, b, c) == {"b": True, "c": False}
    d = request("d", list(range(2 * CHUNK + 3)))
    step(h, [d])  # "d" is scheduled and keeps running
    e = request("e", list(range(2 * CHUNK + 4)))
    assert h.get_num_new_matched_tokens(e, 0) == (2 * CHUNK, True)
    step(h, [])  # a step that schedules no one: nothing runs any more
    assert h.get_num_new_matched_tokens(e, 0) == (2 * CHUNK, False)


def test_a_synchronous_answer_without_an_allocation_leaves_no_synchronous_load_behind():
    """vLLM may answer a lookup and then not schedule the request (no blocks, no budget):
    the next step asks again and decides again; nothing of the first answer is kept."""
    h = on("cpu")
    stored_prompt(h)
    b = request("b", list(range(2 * CHUNK + 1)))
    assert h.get_num_new_matched_tokens(b, 0) == (2 * CHUNK, False)
    assert loads(h) == []  # not allocated: no load, and the step's bound is given back
    assert h._sync_bytes == {}
    assert h.get_num_new_matched_tokens(b, 0) == (2 * CHUNK, False)


def test_a_hit_whose_prompt_needs_the_slots_it_reads_is_loaded_asynchronously():
    """The step that loads a synchronous hit also stores the prompt's chunks past it, while
    the load still pins the chunks it reads: with no other slot to take, those stores would be
    skipped. An asynchronous load has unpinned them by then, so it is used instead."""
    h = on("cpu", host_bytes=2 * 128 * 1024)  # two slots: exactly the hit
    stored_prompt(h)
    longer = request("b", list(range(4 * CHUNK + 1)))  # two chunks past the hit to store
    assert h.get_num_new_matched_tokens(longer, 0) == (2 * CHUNK, True)
    h2 = on("cpu", host_bytes=5 * 128 * 1024)  # room for them (and a tail) beside the hit
    stored_prompt(h2)
    assert h2.get_num_new_matched_tokens(request("c", list(range(4 * CHUNK + 1))), 0) == (2 * CHUNK, False)
