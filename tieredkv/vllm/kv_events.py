"""KV events for cache-aware routers: what tieredkv holds, per tier, as vLLM's own events say it.

vLLM publishes what a connector's ``take_events()`` returns beside its device-cache events
(``--kv-events-config``). Routers join them by vLLM's *block hashes*, so an event must carry
those (not tieredkv's namespaced keys), with the blocks' tokens, parent hash and extra keys
exactly as vLLM's own ``BlockStored`` fills them.

The scheduler's indexes (:class:`~tieredkv.scheduler.tier_index.TierIndex`) tell this module
when an entry becomes READY on a tier, when it stops being served and when a tier is cleared
(:class:`~tieredkv.scheduler.tier_index.TierListener`); what an entry's blocks are is recorded
here from the request while it is alive (:meth:`KVEvents.record`). Per tier and group, a block
hash is counted once per entry holding it: ``BlockStored`` when the first entry holding it
becomes READY, ``BlockRemoved`` when the last one goes, so a tail superseded by a longer entry
of its chunk announces nothing twice and removes nothing still held.

Media (vLLM's convention): host ``CPU``, disk ``STORAGE`` (``locality`` ``LOCAL``); the shared
Redis tier ``STORAGE`` with ``locality`` ``REMOTE`` and ``ownership`` ``shared``. A disk
entry's record is appended to ``<disk_path>/kv_events.log`` so that, after a restart, the
recovered disk tier is announced again, :data:`ANNOUNCE_PER_STEP` entries per step.
Built only when vLLM's KV events are on: with them off the indexes call nothing.
"""

from __future__ import annotations

import logging
import os
import struct
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from vllm import envs
from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    resolve_block_hashes,
    to_event_extra_keys,
)

from tieredkv.disk.private_files import create_private_exclusive, open_private
from tieredkv.protocol import Tier

logger = logging.getLogger("tieredkv")

LOG_NAME = "kv_events.log"
ANNOUNCE_PER_STEP = 64  # recovered disk entries announced per step after a restart
UNPLACED_LIMIT = 4096  # records of planned copies not (yet) READY anywhere
# Redis evicts without telling anyone: the shared tier's newest entries written by this engine
# are announced, and the oldest announced as removed beyond this many (a router then
# underestimates what the shared tier holds, never overestimates it by more than this).
REMOTE_LIMIT = 8192
_FRAME = struct.Struct("<I")

# tier -> (medium, locality, ownership)
MEDIA: dict[str, tuple[str, str, str | None]] = {
    Tier.HOST: (MEDIUM_CPU, "LOCAL", None),
    Tier.DISK: (MEDIUM_STORAGE, "LOCAL", None),
    Tier.REMOTE: (MEDIUM_STORAGE, "REMOTE", "shared"),
}


def _int_hash(block_hash: bytes) -> int:
    """vLLM's event hash with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (its default): the
    digest's low 64 bits."""
    return int.from_bytes(block_hash, byteorder="big") & 0xFFFF_FFFF_FFFF_FFFF


@dataclass(frozen=True)
class EventGroup:
    """A KV-cache group announced: its index, the spec fields vLLM's store events carry, and
    for a sliding window the blocks before an entry's end that it serves (0: every block)."""

    idx: int = 0
    kind: str | None = None
    sliding_window: int | None = None
    window_blocks: int = 0

    def first_block(self, blocks: int) -> int:
        """The first of an entry's ``blocks`` blocks this group serves (a whole chunk, or a
        prompt's tail: a sliding window keeps only the blocks before the entry's end)."""
        return max(0, blocks - self.window_blocks) if self.window_blocks else 0


