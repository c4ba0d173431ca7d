"""KV events: what the scheduler half announces per tier, with vLLM's own block hashes.

Driven through :class:`SchedulerHalf` with real vLLM ``Request`` objects (real block hashes,
tokens and extra keys) and plain job results (no worker, no bytes)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.request import Request

from tests.vllm.test_worker_side import BLOCK, CHUNK_BLOCKS, fake_configs
from tieredkv.config import TieredKVConfig
from tieredkv.protocol import FailureCause, JobResult, Move
from tieredkv.vllm.kv_events import LOG_NAME, EventGroup, KVEvents, event_groups
from tieredkv.vllm.scheduler_side import SchedulerHalf

CHUNK = BLOCK * CHUNK_BLOCKS
SLOT_BYTES = 128 * 1024  # one chunk of fake_configs() (2 layers x 2 rows x 32 KiB)

init_none_hash(sha256)
HASHER = get_request_block_hasher(BLOCK, sha256)


def request(req_id: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=1), None, cache_salt=salt,
                   block_hasher=HASHER)


def ext(req: Request, blocks: range | list[int]) -> list:
    """vLLM's event hashes of blocks ``blocks`` (what its own device-cache events carry)."""
    return [maybe_convert_block_hash(req.block_hashes[b]) for b in blocks]


def half(tmp_path=None, *, host_slots: int = 16, disk_slots: int = 0, events: bool = True,
         **extra) -> SchedulerHalf:
    vllm_config, kv_cache_config = fake_configs()
    vllm_config.kv_transfer_config = SimpleNamespace(kv_load_failure_policy="recompute")
    vllm_config.kv_events_config = SimpleNamespace(enable_kv_cache_events=events)
    raw = {"host_bytes": host_slots * SLOT_BYTES, "chunk_blocks": CHUNK_BLOCKS, **extra}
    if disk_slots:
        raw |= {"disk_path": str(tmp_path), "disk_bytes": disk_slots * SLOT_BYTES + 4096 * disk_slots}
    return SchedulerHalf(vllm_config, kv_cache_config, TieredKVConfig.from_dict(raw))


def ok_all(h: SchedulerHalf, plan, *moves: Move, failed: FailureCause | None = None) -> None:
    results = []
    for move in moves or (Move.STORE, Move.SPILL, Move.PROMOTE, Move.LOAD):
        for job in plan.of(move):
            results.append(JobResult(job.job_id, ok=0, failed=1, failure=failed) if failed
                           else JobResult(job.job_id, ok=1))
    h.planner.apply(results)


def write_spills(h: SchedulerHalf, plan) -> None:
    """Be the worker for the plan's spills: their slots written to the slab file, so that a
    restart's recovery (which verifies every slot header) finds them."""
    from tieredkv.disk import aliases_kept
    from tieredkv.disk.slab import SlabFile

    g = h.geometry
    assert h.catalog is not None
    with SlabFile.open(h.catalog.slab_path(0), h.planner.disk.num_slots, g.chunk_payload_bytes,
                       g.fingerprint) as slab:
        for job in plan.of(Move.SPILL):
            slab.write_slot(job.dst.slot, job.key, memoryview(bytes(g.chunk_payload_bytes)),
                            aliases=aliases_kept(job.dst.aliases))
    ok_all(h, plan, Move.SPILL)


