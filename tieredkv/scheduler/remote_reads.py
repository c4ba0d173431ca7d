"""Remote -> host reads, as the lookup uses them: probe, read into host slots, complete.

A lookup whose prefix goes on past host and disk asks :meth:`RemoteReads.probe` how many
leading chunks of the prompt the remote tier holds for every rank (``None``: ask again). The
probe is sent as early as possible, when the request arrives (:meth:`RemoteReads.prefetch`):
a forward pass usually runs before its first lookup, and the answer is waiting by then.
The chunks past the local run are read into host slots like promotions (pinned prefix, one
job per chunk, the key in the lookup's ``promotions`` so that other requests wait for it) and
promised only once every rank verified its shard.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from tieredkv.protocol import JobKind, JobResult, RemoteReadJob
from tieredkv.scheduler.ledger import JobRecord
from tieredkv.scheduler.parts import PlannerParts
from tieredkv.scheduler.placement import Placer, count_evictions
from tieredkv.scheduler.requests import RequestState


class RemoteReads:
    """The remote tier's part of lookups (one scheduler thread)."""

    def __init__(self, parts: PlannerParts, placer: Placer, promotions: dict[bytes, int]) -> None:
        assert parts.remote is not None
        self.remote = parts.remote
        self.host = parts.host
        self.counters = parts.counters
        self.chunk_blocks = parts.config.chunk_blocks
        self.chunk_tokens = parts.block_size * parts.config.chunk_blocks
        self.unit = self.chunk_tokens if parts.layout is not None else parts.block_size
        self.load_timeout_s = parts.config.load_timeout_s
        self._ledger = parts.ledger
        self._placer = placer
        self._promotions = promotions  # shared with the lookup: key -> job in flight

    # ------------------------------------------------------------------ probes

    def prefetch(self, req_id: str, keys: Sequence[bytes], num_tokens: int) -> None:
        """A request arrived: send its probe now (the same keys its lookups will ask about)."""
        limit = (num_tokens - 1) // self.unit * self.unit
        last = min(len(keys), -(-limit // self.chunk_tokens))
        if last > 0:
            materialize = getattr(keys, "materialize", None)
            self.probe(req_id, (materialize(last) if materialize is not None else keys)[:last])

    def probe(self, req_id: str, keys: Sequence[bytes]) -> int | None:
        """Leading ``keys`` every rank holds remotely, or None while the probe is out."""
        return self.remote.poll(req_id, keys)

    def forget(self, req_id: str) -> None:
        self.remote.forget(req_id)

    # ------------------------------------------------------------------ reads

    def issue(
        self, state: RequestState, run: list[bytes], pos: int, first: int,
        request_keys: Sequence[bytes],
    ) -> list[bytes]:
        """Queue remote -> host reads for ``run[pos:]`` (the run starts at chunk ``first``);
        the run is cut where a chunk cannot get a host slot or is held by someone else."""
        C = self.chunk_blocks
        granular = getattr(request_keys, "block_granular", False)
        issued = False
        for offset in range(pos, len(run)):
            key = run[offset]
            if key in self.host or self.host.is_doomed(key) or key in self._promotions:
                run = run[:offset]  # someone else holds it now
                break
            chunk = first + offset
            aliases = request_keys.block_keys(chunk * C, chunk * C + C - 1) if granular else ()  # type: ignore[attr-defined]
            allocation = self.host.allocate(key, aliases)
            if allocation is None:
                self.counters["promote_no_host_slot"] += 1
                run = run[:offset]
                break
            host_slot, evicted = allocation
            count_evictions(self.counters, "host", evicted)
            job_id = self._ledger.issue(JobKind.REMOTE_READ, (key,), state.req_id)
            self._ledger.plan.remote_reads.append(
                RemoteReadJob(job_id, key, host_slot, req_id=state.req_id)
            )
            self._promotions[key] = job_id
            state.promote_jobs.add(job_id)
            state.remote_keys.add(key)
            issued = True
        if issued:
            state.promote_rounds += 1
            state.promote_deadline = time.monotonic() + self.load_timeout_s
        return run

    def complete(self, job: JobRecord, outcome: JobResult) -> None:
        """Every rank reported a read: the chunk is READY in host, or dropped and counted."""
        (key,) = job.keys
        if self._promotions.get(key) == job.job_id:
            del self._promotions[key]
        if outcome.failed:
            self.host.abort(key)
            self.remote.forget_key(key)
            self.counters[f"remote_read_failed_{outcome.failure or 'unknown'}"] += 1
        elif self.host.mark_ready(key):
            self.remote.remember(key)  # no need to write it back
            self.counters["remote_read_chunks"] += 1
            self._placer.settle(self.host, key)
