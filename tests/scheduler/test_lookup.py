"""Lookups on their own: a prompt's keys -> a hit of READY host chunks (pinned until vLLM
allocates), a round of fills from disk or the remote tier first, a load job, and what a failed
load drops. Real host index, disk tier, placer, fill path and ledger; the remote tier is a real
one over the in-memory store of test_remote_tier.py."""

from __future__ import annotations

from typing import Any

from test_planner import BLOCK, CHUNK_BLOCKS, CHUNK_TOKENS, keys_for
from test_remote_tier import Store, remote_tier

from tieredkv.config import TieredKVConfig
from tieredkv.metrics.specs import Count, Counts
from tieredkv.protocol import JobResult, LoadChunk, Move, StepPlan, Tier
from tieredkv.scheduler.ledger import HitEpoch, JobLedger, PlannerParts, RequestTable
from tieredkv.scheduler.lookup import Lookup
from tieredkv.scheduler.lower_tier import DiskTier, Fill
from tieredkv.scheduler.placement import Placer
from tieredkv.scheduler.tier_index import TierIndex

PROMPT = list(range(3 * CHUNK_TOKENS + BLOCK + 5))  # 3 chunks, a block, 5 tokens
KEYS = keys_for(PROMPT)


class Rig:
    def __init__(self, host_slots: int = 8, remote_tier: Any = None) -> None:
        self.host = TierIndex(Tier.HOST, host_slots)
        self.disk = DiskTier(8, policy="lru", admission=1, seen_limit=64)
        self.requests = RequestTable()
        self.ledger = JobLedger(1, self.requests)
        self.counters = Counts()
        self.epoch = HitEpoch()
        parts = PlannerParts(
            config=TieredKVConfig.from_dict({"chunk_blocks": CHUNK_BLOCKS}), block_size=BLOCK,
            host=self.host, lower=self.disk, requests=self.requests, ledger=self.ledger,
            epoch=self.epoch, counters=self.counters, remote=remote_tier,
        )
        self.placer = Placer(parts)
        fill = Fill(parts, self.placer)
        self.lookup = Lookup(parts, self.placer, fill)
        self.ledger.set_handlers({
            Move.STORE: self.placer.complete_store, Move.SPILL: self.placer.complete_spill,
            Move.PROMOTE: fill.complete, Move.REMOTE_READ: fill.complete,
            Move.LOAD: self.lookup.complete_load,
            Move.REMOTE_WRITE: self.placer.complete_remote_write,
        })

    def in_host(self, *chunks: int, tail_blocks: int = 0) -> None:
        """PROMPT's ``chunks`` READY in host; with ``tail_blocks``, the next chunk's first ones."""
        for c in chunks:
            self._ready(self.host, KEYS[c], KEYS.block_keys(c * CHUNK_BLOCKS, (c + 1) * CHUNK_BLOCKS - 1))
        if tail_blocks:
            base = (max(chunks) + 1) * CHUNK_BLOCKS
            self._ready(self.host, KEYS.block_key(base + tail_blocks - 1),
                        KEYS.block_keys(base, base + tail_blocks - 1))

    def on_disk(self, *chunks: int) -> None:
        for c in chunks:
            self.disk.restore(KEYS[c], c, KEYS.block_keys(c * CHUNK_BLOCKS, (c + 1) * CHUNK_BLOCKS - 1))

    @staticmethod
    def _ready(index: TierIndex, key: bytes, aliases: tuple[bytes, ...]) -> None:
        assert index.allocate(key, aliases) is not None and index.mark_ready(key)

    def ask(self, req: str = "r", computed: int = 0) -> int | None:
        return self.lookup.lookup(req, KEYS, computed, len(PROMPT))

    def step(self, failure: dict[int, tuple[str, tuple[int, ...]]] | None = None) -> StepPlan:
        """This step's plan, every job reported done (or failed, by job id)."""
        plan = self.ledger.take_plan()
        failure = failure or {}
        jobs = [*plan.of(Move.STORE), *plan.of(Move.SPILL), *plan.of(Move.PROMOTE), *plan.of(Move.LOAD), *plan.of(Move.REMOTE_READ),
                *plan.of(Move.REMOTE_WRITE)]
        self.ledger.apply([JobResult.fail(j.job_id, *failure[j.job_id]) if j.job_id in failure
                           else JobResult.done(j.job_id) for j in jobs])
        return plan


