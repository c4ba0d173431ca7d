"""Where computed chunks go: stores into host, spills to the lower tier, one copy per tier.

* Stores: every whole chunk a request computed that no tier holds yet becomes a host slot
  (WRITING) and a store job; with ``tail``, the full blocks past the last whole chunk too, as
  an entry holding the first blocks of its chunk (hybrid models: a prompt ending on a block
  boundary also one block shorter, where a repeat of it hits). A chunk some tier holds
  already is touched (it is hot) and counted as a sighting instead.
* Spills: a store that completes, or a chunk seen often enough, is queued for the lower tier
  if the tier admits it; :meth:`Placer.plan_spills` gives the queue lower-tier slots when the
  step's plan is taken.
* Remote writes: an entry READY in host is queued for the shared remote tier once admitted
  (``remote_admission``) and not known to be there; :meth:`Placer.plan_remote_writes` turns
  the queue into write jobs, the host copy pinned until every rank copied it out. A prompt's
  tail goes there too: its value holds only its own rows, never the rest of its slot (a
  previous tenant's rows, issue #23); a hybrid model's tail (its rows are not the first
  rows of its slot) as a whole slot's value whose rows the entry does not keep are zeros.
  A tail stays in Redis when a longer entry of its chunk lands: Redis has no aliases, so a
  prompt ending at the tail finds only the tail (its keys stop where it ends), never the
  longer entry (and a hybrid one lacks the tail's window).
* Settle/supersede: an entry that becomes READY drops the shorter entries of its tier whose
  blocks it holds, or is dropped itself when a longer READY entry holds all of its blocks
  (a prompt's tail that grew leaves one copy, not two).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence

from tieredkv.metrics.specs import ADMISSION_REJECTED, Count, Counts
from tieredkv.protocol import FailureCause, Job, JobResult, Move, Tier
from tieredkv.scheduler.ledger import JobRecord, PlannerParts, RequestState
from tieredkv.scheduler.tier_index import Placement, TierIndex


def count_evictions(counters: Counts, tier: str, evicted: Iterable[tuple[bytes, int]]) -> None:
    for _ in evicted:
        counters[Count.EVICTIONS, tier] += 1


class Placer:
    """Plans stores and spills and keeps each tier free of redundant entries."""

    def __init__(self, parts: PlannerParts) -> None:
        self.block_size = parts.block_size
        self.chunk_blocks = parts.config.chunk_blocks
        self.chunk_tokens = parts.block_size * parts.config.chunk_blocks
        self.host = parts.host
        self.lower = parts.lower
        self._requests = parts.requests
        self._ledger = parts.ledger
        self._epoch = parts.epoch
        self.counters = parts.counters
        self.remote = parts.remote
        self.slot_rows = parts.slot_rows  # None: one full-attention group
        self._spill_queue: OrderedDict[bytes, None] = OrderedDict()
        self._remote_queue: OrderedDict[bytes, None] = OrderedDict()
        # Whether keys name blocks (then an entry's aliases say how many blocks it holds);
        # None until the first store says: until then only entries with every alias are whole.
        self._granular: bool | None = None

    # ------------------------------------------------------------------ stores

    def plan_stores(
        self, req_id: str, keys: Sequence[bytes], storable_tokens: int, tail: bool = False,
        computed_tokens: int | None = None,
    ) -> None:
        """Store every full chunk below ``storable_tokens`` not stored yet; with ``tail``, also
        the full blocks after the last full chunk, as an entry holding part of its chunk.

        ``tail`` is for the end of a prompt (and, with ``store_generated``, of a request):
        a tail stored on every step would be stored again each time it grows by a block.

        Hybrid models store a chunk only in the step that computes its end
        (``computed_tokens``: computed before this step): vLLM frees a sliding window's older
        blocks without telling a connector, so a chunk left for later may have lost them.
        """
        state = self._requests.ensure(req_id)
        C = self.chunk_blocks
        host, lower = self.host, self.lower
        n_chunks = min(storable_tokens // self.chunk_tokens, len(keys))
        n_chunks = min(n_chunks, len(state.block_ids) // C)
        granular = getattr(keys, "block_granular", False)
        self._granular = granular
        if self.slot_rows is not None:
            if computed_tokens is None:
                return  # hybrid: only the step that computes a chunk may store it
            state.next_store_chunk = max(state.next_store_chunk, computed_tokens // self.chunk_tokens)
        for chunk in range(state.next_store_chunk, n_chunks):
            key = keys[chunk]
            if key in host or host.is_doomed(key):
                # Another request computed the same prefix: it is hot, keep it resident.
                host.touch(key)
                self.note_seen(key)
                continue
            if lower is not None and key in lower:
                lower.touch(key)
                self.note_seen(key)
                continue
            aliases = keys.block_keys(chunk * C, chunk * C + C - 1) if granular else ()  # type: ignore[attr-defined]
            if self.slot_rows is None:
                self._store(state, key, aliases, state.block_ids[chunk * C : (chunk + 1) * C])
            else:
                rows = self.slot_rows.store_rows(state.tables, chunk)
                self._store(state, key, aliases, rows, self.slot_rows.sliding_blocks(rows))
        state.next_store_chunk = max(state.next_store_chunk, n_chunks)
        if tail and granular and n_chunks == state.next_store_chunk:
            held = min(storable_tokens // self.block_size, len(state.block_ids),
                       keys.num_blocks)  # type: ignore[attr-defined]
            count = held - n_chunks * C
            if self.slot_rows is not None and computed_tokens is not None:
                # First: a full host tier then skips the tail, not the entry a repeat hits.
                self._store_repeat_end(state, keys, storable_tokens, held, computed_tokens)
            # Hybrid: only in the step that computes the tail's end (its window is still there).
            if 0 < count < C and (self.slot_rows is None or (
                    computed_tokens is not None and computed_tokens < held * self.block_size)):
                self._store_tail(state, keys, n_chunks, count)

    def _store_repeat_end(self, state: RequestState, keys, storable_tokens: int, held: int,
                          computed: int) -> None:
        """Hybrid: a prompt ending on a block boundary also stores the entry ending one block
        earlier, where a repeat of it hits (vLLM computes a prompt's last token, so its hit
        stops at ``(num_tokens - 1) // block_size`` blocks; no other stored window ends
        there). Only when this step computed all of the prompt's last block: vLLM frees a
        block once the next token to compute lies a window past it, so none of the window
        before that entry's end is freed yet and every row stored is held."""
        bs, C = self.block_size, self.chunk_blocks
        end = (storable_tokens - 1) // bs  # blocks a repeat of this prompt may hit
        if end < held and end % C and computed <= end * bs:
            self._store_tail(state, keys, end // C, end % C)

    def finish_tail(self, req_id: str, keys: Sequence[bytes], storable_tokens: int) -> None:
        """A request finished normally: store what its last steps computed (generated text
        included, with ``store_generated``) before its blocks are freed. Not for a request
        whose blocks are gone (preempted) or still being loaded into."""
        state = self._requests.get(req_id)
        if state is None or state.load_job is not None or not state.block_ids:
            return
        if self.slot_rows is not None:
            return  # hybrid: a finished request's older sliding blocks may be gone already
        self.plan_stores(req_id, keys, storable_tokens, tail=True)

    def _store_tail(self, state: RequestState, keys, chunk: int, count: int) -> None:
        """Store the first ``count`` blocks of ``chunk`` unless an entry already holds them
        (hybrid: unless this very tail is held; a longer entry lacks its window)."""
        base = chunk * self.chunk_blocks
        key = keys.block_key(base + count - 1)
        aliases = keys.block_keys(base, base + count - 1)
        for tier in (self.host, self.lower):
            if tier is None:
                continue
            if self.held(tier, key) or tier.is_doomed(key):
                # Held already (this prompt's tail stored before, or a longer entry).
                for holder in (tier.holders(key) if self.slot_rows is None else (key,)):
                    tier.touch(holder)
                self.note_seen(key)
                return
        if self.slot_rows is None:
            self._store(state, key, aliases, state.block_ids[base : base + count])
        elif self.lower is None or self.lower.kept_aliases(aliases) == aliases:
            # (A disk copy whose header cannot list the tail's blocks would lose its length.)
            rows = self.slot_rows.store_rows(state.tables, chunk, count)
            self._store(state, key, aliases, rows, self.slot_rows.sliding_blocks(rows))
        else:
            return
        self.counters[Count.STORED_PARTIAL_CHUNKS] += 1

    def held(self, tier: TierIndex, key: bytes) -> bool:
        """Whether ``tier`` holds what an entry keyed ``key`` serves: the block ``key`` names
        (one group); a hybrid model's entry itself (a longer entry of its chunk lacks the
        sliding window before ``key``'s block)."""
        return key in tier if self.slot_rows is not None else tier.holds(key)

    def _store(self, state: RequestState, key: bytes, aliases: tuple[bytes, ...],
               blocks: Sequence[int], sliding: tuple[int, ...] = ()) -> None:
        allocation = self.host.allocate(key, aliases)
        if allocation is None:
            self.counters[Count.STORE_SKIPPED_HOST_FULL] += 1
            return
        slot, evicted = allocation
        count_evictions(self.counters, Tier.HOST, evicted)
        blocks = tuple(blocks)
        job_id = self._ledger.issue(Move.STORE, (key,), state.req_id, chunk_blocks=(blocks,),
                                    sliding=sliding)
        self._ledger.plan.jobs.append(Job.store(job_id, key, slot, blocks, req_id=state.req_id))
        state.store_jobs.add(job_id)
        self.note_seen(key)

    def complete_store(self, job: JobRecord, outcome: JobResult) -> None:
        (key,) = job.keys
        if outcome.failed:
            self.host.abort(key)
            self.counters[Count.STORE_FAILED, outcome.failure or FailureCause.UNKNOWN] += 1
        elif self.host.mark_ready(key):
            self.counters[Count.STORED_CHUNKS] += 1
            lower = self.lower
            if not self.keep_one_copy(self.host, key):
                return
            if lower is not None:
                if lower.admits(key):
                    self._spill_queue[key] = None
                else:
                    self.counters[ADMISSION_REJECTED[lower.name]] += 1
            remote = self.remote
            if remote is not None and remote.writes and self._remote_storable(key):
                if not remote.admits(key):
                    self.counters[Count.REMOTE_ADMISSION_REJECTED] += 1
                elif not remote.holds_hint(key):
                    self._remote_queue[key] = None

    # ------------------------------------------------------------------ spills

    def note_seen(self, key: bytes) -> None:
        """A sighting of ``key``: once a tier admits it, a READY host copy is queued for it."""
        lower = self.lower
        if lower is not None and lower.note_seen(key) and self.host.is_ready(key) and key not in lower:
            self._spill_queue[key] = None
        remote = self.remote
        if (remote is not None and remote.note_seen(key) and self.host.is_ready(key)
                and self._remote_storable(key)):
            self._remote_queue[key] = None

    def _remote_storable(self, key: bytes) -> bool:
        """Whether the host entry ``key`` can go to the remote tier: a whole chunk, or, with
        block-granular keys, a prompt's tail (its value then holds only its own rows, or for
        a hybrid model the whole slot with zeros in the rows it does not keep; lookups probe
        tails by their last block's key).

        With block-granular keys an entry's aliases say how many blocks it holds, and a
        one-block tail has none, just like a whole chunk under keys that are not granular: so
        an entry without every alias is whole only once keys are known not to be granular.
        An entry with no aliases that is not known whole is never written: a one-block tail
        looks like a whole chunk promoted after a restart whose disk header could not keep
        every alias (``chunk_blocks`` above 167), which a one-row value would misname.
        """
        placement = self.host.get(key)
        if placement is None:
            return False
        if placement.blocks == self.chunk_blocks or self._granular is False:
            return True
        return self._granular is True and bool(placement.aliases)

    def _value_rows(self, blocks: int) -> tuple[int, tuple[int, ...]]:
        """``(rows, holes)`` of the remote value of an entry holding ``blocks`` blocks of its
        chunk, as the worker checks them against the slot's rows. One group: the entry's own
        rows (a tail's value holds only those; keys that are not block-granular store no
        tail, so every entry fills its slot). Hybrid: always the whole slot, its rows the
        entry does not keep (a sliding window's rows before its blocks; a tail's rows past
        its end) as ``holes``, which the worker writes as zeros, never as what the slot held
        before (a tail's hybrid value costs a whole chunk's bytes in Redis)."""
        slot_rows, C = self.slot_rows, self.chunk_blocks
        if slot_rows is not None:
            held = blocks if self._granular and blocks < C else None
            return slot_rows.rows, slot_rows.empty_rows(held)
        return (blocks if self._granular else C), ()

    def plan_remote_writes(self) -> None:
        """Turn queued remote writes into jobs (in this step's plan); the host copy is pinned
        until every rank has copied it into its write queue."""
        remote, host = self.remote, self.host
        if remote is None:
            self._remote_queue.clear()
            return
        for key, placement in self._take_queued(
                self._remote_queue,
                lambda k: remote.holds_hint(k) or not self._remote_storable(k)):
            host.pin(key)
            remote.remember(key)  # one write per chunk, even before the ranks report
            job_id = self._ledger.issue(Move.REMOTE_WRITE, (key,), None)
            rows, holes = self._value_rows(placement.blocks)
            # One group: the shorter tails of its chunk this engine's hints hold (it wrote,
            # read or probed them, recently) become pointers to it: no command for a tail never written
            # (a one-block tail never is). Hybrid: each tail keeps its own window.
            supersedes = tuple(k for k in placement.aliases[1:] if remote.holds_hint(k)) if (
                self.slot_rows is None) else ()
            self._ledger.plan.jobs.append(Job.remote_write(
                job_id, key, placement.slot, rows=rows, holes=holes, supersedes=supersedes))

    def complete_remote_write(self, job: JobRecord, outcome: JobResult) -> None:
        (key,) = job.keys
        self.host.unpin(key)
        remote = self.remote
        assert remote is not None
        if not outcome.failed:
            self.counters[Count.REMOTE_WRITTEN_CHUNKS] += 1
            listener = self.host.listener  # KV events: the shared tier holds it now
            if listener is not None:
                listener.entry_ready(Tier.REMOTE, key, ())
            return
        remote.forget_key(key)  # not (all) there: a later sighting may write it again
        if outcome.failure == FailureCause.DROPPED:
            self.counters[Count.REMOTE_WRITES_DROPPED] += 1
        else:
            self.counters[Count.REMOTE_WRITE_FAILED] += 1

    def plan_spills(self) -> None:
        """Give the queued spills their lower-tier slots (in this step's plan)."""
        lower, host = self.lower, self.host
        if lower is None:
            self._spill_queue.clear()
            return
        # Not when there already (or a longer entry there holds its blocks).
        for key, placement in self._take_queued(
                self._spill_queue, lambda k: self.held(lower, k) or lower.is_doomed(k)):
            allocation = lower.allocate(key, placement.aliases)
            if allocation is None:
                self.counters[Count.SPILL_SKIPPED_DISK_FULL] += 1  # the tier spilled into
                continue
            lower_slot, evicted = allocation
            count_evictions(self.counters, lower.name, evicted)
            host.pin(key)
            job_id = self._ledger.issue(Move.SPILL, (key,), None)
            # The written copy lists the entry's block keys, so a restart finds them again
            # (beyond what the tier keeps, only the entry's own key survives it).
            self._ledger.plan.jobs.append(Job.spill(
                job_id, key, placement.slot, lower_slot,
                aliases=lower.kept_aliases(placement.aliases)))

    def _take_queued(
        self, queue: OrderedDict[bytes, None], skip: Callable[[bytes], bool]
    ) -> Iterator[tuple[bytes, Placement]]:
        """Empty ``queue``, oldest first: each key still READY in host that ``skip`` lets
        through, with its host entry (a queued key may have gone, or got there, meanwhile)."""
        host = self.host
        while queue:
            key, _ = queue.popitem(last=False)
            if host.is_ready(key) and not skip(key):
                placement = host.get(key)
                assert placement is not None
                yield key, placement

    def complete_spill(self, job: JobRecord, outcome: JobResult) -> None:
        (key,) = job.keys
        self.host.unpin(key)
        lower = self.lower
        assert lower is not None
        if outcome.failed:
            lower.abort(key)
            self.counters[Count.SPILL_FAILED, outcome.failure or FailureCause.UNKNOWN] += 1
            return
        if lower.mark_ready(key):
            self.counters[Count.SPILLED_CHUNKS] += 1
            if self.slot_rows is None and lower.covering(key):
                # A longer entry got there first: this one is redundant there.
                lower.remove(key, recorded=False)
                self.counters[Count.SUPERSEDED, lower.name] += 1
                return
            lower.record_written(key)
            self.keep_one_copy(lower, key)

    def clear_spill_queue(self) -> None:
        self._spill_queue.clear()
        self._remote_queue.clear()

    @property
    def spills_queued(self) -> bool:
        return bool(self._spill_queue or self._remote_queue)

    # ------------------------------------------------------------------ one copy per tier

    def keep_one_copy(self, tier: TierIndex, key: bytes) -> bool:
        """``key`` just became READY in ``tier``: keep one copy of its blocks in this tier.

        A longer READY entry holding all of its blocks makes it redundant (dropped, False);
        otherwise the shorter entries whose blocks it holds are dropped (a prompt's tail that
        grew: the next turn of a chat stored the whole chunk or a longer tail). A dropped
        entry still being read keeps its slot until the read ends (doomed). True: kept.
        Hybrid models keep every entry: a longer one lacks a shorter one's sliding window.
        """
        if self.slot_rows is not None:
            return True
        if tier.covering(key):
            self._drop_superseded(tier, key)
            return False
        placement = tier.get(key)
        if placement is not None:
            for alias in placement.aliases:
                if alias in tier:
                    self._drop_superseded(tier, alias)
        return True

    def _drop_superseded(self, tier: TierIndex, key: bytes) -> None:
        placement = tier.get(key)
        if placement is None:
            return
        tier.remove(key)
        if tier is self.host:
            if placement.pins:
                self._epoch.bump()  # a cached pending hit may name it: recompute that hit
            self.counters[Count.SUPERSEDED, Tier.HOST] += 1
        else:
            self.counters[Count.SUPERSEDED, tier.name] += 1
