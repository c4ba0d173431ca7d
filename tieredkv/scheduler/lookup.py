"""Lookups: a prompt's chunk keys -> a hit of READY host chunks, or a round of promotions.

* Only ``READY`` host chunks are promised. Chunks of the lower tier are first promoted into
  host slots (verified by checksum on the worker) while the lookup answers ``None``.
* Past host and disk, the shared remote tier is probed without waiting (``None`` meanwhile,
  up to ``remote_timeout_s``; the probe is sent when the request arrives,
  :meth:`Lookup.prefetch_remote`, so its answer usually waits for the first lookup); the
  whole chunks every rank holds there are read into host slots and verified on the workers,
  like promotions, before they are promised. Promotions and remote reads are one fill path
  (:class:`~tieredkv.scheduler.lower_tier.Fill`).
* A hit ends at the last block held, not at a chunk boundary: an entry holds the first ``n``
  blocks of one chunk and is found by the key of any block it holds (see ``TierIndex``).
  Hybrid models: a hit ends on a chunk boundary or exactly at a prompt's tail's end (an
  entry's sliding-window rows are the window before its end, :class:`SlotRows`).
* The promised chunks stay pinned until vLLM allocates device blocks (:meth:`Lookup.on_alloc`
  turns them into a load job) or the hit is let go; every chunk a load reads stays pinned
  until every rank reported the load, and a chunk whose load failed is dropped.
* Allocation failure is a miss, never a wait; promotion is given up after
  ``MAX_PROMOTE_ROUNDS`` rounds or ``load_timeout_s``, serving what is in host memory.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from tieredkv.metrics.specs import Count
from tieredkv.protocol import NO_BLOCK, FailureCause, Job, JobResult, LoadChunk, Move, Tier
from tieredkv.scheduler.ledger import JobRecord, PendingHit, PlannerParts, RequestState
from tieredkv.scheduler.lower_tier import LOWER, PENDING, Fill
from tieredkv.scheduler.placement import Placer
from tieredkv.scheduler.remote_hits import RemoteHits

# Lookup.lookup counts these on every request's first answer: set by dict's own method (Counts'
# checked one costs a Python frame), the members bound here once (an enum member's attribute
# read costs five times a global's on Python 3.11).
_set_count = dict.__setitem__
_LOOKUPS, _LOOKUP_TOKENS = Count.LOOKUPS, Count.LOOKUP_TOKENS

logger = logging.getLogger(__name__)

MAX_PROMOTE_ROUNDS = 3
# The hit source reported (always 0 tokens) without a lower tier: the sources stay the same.
NO_LOWER_TIER = Tier.DISK


class Lookup:
    """Answers lookups (lower-tier chunks of a hit filled into host first, by the fill path)
    and turns hits into load jobs."""

    def __init__(self, parts: PlannerParts, placer: Placer, fill: Fill) -> None:
        config = parts.config
        self.block_size = parts.block_size
        self.chunk_blocks = config.chunk_blocks
        self.chunk_tokens = parts.block_size * config.chunk_blocks
        self.load_timeout_s = config.load_timeout_s
        self.host = parts.host
        self.lower = parts.lower
        self._lower_name = parts.lower.name if parts.lower is not None else NO_LOWER_TIER
        self._requests = parts.requests
        self._ledger = parts.ledger
        self._epoch = parts.epoch
        self.counters = parts.counters
        self._placer = placer
        self.remote = parts.remote
        self.slot_rows = parts.slot_rows  # None: one full-attention group
        # A hit never covers the last token; hybrid models' hits end on a chunk boundary or
        # exactly at a stored prompt's end (the windows a sliding group stores end there).
        self.unit = self.chunk_tokens if parts.slot_rows is not None else parts.block_size
        self._fill = fill
        # Where a hit may go on into a partial chunk: any entry's leading blocks, or for a
        # hybrid model only a stored prompt's own end.
        # (Both take the span of blocks ``fill.usable_blocks`` found some tier may serve.)
        self._partial = fill.partial_source if parts.slot_rows is None else fill.tail_entry
        self._usable_blocks = fill.usable_blocks
        self._cost = parts.cost  # None: every lower-tier hit is taken
        self._in_flight = fill.in_flight  # read only: the fill path owns it
        # The remote tier's share of a lookup; None without one.
        self.remote_hits = (RemoteHits(parts, parts.remote, fill.usable_blocks, self._partial)
                            if parts.remote is not None else None)

    def prefetch_remote(self, req_id: str, keys: Sequence[bytes], num_tokens: int) -> None:
        """A request arrived: send its remote probe now (:meth:`RemoteHits.prefetch`)."""
        if self.remote_hits is not None:
            self.remote_hits.prefetch(req_id, keys, num_tokens)

    # ------------------------------------------------------------------ lookups

    def lookup(
        self, req_id: str, keys: Sequence[bytes], num_computed_tokens: int, num_tokens: int
    ) -> int | None:
        """Tokens beyond ``num_computed_tokens`` that can be loaded from the host tier.

        Returns None while lower-tier chunks of the hit are being promoted into host slots.
        Pins the promised host chunks until :meth:`on_alloc` turns them into a load (or they
        are let go).
        """
        state = self._requests.ensure(req_id)
        cached = state.pending_hit
        if (
            cached is not None
            and cached.epoch == self._epoch.value
            and cached.start_token == num_computed_tokens
            and cached.num_tokens == num_tokens
        ):
            # Asked again in the same state: the pinned chunks cannot have gone anywhere.
            return cached.end_token - num_computed_tokens
        if cached is not None:
            self.release_hit(state)
        if state.load_job is not None:
            return 0
        stamp = state.miss_stamp
        if stamp:
            if stamp == self._miss_stamp(keys, num_computed_tokens, num_tokens):
                return 0  # asked again, nothing arrived in any tier since: still a miss
            state.miss_stamp = ()  # missed before: a miss now is stamped again
        block_limit = (num_tokens - 1) // self.block_size * self.block_size  # a tail's limit
        if num_computed_tokens >= block_limit:  # vLLM holds every block a hit could end in
            if not state.looked_up:  # counted, as any first answer (no tokens to look up)
                state.looked_up = True
                _set_count(self.counters, _LOOKUPS, self.counters[_LOOKUPS] + 1)
            return 0
        unit = self.unit
        limit = (num_tokens - 1) // unit * unit
        first = num_computed_tokens // self.chunk_tokens
        host_ready = self.host.is_ready
        lower_ready = self.lower.is_ready if self.lower is not None else None
        lower_chunks: list[bytes] = []
        pending = False
        last = min(len(keys), -(-limit // self.chunk_tokens))
        if state.hit_chunk_limit is not None:
            last = min(last, state.hit_chunk_limit)
        request_keys = keys  # the keys object (block keys too); ``keys`` may become its list
        materialize = getattr(keys, "materialize", None)
        head = materialize(first + 1) if materialize is not None and first < last else keys
        if first < last and host_ready(head[first]):  # one key derived to tell a miss
            # A hit: derive the keys in one batch, then scan the resident run in one loop.
            if materialize is not None:
                keys = materialize(last)
            resident = self.host.ready_prefix(keys, first, last)
            run = list(keys[first : first + resident])
        else:
            run = []
        i = first + len(run)
        in_flight = self._in_flight
        while i < last:
            key = keys[i]
            if host_ready(key):
                run.append(key)
            elif key in in_flight:
                # Being promoted, for this request or another one sharing the prefix: wait.
                pending = True
                run.append(key)
            elif self.host.present(key):
                break  # being stored right now: not loadable yet, and not promotable
            elif lower_ready is not None and lower_ready(key):
                lower_chunks.append(key)
                run.append(key)
            else:
                break
            i += 1
        # Past host and disk: the whole chunks the remote tier holds for every rank, and the
        # longest tail it holds of the partial chunk after them (remote_hits.py).
        remote_chunks: list[bytes] = []
        remote_pos = len(run)
        remote_tail: tuple[bytes, int] | None = None
        if self.remote_hits is not None and not state.remote_done:
            found_remote = self.remote_hits.probe(
                state, request_keys, i, last, limit, block_limit, num_computed_tokens)
            if found_remote is None:
                return None  # the probe is in flight: ask again (nothing is pinned)
            remote_chunks, remote_tail = found_remote
            run.extend(remote_chunks)
        # The run of whole chunks ends at chunk i: the hit may go on into chunk i, up to the
        # last of its blocks some entry holds (this prompt's tail, or a chunk of another
        # prompt sharing these blocks).
        partial_key: bytes | None = None
        partial_blocks = 0
        if (not remote_chunks and i * self.chunk_tokens < block_limit
                and (state.hit_chunk_limit is None or i < state.hit_chunk_limit)
                and getattr(request_keys, "block_granular", False)):
            span = self._usable_blocks(request_keys, i, num_computed_tokens, block_limit)
            found = self._partial(request_keys, span) if span is not None else None
            if found is not None:
                partial_key, kind, partial_blocks = found
                run.append(partial_key)
                if kind == LOWER:
                    lower_chunks.append(partial_key)
                elif kind == PENDING:
                    pending = True
        if remote_tail is not None:
            assert self.remote_hits is not None
            remote_tail = self.remote_hits.usable_tail(
                remote_tail, i + len(remote_chunks), block_limit, num_computed_tokens, partial_blocks)
        if remote_tail is not None:
            if partial_key is not None:  # a shorter tail here: the remote one serves more
                run.pop()
                if lower_chunks and lower_chunks[-1] == partial_key:
                    lower_chunks.pop()
            partial_key, partial_blocks = remote_tail
            run.append(partial_key)
            remote_chunks.append(partial_key)
        if self._cost is not None and (lower_chunks or remote_chunks):
            # Weighed against recomputing up to where the hit would end: a tail's own end (a
            # hybrid one may pass limit), not its chunk's, which could make a slow read pay.
            run_end = (min(((first + len(run) - 1) * self.chunk_blocks + partial_blocks)
                           * self.block_size, block_limit) if partial_key is not None else limit)
            run, lower_chunks, remote_chunks, partial_key = self._affordable(
                state, run, lower_chunks, remote_chunks, partial_key, first,
                num_computed_tokens, run_end, request_keys)
        timed_out = False
        settled = not (state.promote_deadline or lower_chunks or pending or remote_chunks) and (
            self.remote_hits is None or state.remote_done)  # nothing read, nothing may still come
        if state.promote_deadline or lower_chunks or pending or remote_chunks:
            now = time.monotonic()
            timed_out = bool(state.promote_deadline) and now > state.promote_deadline
            if timed_out and (pending or lower_chunks or remote_chunks):
                logger.warning("tieredkv: promotion for %s timed out; serving what is in memory",
                               req_id)
                state.promote_rounds = MAX_PROMOTE_ROUNDS
            if (lower_chunks or remote_chunks) and state.promote_rounds < MAX_PROMOTE_ROUNDS:
                run = self._fill.fill_run(state, run, lower_chunks, remote_chunks, remote_pos,
                                          first, request_keys)
            if not timed_out and any(key in in_flight for key in run):
                if not state.promote_deadline:
                    state.promote_deadline = now + self.load_timeout_s
                return None
        if not state.looked_up:
            # Counted once per request, when it gets its answer (not each "ask me later").
            state.looked_up = True
            # Two declared counts on every request's first answer, set by dict's own method:
            # Counts' checked one costs a Python frame each on vLLM's hottest call, and these
            # keys are members of the declared enum (an undeclared one is read, and raises,
            # first).
            counters = self.counters
            _set_count(counters, _LOOKUPS, counters[_LOOKUPS] + 1)
            _set_count(counters, _LOOKUP_TOKENS, counters[_LOOKUP_TOKENS]
                       + max(0, block_limit - num_computed_tokens))
        if lower_chunks or pending or remote_chunks:
            # Only the leading READY host chunks can be promised.
            ready: list[bytes] = []
            for key in run:
                if not host_ready(key):
                    break
                ready.append(key)
        else:
            ready = run
        partial = partial_key is not None and bool(ready) and ready[-1] == partial_key
        if partial:
            end_block = (first + len(ready) - 1) * self.chunk_blocks + partial_blocks
        else:
            end_block = (first + len(ready)) * self.chunk_blocks
        end = min(end_block * self.block_size, block_limit if partial else limit)
        hit = max(0, end - num_computed_tokens)
        if hit == 0:
            if settled:
                # Stamped from the second miss on: most requests are asked once and scheduled
                # (the stamp would be wasted), one asked twice is waiting and asked each step.
                state.miss_stamp = (() if stamp is None else
                                    self._miss_stamp(request_keys, num_computed_tokens, num_tokens))
            return 0
        self.host.pin_all(ready)
        filled = state.filled
        state.pending_hit = PendingHit(
            num_computed_tokens, end, first, ready,
            sources={key: filled[key] for key in ready if key in filled} if filled else {},
            num_tokens=num_tokens, epoch=self._epoch.value, partial=partial,
            partial_blocks=partial_blocks if partial else 0,
        )
        return hit

    def _miss_stamp(self, keys, num_computed_tokens: int, num_tokens: int) -> tuple:
        """What a miss depends on: the request's position and length, its newest block hash
        (a streaming session replaces them in place) and the changes in host and the tier
        below so far (``TierIndex.changes``: an entry arrived, which a fill for another
        request does too, or a removed one that hid a copy below it let go of its slot)."""
        hashes = getattr(keys, "block_hashes", keys)
        lower = self.lower
        return (num_computed_tokens, num_tokens, hashes[-1] if hashes else None,
                self.host.changes + (lower.changes if lower is not None else 0))

    def _affordable(
        self, state: RequestState, run: list[bytes], lower_chunks: list[bytes],
        remote_chunks: list[bytes], partial_key: bytes | None, first: int,
        num_computed_tokens: int, limit: int, request_keys: Sequence[bytes],
    ) -> tuple[list[bytes], list[bytes], list[bytes], bytes | None]:
        """The run cut before a tier's chunks whose read the cost model predicts slower than
        recomputing them (remote first: it lies past disk), and what is left of each list. A
        declined tier due to be measured again gets one chunk read in the background, which
        the request does not wait for: exploring never makes a request slower than a miss."""
        assert self._cost is not None
        keep = self._cost.affordable(
            state.req_id, run,
            ((Tier.REMOTE, set(remote_chunks)), (self._lower_name, set(lower_chunks))),
            first, num_computed_tokens, limit)
        if keep == len(run):
            return run, lower_chunks, remote_chunks, partial_key
        for name in self._cost.take_explorations():
            tier, chunks = ((self.remote, remote_chunks) if name == Tier.REMOTE
                            else (self.lower, lower_chunks))
            cut = [key for key in chunks if key in run[keep:]]
            if tier is not None and cut:
                self._fill.plan(state, tier, run, {cut[0]}, first, request_keys, background=True)
        run = run[:keep]
        kept = set(run)
        return (run, [k for k in lower_chunks if k in kept], [k for k in remote_chunks if k in kept],
                partial_key if partial_key in kept else None)

    # ------------------------------------------------------------------ hits -> loads

    def release_hit(self, state: RequestState) -> None:
        hit = state.pending_hit
        if hit is None:
            return
        for key in hit.keys:
            self.host.unpin(key)
        state.pending_hit = None

    def on_alloc(self, req_id: str, block_ids: Sequence[Any], num_external_tokens: int,
                 sync: bool = False) -> None:
        """vLLM allocated device blocks (hybrid: one list per group): the hit -> a load job
        (``sync``: copied before the forward of this step, which schedules the request)."""
        state = self._requests.ensure(req_id)
        if self.slot_rows is None:
            state.block_ids = list(block_ids)
        else:
            state.set_tables([list(ids) for ids in block_ids])
        hit = state.pending_hit
        if hit is None or num_external_tokens <= 0:
            self.release_hit(state)
            return
        state.pending_hit = None
        C = self.chunk_blocks
        start_block = hit.start_token // self.block_size
        end_block = (hit.start_token + num_external_tokens) // self.block_size
        chunks: list[LoadChunk] = []
        spans: list[int] = []  # blocks of the hit each chunk covers
        keep: list[bytes] = []
        unserved: list[int] = []  # real blocks of the range no stored row fills
        unserved_chunk: int | None = None
        for offset, key in enumerate(hit.keys):
            chunk = hit.first_chunk + offset
            lo = max(chunk * C, start_block)
            hi = min((chunk + 1) * C, end_block)
            if lo >= hi:
                self.host.unpin(key)
                continue
            keep.append(key)
            placement = self.host.get(key)
            assert placement is not None
            # Hybrid: a partial hit's last entry is a tail of exactly partial_blocks blocks.
            n = hit.partial_blocks if hit.partial and key == hit.keys[-1] else 0
            chunks.append(self._load_chunk(key, placement.slot, state, chunk, lo, hi, n))
            spans.append(hi - lo)
            holes = (self.slot_rows.unserved(state.tables, chunk, lo, hi, n or None)
                     if self.slot_rows else [])
            if holes and unserved_chunk is None:
                unserved_chunk = chunk
            unserved.extend(holes)
        if not chunks:
            return
        served = unserved_chunk is None
        if served and hit.partial and keep[-1] == hit.keys[-1]:
            self.counters[Count.PARTIAL_HITS] += 1  # a hit that ended inside a chunk
        chunk_blocks = tuple(tuple(b for b in c.block_ids if b != NO_BLOCK) for c in chunks)
        if not served:
            # vLLM kept more of a window than a hit needs (no vLLM 0.32 path is known to):
            # those blocks would stay unwritten. The load is failed on every rank without a
            # copy, so vLLM recomputes the request, and its later hits end before that chunk
            # (the same hit would fail again). The chunks are sound and stay: no block of
            # theirs is named to the ledger.
            logger.error("tieredkv: load for %s would leave blocks %s unwritten (a sliding "
                         "window wider than stored): failed, to be recomputed", req_id, unserved)
            self.counters[Count.LOAD_ROWS_UNSERVED] += len(unserved)
            state.hit_chunk_limit = unserved_chunk
            chunk_blocks = tuple(() for _ in chunks)
        job_id = self._ledger.issue(Move.LOAD, tuple(keep), req_id, chunk_blocks=chunk_blocks)
        self._ledger.plan.jobs.append(
            Job.load(job_id, req_id, tuple(chunks), unserved=not served, sync=sync)
        )
        state.load_job = job_id
        tokens = end_block * self.block_size - hit.start_token
        filled: Counter[str] = Counter()  # blocks of the hit by the tier they were filled from
        if hit.sources:
            for key, span in zip(keep, spans, strict=True):
                if key in hit.sources:
                    filled[hit.sources[key]] += span
        lower_tokens = filled[self._lower_name] * self.block_size
        remote_tokens = filled[Tier.REMOTE] * self.block_size if self.remote is not None else 0
        host_tokens = tokens - lower_tokens - remote_tokens
        # vLLM's own stats take the split whatever happens to the load (it must sum to the hit).
        state.hit_tokens = {self._lower_name: lower_tokens, Tier.HOST: host_tokens}
        if self.remote is not None:
            state.hit_tokens[Tier.REMOTE] = remote_tokens
        if served:
            # A load known now to fail loads nothing: its tokens are recomputed, not hits
            # (load_rows_unserved and the worker's load_failed count it).
            if self.remote is not None:
                self.counters[Count.HIT_TOKENS, Tier.REMOTE] += remote_tokens
            self.counters[Count.HIT_TOKENS, Tier.HOST] += host_tokens
            self.counters[Count.HIT_TOKENS, self._lower_name] += lower_tokens
        for key in keep:
            self.host.touch(key)
            self._placer.note_seen(key)

    def _load_chunk(
        self, key: bytes, slot: int, state: RequestState, chunk: int, lo: int, hi: int,
        blocks: int = 0,
    ) -> LoadChunk:
        """Blocks ``[lo, hi)`` of ``chunk`` from host slot ``slot`` (hybrid: every group's, of
        an entry of ``blocks`` blocks; 0: whole)."""
        slot_rows = self.slot_rows
        if slot_rows is None:
            C = self.chunk_blocks
            return LoadChunk(key, slot, lo - chunk * C, tuple(state.block_ids[lo:hi]))
        return LoadChunk(key, slot, 0, slot_rows.load_rows(state.tables, chunk, lo, hi, blocks or None))

    def hit_tokens(self, req_id: str) -> dict[str, int]:
        state = self._requests.get(req_id)
        return dict(state.hit_tokens) if state else {}

    def complete_load(self, job: JobRecord, outcome: JobResult) -> None:
        failed_blocks = set(outcome.failed_block_ids)
        if outcome.failed:
            self.counters[Count.LOAD_FAILED, outcome.failure or FailureCause.UNKNOWN] += 1  # per load
        for key, blocks in zip(job.keys, job.chunk_blocks, strict=True):
            self.host.unpin(key)
            if outcome.failed and failed_blocks.intersection(blocks):
                self.host.remove(key)
                self._epoch.bump()
                self.counters[Count.CHUNKS_DROPPED_BY_FAILED_LOADS] += 1
