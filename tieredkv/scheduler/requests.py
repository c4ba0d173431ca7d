"""What the planner remembers per request, and the epoch that invalidates cached hits."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class PendingHit:
    """A lookup's answer, its host chunks pinned until vLLM allocates blocks for it."""

    start_token: int
    end_token: int
    first_chunk: int
    keys: list[bytes]  # pinned host keys, chunk first_chunk + i
    # Those filled from a tier below host for this request -> that tier's name.
    sources: dict[bytes, str] = field(default_factory=dict)
    num_tokens: int = 0
    epoch: int = 0
    partial: bool = False  # the last key holds only part of its chunk's blocks for this hit


@dataclass
class RequestState:
    req_id: str
    block_ids: list[int] = field(default_factory=list)  # group 0's device blocks
    # Hybrid models: every KV-cache group's device blocks (group_ids[0] is block_ids).
    group_ids: list[list[int]] = field(default_factory=list)
    next_store_chunk: int = 0
    store_jobs: set[int] = field(default_factory=set)
    promote_jobs: set[int] = field(default_factory=set)  # fills (promotions, remote reads)
    filled: dict[bytes, str] = field(default_factory=dict)  # key -> tier filled from, for it
    remote_done: bool = False  # the remote tier was asked (answered, read, or gave up)
    promote_rounds: int = 0
    promote_deadline: float = 0.0
    load_job: int | None = None
    pending_hit: PendingHit | None = None
    hit_tokens: dict[str, int] = field(default_factory=dict)
    finished: bool = False
    looked_up: bool = False
    # A load found blocks it does not hold from this chunk on (hybrid): later hits end before it.
    hit_chunk_limit: int | None = None

    @property
    def tables(self) -> list[list[int]]:
        """Every group's device blocks (one group: just ``block_ids``)."""
        return self.group_ids or [self.block_ids]

    def set_tables(self, tables: list[list[int]]) -> None:
        self.group_ids = tables if len(tables) > 1 else []
        self.block_ids = tables[0] if tables else []

    @property
    def waiting_on_load(self) -> bool:
        return self.load_job is not None or bool(self.promote_jobs)


class RequestTable:
    """Every request the planner tracks; one is forgotten once finished with no job left."""

    def __init__(self) -> None:
        self._states: dict[str, RequestState] = {}

    def get(self, req_id: str | None) -> RequestState | None:
        return self._states.get(req_id) if req_id is not None else None

    def ensure(self, req_id: str) -> RequestState:
        state = self._states.get(req_id)
        if state is None:
            state = self._states[req_id] = RequestState(req_id)
        return state

    def maybe_forget(self, state: RequestState) -> None:
        if state.finished and not (state.store_jobs or state.promote_jobs or state.load_job):
            self._states.pop(state.req_id, None)

    def __iter__(self) -> Iterator[RequestState]:
        return iter(self._states.values())


class HitEpoch:
    """Bumped whenever a pinned host entry may have been removed (reset, failed load, a
    superseded entry): a cached pending hit from an older epoch is recomputed."""

    def __init__(self) -> None:
        self.value = 0

    def bump(self) -> None:
        self.value += 1