@dataclass(frozen=True, slots=True)
class Record:
    """One entry's blocks, from its chunk's first block to its key's block, as vLLM names
    them: external block hashes, the parent of the first, tokens, untagged extra keys."""

    hashes: tuple[Any, ...]
    parent: Any
    token_ids: Sequence[int]
    extra_keys: tuple[Any, ...] | None  # None: no block has any
    lora_id: int | None = None
    lora_name: str | None = None

    def encode(self, key: bytes) -> bytes:
        return msgspec.msgpack.encode([key, list(self.hashes), self.parent, list(self.token_ids),
                                       None if self.extra_keys is None else list(self.extra_keys),
                                       self.lora_id, self.lora_name])

    @staticmethod
    def decode(data: bytes) -> tuple[bytes, Record]:
        key, hashes, parent, tokens, extra, lora_id, lora_name = msgspec.msgpack.decode(data)
        extra_keys = None if extra is None else tuple(
            None if e is None else tuple(e) for e in extra)
        return bytes(key), Record(tuple(hashes), parent, tokens, extra_keys, lora_id, lora_name)


class KVEvents:
    """Collects the connector's KV events (scheduler thread only)."""

    def __init__(self, *, block_size: int, chunk_blocks: int, hash_block_size: int,
                 groups: Iterable[EventGroup] = (EventGroup(),), log_dir: str | Path | None = None,
                 announce_per_step: int = ANNOUNCE_PER_STEP) -> None:
        self.block_size = block_size
        self.chunk_blocks = chunk_blocks
        self.hash_block_size = hash_block_size
        self.groups = tuple(groups)
        self.announce_per_step = announce_per_step
        self._records: dict[bytes, Record] = {}
        self._unplaced: OrderedDict[bytes, None] = OrderedDict()
        self._on: dict[str, set[bytes]] = {tier: set() for tier in MEDIA}
        self._held: dict[str, Counter] = {tier: Counter() for tier in MEDIA}
        self._events: list[KVCacheEvent] = []
        self._cleared: set[str] = set()
        self._announce: deque[bytes] = deque()
        self._announce_ready: Callable[[bytes], tuple[bytes, ...] | None] | None = None
        self._log_path = Path(log_dir) / LOG_NAME if log_dir is not None else None
        self._log_fd: int | None = None
        self._logged: set[bytes] = set()
        self._remote_order: OrderedDict[bytes, None] = OrderedDict()
        # vLLM's maybe_convert_block_hash, its environment variable read once
        if envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES:
            self._convert: Callable[[bytes], Any] = _int_hash
        else:
            self._convert = maybe_convert_block_hash

    # ------------------------------------------------------------------ records

    def has_record(self, key: bytes) -> bool:
        return key in self._records

    def record(self, key: bytes, request: Any, last_block: int) -> None:
        """Remember the blocks of the entry ``key`` (blocks of its chunk up to ``last_block``,
        in tieredkv's block size) from ``request``, which names them."""
        bs = self.block_size
        first = last_block - last_block % self.chunk_blocks
        hashes = resolve_block_hashes(request.block_hashes, self.hash_block_size, bs)
        convert = self._convert
        ext = tuple(convert(hashes[j]) for j in range(first, last_block + 1))
        parent = convert(hashes[first - 1]) if first else None
        event_extra = None  # None: no block has extra keys (vLLM's events then say None each)
        if (request.lora_request is not None or request.mm_features or request.cache_salt
                or request.prompt_embeds is not None):
            extra = []
            mm_idx = 0
            for j in range(first, last_block + 1):
                keys, mm_idx = generate_block_hash_extra_keys(request, j * bs, (j + 1) * bs, mm_idx)
                extra.append(keys)
            event_extra = to_event_extra_keys(extra)
        lora = request.lora_request
        self._records[key] = Record(
            ext, parent, request.all_token_ids[first * bs:(last_block + 1) * bs],
            None if event_extra is None else tuple(event_extra),
            lora.adapter_id if lora is not None else None, lora.name if lora is not None else None)
        if not any(key in on for on in self._on.values()):
            self._unplaced[key] = None
            self._unplaced.move_to_end(key)
            while len(self._unplaced) > UNPLACED_LIMIT:
                old, _ = self._unplaced.popitem(last=False)
                self._records.pop(old, None)

    # ------------------------------------------------------------------ TierListener

    def entry_ready(self, tier: str, key: bytes, aliases: tuple[bytes, ...] = ()) -> None:
        """The entry ``key`` is READY on ``tier``: announce its blocks not held there yet."""
        self._flush_clear()
        record = self._records.get(key)
        on = self._on[tier]
        if record is None or key in on:
            if record is None:
                logger.debug("tieredkv: KV events: no record of an entry READY on %s", tier)
            return
        on.add(key)
        self._unplaced.pop(key, None)
        self._store(tier, record)
        if tier == Tier.REMOTE:
            self._remote_order[key] = None
            while len(self._remote_order) > REMOTE_LIMIT:
                self.entry_gone(Tier.REMOTE, next(iter(self._remote_order)))
        if tier == Tier.DISK and self._log_path is not None and key not in self._logged:
            self._append_log(key, record)

    def entry_gone(self, tier: str, key: bytes) -> None:
        """The entry ``key`` is no longer served from ``tier``: remove blocks no entry holds."""
        self._flush_clear()
        on = self._on[tier]
        if key not in on:
            return
        on.discard(key)
        if tier == Tier.REMOTE:
            self._remote_order.pop(key, None)
        record = self._records[key]
        held = self._held[tier]
        medium, locality, ownership = MEDIA[tier]
        for group in self.groups:
            gone = []
            for h in record.hashes[group.first_block(len(record.hashes)):]:
                held[group.idx, h] -= 1
                if held[group.idx, h] <= 0:
                    del held[group.idx, h]
                    gone.append(h)
            if gone:
                self._events.append(BlockRemoved(block_hashes=gone, medium=medium,
                                                 group_idx=group.idx, locality=locality,
                                                 ownership=ownership))
        if not any(key in o for o in self._on.values()):
            self._records.pop(key, None)

    def tier_cleared(self, tier: str) -> None:
        """A reset emptied ``tier``: one ``AllBlocksCleared`` (the remote tier's hints are
        forgotten with it); tiers not cleared are announced again after it."""
        self._cleared.add(tier)
        self._cleared.add(Tier.REMOTE)

    def _flush_clear(self) -> None:
        if not self._cleared:
            return
        cleared, self._cleared = self._cleared, set()
        self._events.append(AllBlocksCleared())
        self._announce.clear()
        self._remote_order.clear()
        for tier in MEDIA:
            keys = self._on[tier]
            self._on[tier] = set()
            self._held[tier].clear()
            for key in keys:
                if tier in cleared:
                    if not any(key in o for o in self._on.values()):
                        self._records.pop(key, None)
                else:
                    self.entry_ready(tier, key)

    def _store(self, tier: str, record: Record) -> None:
        held = self._held[tier]
        medium, locality, ownership = MEDIA[tier]
        bs = self.block_size
        for group in self.groups:
            run_start: int | None = None
            n = len(record.hashes)
            for i in range(group.first_block(n), n + 1):
                new = False
                if i < n:
                    slot = (group.idx, record.hashes[i])
                    new = held[slot] == 0
                    held[slot] += 1
                if new and run_start is None:
                    run_start = i
                elif not new and run_start is not None:
                    self._events.append(self._stored(record, run_start, i, group, medium,
                                                     locality, ownership, bs))
                    run_start = None

    @staticmethod
    def _stored(record: Record, i0: int, i1: int, group: EventGroup, medium: str,
                locality: str, ownership: str | None, bs: int) -> BlockStored:
        extra = record.extra_keys
        return BlockStored(
            block_hashes=list(record.hashes[i0:i1]),
            parent_block_hash=record.hashes[i0 - 1] if i0 else record.parent,
            token_ids=list(record.token_ids[i0 * bs:i1 * bs]),
            block_size=bs,
            lora_id=record.lora_id,
            medium=medium,
            lora_name=record.lora_name,
            extra_keys=list(extra[i0:i1]) if extra is not None else [None] * (i1 - i0),
            group_idx=group.idx,
            kv_cache_spec_kind=group.kind,
            kv_cache_spec_sliding_window=group.sliding_window,
            locality=locality,
            ownership=ownership,
        )

    # ------------------------------------------------------------------ steps

    def take(self) -> list[KVCacheEvent]:
        """This step's events; a recovered disk tier is announced a bounded part per step."""
        self._flush_clear()
        ready = self._announce_ready
        budget = self.announce_per_step
        while self._announce and budget and ready is not None:
            key = self._announce.popleft()
            aliases = ready(key)
            if aliases is not None:
                self.entry_ready(Tier.DISK, key, aliases)
                budget -= 1
        events, self._events = self._events, []
        return events

    @property
    def announcing(self) -> bool:
        """Recovered disk entries still to announce."""
        return bool(self._announce)

    # ------------------------------------------------------------------ restart

    def recover(self, disk_keys: Iterable[bytes],
                ready: Callable[[bytes], tuple[bytes, ...] | None]) -> int:
        """Start-up: read the log, keep the records of entries the disk tier recovered, queue
        them to be announced (``ready(key)``: the entry's aliases while it is READY there, else
        None) and rewrite the log with only them. Returns how many are queued."""
        path = self._log_path
        if path is None:
            return 0
        found = self._read_log(path)
        kept = {key: found[key] for key in disk_keys if key in found}
        self._records.update(kept)
        self._announce.extend(kept)
        self._announce_ready = ready
        self._rewrite_log(kept)
        if kept:
            logger.info("tieredkv: KV events: %d recovered disk entries to announce", len(kept))
        return len(kept)

    def _read_log(self, path: Path) -> dict[bytes, Record]:
        out: dict[bytes, Record] = {}
        try:
            fd = open_private(path, os.O_RDONLY)
        except FileNotFoundError:
            return out
        except OSError as exc:
            logger.warning("tieredkv: KV events: cannot read %s (%s): nothing to announce", path, exc)
            return out
        with os.fdopen(fd, "rb") as f:
            data = f.read()
        pos = 0
        while pos + _FRAME.size <= len(data):
            (size,) = _FRAME.unpack_from(data, pos)
            body = data[pos + _FRAME.size:pos + _FRAME.size + size]
            if len(body) < size:
                break  # a torn last record
            try:
                key, record = Record.decode(body)
            except (msgspec.DecodeError, ValueError, TypeError):
                logger.warning("tieredkv: KV events: %s has an unreadable record; stopped there", path)
                break
            out[key] = record
            pos += _FRAME.size + size
        return out

    def _rewrite_log(self, records: dict[bytes, Record]) -> None:
        assert self._log_path is not None
        tmp = self._log_path.with_name(LOG_NAME + ".tmp")
        try:
            if self._log_fd is not None:
                os.close(self._log_fd)
                self._log_fd = None
            fd = create_private_exclusive(tmp)
            with os.fdopen(fd, "wb") as f:
                for key, record in records.items():
                    body = record.encode(key)
                    f.write(_FRAME.pack(len(body)) + body)
            os.replace(tmp, self._log_path)
            self._logged = set(records)
        except OSError as exc:
            logger.warning("tieredkv: KV events: cannot write %s (%s): a restart will not "
                           "announce the disk tier", self._log_path, exc)
            self._log_path = None

    def _append_log(self, key: bytes, record: Record) -> None:
        assert self._log_path is not None
        if len(self._logged) > 2 * max(1024, len(self._on[Tier.DISK])):
            self._rewrite_log({k: self._records[k] for k in self._on[Tier.DISK]})
            return
        try:
            if self._log_fd is None:
                self._log_fd = open_private(self._log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            body = record.encode(key)
            os.write(self._log_fd, _FRAME.pack(len(body)) + body)
            self._logged.add(key)
        except OSError as exc:
            logger.warning("tieredkv: KV events: cannot append to %s (%s): a restart will not "
                           "announce the disk tier", self._log_path, exc)
            self._log_path = None

    def close(self) -> None:
        if self._log_fd is not None:
            os.close(self._log_fd)
            self._log_fd = None


def event_groups(kv_cache_config: Any, slot_rows: Any) -> tuple[EventGroup, ...]:
    """The groups to announce: one model group (index 0, as vLLM's device events) or, for a
    hybrid model, every group with the blocks of a chunk it serves and its spec fields."""
    if not slot_rows.hybrid:
        return (EventGroup(),)
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

    out = []
    specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
    for idx, (group, spec) in enumerate(zip(slot_rows.groups, specs, strict=True)):
        out.append(EventGroup(idx, get_kv_cache_spec_kind(spec).value,
                              get_kv_cache_spec_sliding_window(spec), group.window_blocks))
    return tuple(out)