def test_a_host_hit_is_pinned_until_allocated_and_asking_again_changes_nothing():
    r = Rig()
    r.in_host(0, 1)
    assert r.ask(computed=BLOCK) == 2 * CHUNK_TOKENS - BLOCK
    assert r.host.pinned_count == 2
    assert r.ask(computed=BLOCK) == 2 * CHUNK_TOKENS - BLOCK and r.host.pinned_count == 2
    assert r.counters[Count.LOOKUPS] == 1
    assert r.counters[Count.LOOKUP_TOKENS] == 3 * CHUNK_TOKENS + BLOCK - BLOCK
    r.lookup.on_alloc("r", list(range(500, 520)), 0)  # vLLM took none of it: let go
    assert r.host.pinned_count == 0


def test_a_miss_pins_nothing_and_a_chunk_being_stored_is_not_promised():
    r = Rig()
    assert r.ask() == 0 and r.host.pinned_count == 0
    r.in_host(0)
    assert r.host.allocate(KEYS[1], ()) is not None  # chunk 1: its store is in flight
    r.in_host(2)
    assert r.ask("s") == CHUNK_TOKENS  # the hit ends where a chunk is not READY


def test_a_repeated_miss_turns_into_a_hit_as_soon_as_anything_arrives():
    """A miss asked again in the same state is answered without a scan; every way a hit can
    appear since (a store finishing in host, a copy on disk, the request's block hashes
    replaced by a streaming session) is seen on the next ask."""
    r = Rig()
    assert r.ask() == 0 and r.ask() == 0 and r.ask() == 0
    assert r.host.allocate(KEYS[0], ()) is not None  # its store is in flight: still no hit
    assert r.ask() == 0
    assert r.host.mark_ready(KEYS[0])
    assert r.ask() == CHUNK_TOKENS
    r.lookup.on_alloc("r", [], 0)  # not taken
    assert r.ask("d") == CHUNK_TOKENS
    assert r.ask("d", computed=CHUNK_TOKENS) == 0 and r.ask("d", computed=CHUNK_TOKENS) == 0
    r.on_disk(1)
    assert r.ask("d", computed=CHUNK_TOKENS) is None  # chunk 1 is on disk now: filled first
    # A streaming session replaced the request's block hashes (same length, other tokens),
    # with nothing arriving in between: the hit is on the new tokens, not a stale miss.
    other = [t + 10**6 for t in PROMPT]
    r._ready(r.host, keys_for(other)[0], ())
    fives, others = keys_for([5] * len(PROMPT)), keys_for(other)
    for _ in range(3):  # asked while it waits
        assert r.lookup.lookup("v", fives, 0, len(PROMPT)) == 0
    assert r.lookup.lookup("v", others, 0, len(PROMPT)) == CHUNK_TOKENS
    r.lookup.on_alloc("v", [], 0)
    streamed = keys_for([6] * len(PROMPT))  # the same keys object, its hashes replaced
    assert r.lookup.lookup("w", streamed, 0, len(PROMPT)) == 0
    assert r.lookup.lookup("w", streamed, 0, len(PROMPT)) == 0
    streamed.block_hashes[:] = keys_for(other).block_hashes
    assert r.lookup.lookup("w", streamed, 0, len(PROMPT)) == CHUNK_TOKENS