def step(h: SchedulerHalf, new=(), computed: dict[str, int] | None = None):
    """One scheduler step: ``new`` requests scheduled whole (prompt computed), jobs planned."""
    reqs = []
    for req in new:
        h.on_new_request(req)
        req.num_computed_tokens = 0
        n = req.num_prompt_tokens
        reqs.append(SimpleNamespace(req_id=req.request_id,
                                    block_ids=(list(range(1, 1 + -(-n // BLOCK))),)))
    output = SimpleNamespace(
        preempted_req_ids=(), scheduled_new_reqs=reqs,
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set()),
        num_scheduled_tokens={r.request_id: r.num_prompt_tokens for r in new},
        total_num_scheduled_tokens=sum(r.num_prompt_tokens for r in new),
    )
    return h.build_connector_meta(output).plan


def stored(events, medium: str) -> list:
    return [e for e in events if isinstance(e, BlockStored) and e.medium == medium
            and (e.locality == "LOCAL")]


def removed(events, medium: str) -> list:
    return [e for e in events if isinstance(e, BlockRemoved) and e.medium == medium
            and e.locality == "LOCAL"]


def hashes(events) -> list:
    return [h for e in events for h in e.block_hashes]


def test_store_announces_vllms_hashes_tokens_and_salt_on_the_host_tier():
    h = half()
    req = request("a", list(range(2 * CHUNK + BLOCK + 3)), salt="s1")  # 2 chunks + a tail block
    plan = step(h, [req])
    assert h.take_events() == []  # planned, not READY yet
    ok_all(h, plan)
    events = h.take_events()
    cpu = stored(events, "CPU")
    assert hashes(cpu) == ext(req, range(5))
    first = cpu[0]
    assert first.parent_block_hash is None and first.block_size == BLOCK
    assert first.token_ids == req.all_token_ids[:len(first.block_hashes) * BLOCK]
    assert first.extra_keys[0] == ("s1",) and all(k is None for k in first.extra_keys[1:])
    assert first.group_idx == 0
    for before, after in zip(cpu, cpu[1:], strict=False):
        assert after.parent_block_hash == before.block_hashes[-1]
    assert h.take_events() == []  # taken once


def test_off_unless_vllm_publishes_events():
    h = half(events=False)
    assert h.events is None and h.planner.host.listener is None
    ok_all(h, step(h, [request("a", list(range(2 * CHUNK)))]))
    assert h.take_events() == []


def test_a_second_request_with_the_prefix_announces_only_new_blocks():
    h = half()
    a = request("a", list(range(CHUNK + 1)))
    ok_all(h, step(h, [a]))
    assert hashes(stored(h.take_events(), "CPU")) == ext(a, range(CHUNK_BLOCKS))
    # The same first chunk again (a hit, nothing stored twice) and a new second chunk.
    b = request("b", list(range(2 * CHUNK + 1)))
    h.get_num_new_matched_tokens(b, 0)
    ok_all(h, step(h, [b]), Move.STORE)
    events = stored(h.take_events(), "CPU")
    assert hashes(events) == ext(b, range(CHUNK_BLOCKS, 2 * CHUNK_BLOCKS))
    assert events[0].parent_block_hash == ext(b, [CHUNK_BLOCKS - 1])[0]


def test_a_tail_superseded_by_its_longer_entry_announces_nothing_twice_and_removes_nothing():
    h = half()
    short = request("a", list(range(BLOCK + 1)))  # a tail of one block
    ok_all(h, step(h, [short]))
    assert hashes(stored(h.take_events(), "CPU")) == ext(short, [0])
    long = request("b", list(range(CHUNK + 1)))  # the whole chunk: holds the tail's block too
    ok_all(h, step(h, [long]))
    events = h.take_events()
    assert hashes(stored(events, "CPU")) == ext(long, range(1, CHUNK_BLOCKS))
    assert removed(events, "CPU") == []  # the tail went, its block is still held
    assert len(h.planner.host) == 1


def test_eviction_removes_blocks_only_when_the_last_entry_holding_them_goes():
    h = half(host_slots=2)
    a = request("a", list(range(CHUNK + 1)))
    ok_all(h, step(h, [a]))
    b = request("b", list(range(10_000, 10_000 + CHUNK + 1)))
    ok_all(h, step(h, [b]))
    h.take_events()
    c = request("c", list(range(20_000, 20_000 + CHUNK + 1)))
    ok_all(h, step(h, [c]))  # the host tier is full: the least recently used (a) goes
    events = h.take_events()
    assert hashes(removed(events, "CPU")) == ext(a, range(CHUNK_BLOCKS))
    assert hashes(stored(events, "CPU")) == ext(c, range(CHUNK_BLOCKS))
    assert [type(e) for e in events] == [BlockRemoved, BlockStored]  # in the order it happened


def test_spill_promote_and_corruption_on_the_disk_tier(tmp_path):
    h = half(tmp_path, host_slots=2, disk_slots=8)
    a = request("a", list(range(2 * CHUNK + 1)))
    ok_all(h, step(h, [a]))
    assert hashes(stored(h.take_events(), "CPU")) == ext(a, range(2 * CHUNK_BLOCKS))
    spills = h.planner.take_plan()
    assert len(spills.of(Move.SPILL)) == 2
    ok_all(h, spills, Move.SPILL)
    disk = stored(h.take_events(), "STORAGE")
    assert hashes(disk) == ext(a, range(2 * CHUNK_BLOCKS))
    assert disk[0].token_ids == a.all_token_ids[:CHUNK]
    # Another prompt takes the host tier: a's blocks leave host, stay on disk.
    b = request("b", list(range(10_000, 10_000 + 2 * CHUNK + 1)))
    ok_all(h, step(h, [b]))
    events = h.take_events()
    assert hashes(removed(events, "CPU")) == ext(a, range(2 * CHUNK_BLOCKS))
    assert removed(events, "STORAGE") == []
    ok_all(h, h.planner.take_plan(), Move.SPILL)
    h.take_events()
    # a again: promoted from disk into host, announced on host again.
    again = request("c", list(range(2 * CHUNK + 1)))
    assert h.get_num_new_matched_tokens(again, 0) == (None, False)
    promotes = step(h, [])
    first, second = promotes.of(Move.PROMOTE)
    h.planner.apply([JobResult(first.job_id, ok=1),
                     JobResult(second.job_id, ok=0, failed=1, failure=FailureCause.CHECKSUM)])
    events = h.take_events()
    promoted = [first.key, second.key].index(first.key)
    assert promoted == 0
    by_key = {k: b for b, k in enumerate(h.keys_for(again))}
    good, bad = by_key[first.key], by_key[second.key]
    good_blocks = range(good * CHUNK_BLOCKS, (good + 1) * CHUNK_BLOCKS)
    bad_blocks = range(bad * CHUNK_BLOCKS, (bad + 1) * CHUNK_BLOCKS)
    assert hashes(stored(events, "CPU")) == ext(again, good_blocks)
    # The corrupted chunk's disk copy is dropped: its blocks are removed from the disk tier.
    assert hashes(removed(events, "STORAGE")) == ext(again, bad_blocks)


def test_reset_clears_every_tier_once(tmp_path):
    h = half(tmp_path, disk_slots=8)
    a = request("a", list(range(CHUNK + 1)))
    ok_all(h, step(h, [a]))
    ok_all(h, h.planner.take_plan(), Move.SPILL)
    h.take_events()
    h.reset_cache()
    events = h.take_events()
    assert [type(e) for e in events] == [AllBlocksCleared]
    # Stored again after the reset: announced again.
    ok_all(h, step(h, [request("b", list(range(CHUNK + 1)))]))
    assert hashes(stored(h.take_events(), "CPU")) == ext(a, range(CHUNK_BLOCKS))


def test_restart_announces_the_recovered_disk_tier_a_bounded_part_per_step(tmp_path):
    h = half(tmp_path, disk_slots=16)
    reqs = [request(f"r{i}", list(range(i * 1000, i * 1000 + CHUNK + 1))) for i in range(5)]
    ok_all(h, step(h, reqs))
    write_spills(h, h.planner.take_plan())
    before = stored(h.take_events(), "STORAGE")
    assert len(hashes(before)) == 5 * CHUNK_BLOCKS
    h.shutdown()
    assert (tmp_path / LOG_NAME).exists()

    again = half(tmp_path, disk_slots=16)
    assert len(again.planner.disk) == 5
    again.events.announce_per_step = 2
    assert again.has_pending_work()  # vLLM steps an idle engine until it is announced
    per_step = [stored(again.take_events(), "STORAGE") for _ in range(4)]
    assert [len(s) for s in per_step] == [2, 2, 1, 0]
    assert not again.has_pending_work()
    announced = [e for s in per_step for e in s]
    key = lambda e: tuple(e.block_hashes)  # noqa: E731
    assert sorted(announced, key=key) == sorted(before, key=key)  # tokens, parents and all
    again.shutdown()


def with_remote_tier(h: SchedulerHalf) -> None:
    """Give ``h`` a planner with a shared tier whose writes are completed by hand (no Redis:
    nothing here probes it; the placer's completion is what runs)."""
    from tieredkv.scheduler.planner import Planner
    from tieredkv.scheduler.remote_tier import RemoteTier

    old = h.planner
    probe = SimpleNamespace(known=lambda key: False, unknow=lambda key: None,
                            names=lambda key: [key.hex()])
    tier = RemoteTier(probe, is_up=lambda: True, writes=True, admission=1,
                      seen_limit=64, server_info=lambda: None)
    h.planner = Planner(old.config, block_size=BLOCK, num_host_slots=old.host.num_slots,
                        remote=tier)
    h.planner.host.listener = h.events


def store_without_probe(h: SchedulerHalf, req: Request):
    h._requests[req.request_id] = req  # on_new_request would probe the (absent) Redis
    req.num_computed_tokens = 0
    n = req.num_prompt_tokens
    output = SimpleNamespace(
        preempted_req_ids=(), scheduled_new_reqs=[SimpleNamespace(
            req_id=req.request_id, block_ids=(list(range(1, 1 + -(-n // BLOCK))),))],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set()),
        num_scheduled_tokens={req.request_id: n}, total_num_scheduled_tokens=n)
    ok_all(h, h.build_connector_meta(output).plan, Move.STORE)


def test_the_shared_tier_is_announced_as_remote_storage_once_written():
    h = half(chunk_blocks=4)  # a chunk of 4 blocks: a tail of 2 goes to Redis (one block does not)
    with_remote_tier(h)
    a = request("a", list(range(2 * BLOCK + 1)))  # a two-block tail first
    store_without_probe(h, a)
    writes = h.planner.take_plan().of(Move.REMOTE_WRITE)
    assert len(writes) == 1
    h.take_events()
    h.planner.apply([JobResult(writes[0].job_id, ok=1)])
    (event,) = h.take_events()
    assert (event.medium, event.locality, event.ownership) == ("STORAGE", "REMOTE", "shared")
    assert event.block_hashes == ext(a, [0, 1])
    # Its whole chunk is written later: only the new blocks are announced; the tail's value,
    # deleted as superseded, removes nothing (the chunk's value holds its blocks).
    b = request("b", list(range(4 * BLOCK + 1)))
    store_without_probe(h, b)
    writes = h.planner.take_plan().of(Move.REMOTE_WRITE)
    h.take_events()
    h.planner.apply([JobResult(w.job_id, ok=1) for w in writes])
    (event,) = h.take_events()
    assert isinstance(event, BlockStored) and event.locality == "REMOTE"
    assert event.block_hashes == ext(b, [2, 3])
    # A failed write announces nothing.
    c = request("c", list(range(5000, 5000 + 4 * BLOCK + 1)))
    store_without_probe(h, c)
    writes = h.planner.take_plan().of(Move.REMOTE_WRITE)
    assert writes
    h.take_events()
    h.planner.apply([JobResult(w.job_id, ok=0, failed=1, failure=FailureCause.IO_ERROR) for w in writes])
    assert [e for e in h.take_events() if e.locality == "REMOTE"] == []


@pytest.mark.parametrize("corrupt", [b"", b"\x05\x00\x00\x00ab"])
def test_a_missing_or_torn_log_announces_what_it_can(tmp_path, corrupt):
    h = half(tmp_path, disk_slots=8)
    ok_all(h, step(h, [request("a", list(range(CHUNK + 1)))]))
    write_spills(h, h.planner.take_plan())
    h.shutdown()
    log = tmp_path / LOG_NAME
    if corrupt:
        log.write_bytes(log.read_bytes() + corrupt)  # a torn record after a good one
        expected = 1
    else:
        log.unlink()
        expected = 0
    again = half(tmp_path, disk_slots=8)
    assert len(stored(again.take_events(), "STORAGE")) == expected
    again.shutdown()


def test_hybrid_groups_announce_what_each_serves_with_vllms_group_index():
    """A sliding-window group announces only the blocks of a chunk a hit needs (its window at
    the chunk's end); a full-attention group every block; each with its group index."""
    from tests.vllm.test_groups import _config, _spec
    from tieredkv.vllm.geometry import group_geometry

    config = _config(_spec("sliding", window=64, block_size=BLOCK), _spec("full", block_size=BLOCK))
    slot_rows = group_geometry(config, chunk_blocks=4).slot_rows
    groups = event_groups(config, slot_rows)
    assert groups == (EventGroup(0, "sliding_window", 64, 2), EventGroup(1, "full_attention", None, 0))
    events = KVEvents(block_size=BLOCK, chunk_blocks=4, hash_block_size=BLOCK, groups=groups)
    req = request("a", list(range(8 * BLOCK + 1)))
    events.record(b"k" * 32, req, 7)  # whole chunk 1: blocks 4..7
    events.entry_ready("host", b"k" * 32)
    sliding, full = events.take()
    assert (sliding.group_idx, sliding.block_hashes) == (0, ext(req, [6, 7]))
    assert sliding.parent_block_hash == ext(req, [5])[0]
    assert sliding.token_ids == req.all_token_ids[6 * BLOCK:8 * BLOCK]
    assert (sliding.kv_cache_spec_kind, sliding.kv_cache_spec_sliding_window) == ("sliding_window", 64)
    assert (full.group_idx, full.block_hashes) == (1, ext(req, range(4, 8)))
    assert full.parent_block_hash == ext(req, [3])[0]
    events.entry_gone("host", b"k" * 32)
    gone = events.take()
    assert [(e.group_idx, e.block_hashes) for e in gone] == [(0, ext(req, [6, 7])), (1, ext(req, range(4, 8)))]


def test_a_hybrid_prompts_tail_announces_the_window_before_its_end():
    """A prompt's tail of a hybrid model (#25) holds the sliding group's window before the
    tail's end, not before the chunk's: those are the blocks it announces (a one-block tail
    with a two-block window: its one block)."""
    from tests.vllm.test_groups import _config, _spec
    from tieredkv.vllm.geometry import group_geometry

    config = _config(_spec("sliding", window=64, block_size=BLOCK), _spec("full", block_size=BLOCK))
    groups = event_groups(config, group_geometry(config, chunk_blocks=4).slot_rows)
    events = KVEvents(block_size=BLOCK, chunk_blocks=4, hash_block_size=BLOCK, groups=groups)
    req = request("a", list(range(8 * BLOCK + 1)))
    events.record(b"t" * 32, req, 6)  # the tail of chunk 1: blocks 4..6
    events.entry_ready("host", b"t" * 32)
    sliding, full = events.take()
    assert (sliding.group_idx, sliding.block_hashes) == (0, ext(req, [5, 6]))
    assert (full.group_idx, full.block_hashes) == (1, ext(req, range(4, 7)))
    events.record(b"o" * 32, req, 4)  # a one-block tail: block 4
    events.entry_ready("host", b"o" * 32)
    events.entry_gone("host", b"t" * 32)
    assert [(e.group_idx, e.block_hashes) for e in events.take()] == [
        (0, ext(req, [4])), (0, ext(req, [5, 6])), (1, ext(req, [5, 6]))]
