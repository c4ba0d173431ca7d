"""A lookup's remote part: what the shared tier adds past host and disk.

The probe of a prompt's chunks (and of the tail of its partial chunk) is sent when the request
arrives (:meth:`RemoteHits.prefetch`) and answered without waiting; a lookup asks for the
answer (:meth:`RemoteHits.probe`). A request waits for it only while the cost model says the
hit could still save more than the wait costs, and never when host or disk already hold every
block a remote tail could add. Kept apart from :mod:`~tieredkv.scheduler.lookup` so that a
lookup without a remote tier runs none of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from tieredkv.metrics.specs import Count
from tieredkv.protocol import Tier
from tieredkv.scheduler.ledger import PlannerParts, RequestState
from tieredkv.scheduler.remote_tier import INNER_TAIL, RemoteTier, tail_keys

# ``(chunks past i, tail)``: the remote tier's whole chunks this hit reads, and the tail of the
# chunk after them it holds as ``(key, blocks)`` (None: none that serves).
Found = tuple[list[bytes], tuple[bytes, int] | None]


class RemoteHits:
    """The remote tier's share of one lookup (a planner's lookups all use one)."""

    def __init__(
        self, parts: PlannerParts, remote: RemoteTier,
        usable_blocks: Callable[..., Any], partial: Callable[..., Any],
    ) -> None:
        self.remote = remote
        self.block_size = parts.block_size
        self.chunk_blocks = parts.config.chunk_blocks
        self.chunk_tokens = parts.block_size * parts.config.chunk_blocks
        self.load_timeout_s = parts.config.load_timeout_s
        self.slot_rows = parts.slot_rows  # None: one full-attention group
        self.unit = self.chunk_tokens if parts.slot_rows is not None else parts.block_size
        self.host, self.lower = parts.host, parts.lower
        self._cost = parts.cost
        self._counters = parts.counters
        # Probes a request stopped waiting for: (probe id, how many chunk keys it asked, its
        # tail, chunks before the remote part). A decline is counted once the answer shows the
        # tier held more: a request the tier had nothing for declined no hit (a cold prompt
        # while Redis is slow).
        self._unanswered: dict[str, list[tuple[str, int, tuple[bytes, ...], int]]] = {}
        # The lookup's own partial-chunk search (``Fill.usable_blocks`` and its partial source).
        self._usable_blocks, self._partial = usable_blocks, partial

    def prefetch(self, req_id: str, keys: Sequence[bytes], num_tokens: int) -> None:
        """A request arrived: send its remote probe now (the keys its lookups will ask about)."""
        limit = (num_tokens - 1) // self.unit * self.unit
        block_limit = (num_tokens - 1) // self.block_size * self.block_size
        last = min(len(keys), -(-limit // self.chunk_tokens))
        tail = (self._tail_keys(keys, last, block_limit, 0)
                if limit // self.chunk_tokens == last else ())
        if last > 0 or tail:
            materialize = getattr(keys, "materialize", None)
            chunks = (materialize(last) if materialize is not None else keys)[:last]
            self.remote.poll(req_id, chunks, tail)

    def probe(
        self, state: RequestState, keys: Sequence[bytes], i: int, last: int, limit: int,
        block_limit: int, num_computed_tokens: int,
    ) -> Found | None:
        """What the remote tier adds to a run of host and disk chunks ending at chunk ``i``
        (of ``last`` whole chunks the hit may cover); None while the answer is worth waiting
        for (ask again: nothing is pinned). Once answered, the request is not probed again."""
        req_id = state.req_id
        tail: tuple[bytes, ...] = ()
        if limit // self.chunk_tokens == last:  # the prompt's limit lies in the next chunk
            tail = self._tail_keys(keys, last, block_limit, num_computed_tokens)
        if tail and i == last and self._held_here(keys, block_limit):
            tail = ()  # host or disk holds every block a hit could use: nothing to ask
        if not (i < last or tail):
            return [], None
        materialize = getattr(keys, "materialize", None)
        chunk_keys = materialize(last) if materialize is not None else keys
        # The probe asks from chunk 0 (as ``prefetch`` did, when the request arrived): its
        # answer is the remote tier's leading run; past i it extends ours.
        found = self.remote.poll(req_id, chunk_keys[:last], tail)
        # What it could save: up to the tail's end (a hybrid tail reads a whole slot), past
        # what is computed or served here already.
        reads = last - i + bool(tail and self.slot_rows is not None)
        if found is None and self._cost is not None and not self._cost.may_wait_for_probe(
                req_id, Tier.REMOTE,
                block_limit - self._served(keys, i, last, num_computed_tokens, block_limit), reads):
            self._unanswered.setdefault(req_id, []).append(
                (req_id, min(last, len(chunk_keys)), tail, i))
            found = i  # waited longer than a remote hit could save: compute the rest
            tail = ()
        if found is None:
            if not state.promote_deadline:
                state.promote_deadline = time.monotonic() + self.load_timeout_s
            return None
        chunks = list(chunk_keys[i:max(i, found)])
        end = i + len(chunks)
        remote_tail: tuple[bytes, int] | None = None
        if tail and end == last:
            remote_tail = self.remote.found_tail(req_id, tail)
        elif i < end < last:
            # Redis's run ends before the prompt's last whole chunk: a tail of chunk ``end``
            # (where an earlier, shorter prompt ended: a chat's previous turn on another
            # replica) may be there. One more call, once the first answered, only when Redis
            # held chunks past host and disk (they are read anyway): a cold miss, or a prefix
            # host or disk serve, never waits a second round trip.
            inner = self._tail_keys(keys, end, block_limit, num_computed_tokens)
            longest = min(block_limit, (end + 1) * self.chunk_tokens - self.block_size)
            if inner and not self._held_here(keys, longest):
                tail_id = req_id + INNER_TAIL
                if self.remote.poll(tail_id, chunk_keys[:end], inner) is None:
                    if self._cost is None or self._cost.may_wait_for_probe(
                            req_id, Tier.REMOTE, len(inner) * self.block_size, 1):
                        return None
                    self._unanswered.setdefault(req_id, []).append((tail_id, end, inner, end))
                else:
                    remote_tail = self.remote.found_tail(tail_id, inner)
                    self.remote.forget(tail_id)
        state.remote_done = True
        unsettled = {probe_id for probe_id, *_ in self._unanswered.get(req_id, ())}
        for probe_id in (req_id, req_id + INNER_TAIL):  # the answers settle() needs stay
            if probe_id not in unsettled:
                self.remote.probe.forget(probe_id)
        return chunks, remote_tail

    def settle(self, req_id: str) -> None:
        """The request finished: a probe it stopped waiting for counts as a declined hit (once
        per request, resumed lookups included) if its answer, come by now, shows the tier held
        more than was served."""
        for probe_id, asked, tail, served in self._unanswered.pop(req_id, ()):
            answer = self.remote.probe.answered(probe_id)  # never a new probe
            if answer is None:
                continue
            held, tail_blocks = min(answer[0], asked), answer[1]
            if held > served or (tail and tail_blocks and held == asked):
                self._counters[Count.HITS_DECLINED_PROBE_WAIT, Tier.REMOTE] += 1
                return

    def usable_tail(
        self, tail: tuple[bytes, int], chunk: int, block_limit: int, num_computed_tokens: int,
        partial_blocks: int,
    ) -> tuple[bytes, int] | None:
        """The remote tail found in ``chunk``, when it serves more than the partial entry host
        or disk hold there; a hybrid one only ending at its own end, past what was computed."""
        usable = block_limit // self.block_size - chunk * self.chunk_blocks
        if self.slot_rows is not None and (
                tail[1] > usable
                or (chunk * self.chunk_blocks + tail[1]) * self.block_size <= num_computed_tokens):
            return None
        return tail if min(tail[1], usable) > partial_blocks else None

    def _served(self, keys, i: int, last: int, num_computed_tokens: int, block_limit: int) -> int:
        """Tokens a remote hit could not add to: those computed, the whole chunks before ``i``
        and, when only a tail can come from Redis (``i == last``), the blocks of chunk ``i`` an
        entry here holds (asked only while a probe is out)."""
        served = max(i * self.chunk_tokens, num_computed_tokens)
        if i == last and getattr(keys, "block_granular", False):
            span = self._usable_blocks(keys, i, num_computed_tokens, block_limit)
            held = self._partial(keys, span) if span is not None else None
            if held is not None:
                served = max(served, (i * self.chunk_blocks + held[2]) * self.block_size)
        return served

    def _tail_keys(self, keys: Any, chunk: int, limit: int, computed: int) -> tuple[bytes, ...]:
        """Where the remote tier may hold a tail of ``chunk`` that a hit ending by ``limit``
        (a block boundary) can use (:func:`tail_keys`; hybrid: those ending by ``limit``)."""
        return tail_keys(keys, chunk, limit, computed, self.chunk_blocks, self.block_size,
                         one_past=self.slot_rows is None)

    def _held_here(self, keys: Any, end_token: int) -> bool:
        """Whether host or the lower tier holds the last block a hit ending by ``end_token``
        could use (then its partial entry serves every block a remote tail could). Hybrid:
        the entry ending exactly there (a longer one lacks the window before that end)."""
        block = min(end_token, keys.num_blocks * self.block_size) // self.block_size - 1
        if block < 0:
            return False
        key = keys.block_key(block)
        if self.slot_rows is not None:
            blocks = block % self.chunk_blocks + 1
            return any(tier is not None and tier.is_ready(key)
                       and getattr(tier.get(key), "blocks", 0) == blocks
                       for tier in (self.host, self.lower))
        if self.host.ready_holder(key) is not None:
            return True
        lower = self.lower
        return lower is not None and lower.holds(key)