def test_a_repeated_miss_ends_when_a_removed_host_entry_stops_hiding_its_disk_copy():
    """A host entry removed while pinned (another request's hit on it, a load that failed)
    stays present until its last pin goes, and hides its disk copy meanwhile: a request
    waiting then misses. Once the pin goes, the disk copy is promoted, as a fresh lookup would."""
    r = Rig()
    r.on_disk(0)
    r._ready(r.host, KEYS[0], KEYS.block_keys(0, CHUNK_BLOCKS - 1))
    r.host.pin(KEYS[0])  # another request's hit
    r.host.remove(KEYS[0])  # e.g. a failed load dropped it
    assert r.ask("b") == 0 and r.ask("b") == 0 and r.ask("b") == 0
    r.host.unpin(KEYS[0])  # its slot is freed: nothing arrived, yet disk's copy is reachable
    assert r.ask("b") is None  # promoting from disk


def test_a_repeated_miss_ends_when_a_write_in_host_that_hid_a_disk_copy_aborts():
    """A chunk being written to host is not loadable, and hides a disk copy of it: a
    waiting request misses. When that write aborts, the disk copy is promoted."""
    r = Rig()
    r.on_disk(0)
    assert r.host.allocate(KEYS[0], ()) is not None  # a write in flight
    assert r.ask("b") == 0 and r.ask("b") == 0 and r.ask("b") == 0
    r.host.abort(KEYS[0])
    assert r.ask("b") is None  # promoting from disk


def test_the_hit_never_covers_the_last_token_and_ends_at_the_last_block_held():
    r = Rig()
    r.in_host(0, 1, 2, tail_blocks=1)
    assert r.ask() == 3 * CHUNK_TOKENS + BLOCK  # the tail's block, not the 5 tokens after it
    short = list(range(2 * CHUNK_TOKENS))
    assert r.lookup.lookup("s", keys_for(short), 0, len(short)) == 2 * CHUNK_TOKENS - BLOCK


def test_an_allocated_hit_becomes_one_load_of_exactly_its_blocks():
    r = Rig()
    r.in_host(0, 1, 2, tail_blocks=1)
    hit = r.ask(computed=BLOCK)
    assert hit == 3 * CHUNK_TOKENS
    device = list(range(100, 100 + len(PROMPT) // BLOCK + 1))
    r.lookup.on_alloc("r", device, hit)
    plan = r.step()
    (load,) = plan.of(Move.LOAD)
    slots = [r.host.get(k).slot for k in (KEYS[0], KEYS[1], KEYS[2])]  # type: ignore[union-attr]
    tail = KEYS.block_key(3 * CHUNK_BLOCKS)
    assert load.src.chunks == (
        LoadChunk(KEYS[0], slots[0], 1, (101, 102, 103)),
        LoadChunk(KEYS[1], slots[1], 0, (104, 105, 106, 107)),
        LoadChunk(KEYS[2], slots[2], 0, (108, 109, 110, 111)),
        LoadChunk(tail, r.host.get(tail).slot, 0, (112,)),  # type: ignore[union-attr]
    )
    assert r.lookup.hit_tokens("r") == {Tier.HOST: hit, Tier.DISK: 0}
    assert r.counters[Count.HIT_TOKENS, Tier.HOST] == hit and r.counters[Count.PARTIAL_HITS] == 1
    assert r.host.pinned_count == 0  # the load completed: nothing pinned


def test_a_prompt_vllm_holds_to_its_limit_fills_nothing_from_disk():
    """A chunk-aligned prompt whose computed tokens already reach the last block a hit could
    end at: its last chunk on disk would be promoted for a hit clipped to 0 tokens."""
    r = Rig()
    r.in_host(0, 1)
    r.on_disk(2)
    aligned = 3 * CHUNK_TOKENS  # KEYS' first three chunks are this prompt's
    assert r.lookup.lookup("r", KEYS, aligned - BLOCK, aligned) == 0
    assert r.ledger.take_plan().of(Move.PROMOTE) == []
    assert r.counters[Count.PROMOTED_CHUNKS] == 0 and r.host.pinned_count == 0
    assert (r.counters[Count.LOOKUPS], r.counters[Count.LOOKUP_TOKENS]) == (1, 0)


def test_disk_chunks_are_filled_into_host_before_they_are_promised():
    r = Rig()
    r.in_host(0)
    r.on_disk(1, 2)
    assert r.ask() is None  # promoting: ask again
    plan = r.step()
    assert [(p.key, p.src.slot) for p in plan.of(Move.PROMOTE)] == [(KEYS[1], 1), (KEYS[2], 2)]
    assert r.counters[Count.PROMOTED_CHUNKS] == 2
    hit = r.ask()
    assert hit == 3 * CHUNK_TOKENS
    r.lookup.on_alloc("r", list(range(100, 120)), hit)
    assert r.lookup.hit_tokens("r") == {Tier.HOST: CHUNK_TOKENS, Tier.DISK: 2 * CHUNK_TOKENS}


def test_a_failed_promotion_serves_what_host_holds_and_is_never_promoted_again():
    r = Rig()
    r.in_host(0)
    r.on_disk(1)
    assert r.ask() is None
    promote = r.ledger.plan.of(Move.PROMOTE)[0].job_id
    r.step({promote: ("checksum", ())})
    assert KEYS[1] not in r.disk and KEYS[1] not in r.host
    assert r.counters[Count.DISK_READ_FAILED, "checksum"] == 1
    assert r.ask() == CHUNK_TOKENS


def test_a_failed_load_drops_the_chunk_it_failed_in_and_recomputes_cached_hits():
    r = Rig()
    r.in_host(0, 1)
    hit = r.ask()
    r.lookup.on_alloc("r", list(range(100, 120)), hit)
    epoch = r.epoch.value
    (load,) = r.ledger.plan.of(Move.LOAD)
    r.step({load.job_id: ("io_error", (104, 105, 106, 107))})  # chunk 1's blocks
    assert KEYS[0] in r.host and KEYS[1] not in r.host and r.host.pinned_count == 0
    assert r.epoch.value > epoch
    assert r.counters[Count.LOAD_FAILED, "io_error"] == 1
    assert r.counters[Count.CHUNKS_DROPPED_BY_FAILED_LOADS] == 1
    assert r.ask("s") == CHUNK_TOKENS


def test_a_request_whose_load_is_in_flight_gets_no_second_hit():
    r = Rig()
    r.in_host(0)
    r.lookup.on_alloc("r", list(range(100, 120)), r.ask() or 0)
    assert r.requests.get("r").load_job is not None  # type: ignore[union-attr]
    assert r.lookup.lookup("r", KEYS, 0, len(PROMPT) + 1) == 0


def test_remote_chunks_past_host_and_disk_are_probed_on_arrival_then_read_and_verified():
    store = Store()
    for c in (0, 1, 2):  # the probe asks from chunk 0: the remote tier's leading run
        store.put(KEYS[c])
    r = Rig(remote_tier=remote_tier(store))
    r.in_host(0)
    r.lookup.prefetch_remote("r", KEYS, len(PROMPT))  # the request arrived: probe sent
    assert len(store.calls) == 1
    assert r.ask() is None  # the reads into host slots go out now
    plan = r.step()
    assert [job.key for job in plan.of(Move.REMOTE_READ)] == [KEYS[1], KEYS[2]]
    assert r.counters[Count.REMOTE_READ_CHUNKS] == 2
    hit = r.ask()
    assert hit == 3 * CHUNK_TOKENS
    r.lookup.on_alloc("r", list(range(100, 120)), hit)
    assert r.lookup.hit_tokens("r") == {Tier.HOST: CHUNK_TOKENS, Tier.DISK: 0,
                                        Tier.REMOTE: 2 * CHUNK_TOKENS}
    assert len(store.calls) == 1  # one probe served every lookup of the request
