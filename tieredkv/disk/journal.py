"""The scheduler's append-only journal of the disk index, so a restart finds its prefixes.

The scheduler half owns the index (key -> disk slot). It records an ``ADD`` only after *every*
TP rank has confirmed its slot write (that decision is the caller's: the journal cannot know
how many ranks exist), a ``REMOVE`` when it evicts or drops an entry, and a ``CLEAR`` when
the cache is reset. Recording is a non-blocking append to an in-memory queue; a dedicated
thread running its own asyncio loop appends the queued records with aiofiles and fsyncs them
in batches every ``flush_interval_s`` (about 50 ms), so the engine's step never waits on disk.

Losing the last few records in a crash is harmless: an entry that is not journaled is simply
not recovered, and an entry that is journaled is verified against its slot header at start-up
and its payload checksum on every read, so a stale record can cost a miss, never wrong bytes.

File format (little-endian): a 16-byte file header (magic ``TKVJRNL1``, version, reserved),
then fixed 56-byte records ``op:u8, pad:3, key:32s, slot:u64, sequence:u64, crc32:u32``, the
crc covering the 52 bytes before it. Replay stops at the first record that is torn, fails its
crc or does not continue the sequence: everything after it is ignored (counted and logged)
and cut off the next time the journal is opened for writing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import os
import struct
import threading
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any

import aiofiles
import aiofiles.os

from tieredkv.disk.errors import FailureKind, SlabError, slab_error_from_oserror
from tieredkv.keys import KEY_BYTES

logger = logging.getLogger(__name__)

JOURNAL_MAGIC = b"TKVJRNL1"
JOURNAL_VERSION = 1
_FILE_HEADER = struct.Struct("<8sII")
_BODY = struct.Struct(f"<B3x{KEY_BYTES}sQQ")
_CRC = struct.Struct("<I")
FILE_HEADER_BYTES = _FILE_HEADER.size
RECORD_BYTES = _BODY.size + _CRC.size
_NO_KEY = bytes(KEY_BYTES)


# A running journal is rewritten once it holds this many records since its last rewrite
# (or 4x the live entries, whichever is more): bounded size, rare rewrites.
COMPACT_MIN_RECORDS = 1024


class Op(IntEnum):
    ADD = 1
    REMOVE = 2
    CLEAR = 3


def _file_header() -> bytes:
    return _FILE_HEADER.pack(JOURNAL_MAGIC, JOURNAL_VERSION, 0)


def encode_record(op: Op, key: bytes, slot: int, sequence: int) -> bytes:
    body = _BODY.pack(op, key, slot, sequence)
    return body + _CRC.pack(zlib.crc32(body))


def _opener(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_CLOEXEC, 0o600)


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class JournalReplay:
    """The index a journal describes, and how much of the file could be trusted."""

    entries: dict[bytes, int] = field(default_factory=dict)
    records: int = 0
    valid_bytes: int = 0
    bad_tail_bytes: int = 0
    last_sequence: int = 0
    header_ok: bool = True


def _apply(entries: dict[bytes, int], owners: dict[int, bytes], op: int, key: bytes, slot: int) -> None:
    if op == Op.ADD:
        old_slot = entries.get(key)
        if old_slot is not None:
            owners.pop(old_slot, None)
        # A slot holds one key: the latest ADD to a slot wins even if a REMOVE was lost.
        previous = owners.get(slot)
        if previous is not None and previous != key:
            entries.pop(previous, None)
        entries[key] = slot
        owners[slot] = key
    elif op == Op.REMOVE:
        old_slot = entries.pop(key, None)
        if old_slot is not None:
            owners.pop(old_slot, None)
    else:
        entries.clear()
        owners.clear()


class Journal:
    """Append-only journal with a background flusher; see the module docstring."""

    def __init__(
        self, path: Path, flush_interval_s: float = 0.05, replay: JournalReplay | None = None
    ) -> None:
        """Open (or create, 0600) the journal for appending, cutting off a torn tail.

        ``replay``: the result of :meth:`replay` on this file, if the caller already has it.
        """
        self.path = Path(path)
        self.flush_interval_s = flush_interval_s
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.opened_replay = replay if replay is not None else Journal.replay(self.path)
        self._cond = threading.Condition()
        self._pending: list[Any] = []
        self._queued = 0  # items ever queued
        self._durable = 0  # items ever made durable (or superseded by a compaction)
        self._error: BaseException | None = None
        self._error_gen = 0
        self._stopping = False
        self._closed = False
        self._next_seq = self.opened_replay.last_sequence + 1
        # The live index as the records describe it, kept for runtime compactions.
        self._live: dict[bytes, int] = dict(self.opened_replay.entries)
        self._owners: dict[int, bytes] = {slot: key for key, slot in self._live.items()}
        self._since_compaction = 0
        self.runtime_compactions = 0
        self._size = 0
        self._file: Any = None
        self.records_written = 0
        self.write_errors = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        started: cf.Future[None] = cf.Future()
        self._thread = threading.Thread(
            target=self._thread_main, args=(started,), name="tieredkv-journal", daemon=True
        )
        self._thread.start()
        started.result()

    # -- reading -------------------------------------------------------------------------

    @staticmethod
    def replay(path: Path) -> JournalReplay:
        """Replay a journal file into ``key -> slot`` and report how much of it was valid."""
        path = Path(path)
        result = JournalReplay()
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return result
        if not data:
            return result
        header = data[:FILE_HEADER_BYTES]
        if len(header) < FILE_HEADER_BYTES or _FILE_HEADER.unpack(header)[:2] != (
            JOURNAL_MAGIC, JOURNAL_VERSION,
        ):
            result.header_ok = False
            result.bad_tail_bytes = len(data)
            logger.warning("tieredkv journal %s: unrecognised file header; ignoring it", path)
            return result
        owners: dict[int, bytes] = {}
        offset = FILE_HEADER_BYTES
        last = 0
        while offset + RECORD_BYTES <= len(data):
            body = data[offset : offset + _BODY.size]
            (crc,) = _CRC.unpack_from(data, offset + _BODY.size)
            if zlib.crc32(body) != crc:
                break
            op, key, slot, sequence = _BODY.unpack(body)
            if op not in (Op.ADD, Op.REMOVE, Op.CLEAR) or sequence <= last:
                break
            _apply(result.entries, owners, op, key, slot)
            last = sequence
            result.records += 1
            offset += RECORD_BYTES
        result.valid_bytes = offset
        result.last_sequence = last
        result.bad_tail_bytes = len(data) - offset
        if result.bad_tail_bytes:
            logger.warning(
                "tieredkv journal %s: ignored a torn or corrupt tail of %d bytes after %d records",
                path, result.bad_tail_bytes, result.records,
            )
        return result

    @staticmethod
    def recover(path: Path) -> dict[bytes, int]:
        """``key -> slot`` as the journal at ``path`` describes it (empty if absent)."""
        return Journal.replay(path).entries

    # -- recording (any thread, never blocks on disk) ------------------------------------

    def _queue(self, item: Any) -> None:
        with self._cond:
            if self._stopping:
                raise RuntimeError(f"journal {self.path} is closed")
            self._pending.append(item)
            self._queued += 1

    def _record(self, op: Op, key: bytes, slot: int) -> None:
        """Queue a record; past a bound, queue a compaction too, so the file never grows
        without limit on a long-running server (the caller never waits for it)."""
        self._queue((op, key, slot))
        _apply(self._live, self._owners, op, key, slot)
        self._since_compaction += 1
        if self._since_compaction >= max(COMPACT_MIN_RECORDS, 4 * len(self._live)):
            self._since_compaction = 0
            self.runtime_compactions += 1
            self._queue(_Compaction(dict(self._live), cf.Future()))
            self._kick()

    def record_add(self, key: bytes, slot: int) -> None:
        """Journal ``key`` at ``slot``; call only once every rank confirmed its write."""
        if len(key) != KEY_BYTES:
            raise ValueError(f"key must be {KEY_BYTES} bytes, got {len(key)}")
        self._record(Op.ADD, key, slot)

    def record_remove(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"key must be {KEY_BYTES} bytes, got {len(key)}")
        self._record(Op.REMOVE, key, 0)

    def record_clear(self) -> None:
        self._record(Op.CLEAR, _NO_KEY, 0)

    def _kick(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is None or wake is None:
            return
        try:
            loop.call_soon_threadsafe(wake.set)
        except RuntimeError:
            pass  # the loop already stopped

    def flush(self, timeout: float | None = 10.0) -> None:
        """Block until everything queued so far is durable; raises SlabError if it cannot be."""
        with self._cond:
            target = self._queued
            generation = self._error_gen
            if self._durable >= target:
                return
        self._kick()
        with self._cond:
            self._cond.wait_for(
                lambda: self._durable >= target or self._error_gen != generation, timeout
            )
            if self._durable >= target:
                return
            error = self._error
        if error is None:
            raise SlabError(FailureKind.TIMEOUT, f"journal flush took over {timeout} s", path=self.path)
        if isinstance(error, OSError):
            raise slab_error_from_oserror(error, "journal append", path=self.path) from error
        raise SlabError(FailureKind.IO_ERROR, f"journal append failed: {error}", path=self.path)

    def compact(self, entries: Mapping[bytes, int], timeout: float | None = 60.0) -> None:
        """Atomically rewrite the journal as exactly ``entries`` (one ADD each).

        ``entries`` must be the complete index as of this call: records queued before it are
        superseded, records queued after it are appended after the rewrite. Writes a
        temporary file, fsyncs it, renames it over the journal and fsyncs the directory, so
        a crash leaves either the old journal or the new one, never a mix.
        """
        done: cf.Future[None] = cf.Future()
        self._live = dict(entries)
        self._owners = {slot: key for key, slot in self._live.items()}
        self._since_compaction = 0
        self._queue(_Compaction(dict(entries), done))
        self._kick()
        try:
            done.result(timeout)
        except OSError as exc:
            raise slab_error_from_oserror(exc, "journal compaction", path=self.path) from exc
        except cf.TimeoutError:
            raise SlabError(
                FailureKind.TIMEOUT, f"journal compaction took over {timeout} s", path=self.path
            ) from None

    def close(self, timeout: float = 10.0) -> None:
        """Flush what is queued (best effort, logged on failure) and stop the flusher."""
        if self._closed:
            return
        try:
            self.flush(timeout)
        except SlabError as exc:
            logger.warning("tieredkv journal %s: records lost at close: %s", self.path, exc)
        with self._cond:
            self._stopping = True
        self._kick()
        self._thread.join(timeout)
        self._closed = True

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the flusher thread --------------------------------------------------------------

    def _thread_main(self, started: cf.Future[None]) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main(started))
        finally:
            try:
                loop.run_until_complete(loop.shutdown_default_executor())
            finally:
                loop.close()

    async def _main(self, started: cf.Future[None]) -> None:
        self._wake = asyncio.Event()
        try:
            await self._open()
        except BaseException as exc:
            started.set_exception(exc)
            return
        started.set_result(None)
        try:
            while True:
                try:
                    await asyncio.wait_for(self._wake.wait(), self.flush_interval_s)
                except TimeoutError:
                    pass
                self._wake.clear()
                await self._drain()
                with self._cond:
                    if self._stopping and (not self._pending or self._error is not None):
                        break
        finally:
            await self._file.close()

    async def _open(self) -> None:
        replay = self.opened_replay
        self._file = await aiofiles.open(self.path, "ab", opener=_opener)
        if not replay.header_ok or replay.valid_bytes == 0:
            await self._file.truncate(0)
            await self._file.write(_file_header())
            self._size = FILE_HEADER_BYTES
            await self._sync()
        elif replay.bad_tail_bytes:
            await self._file.truncate(replay.valid_bytes)
            self._size = replay.valid_bytes
            await self._sync()
            logger.warning(
                "tieredkv journal %s: cut off %d bytes of torn tail", self.path, replay.bad_tail_bytes
            )
        else:
            self._size = replay.valid_bytes
        os.chmod(self.path, 0o600)

    async def _sync(self) -> None:
        await self._file.flush()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, os.fsync, self._file.fileno())

    async def _drain(self) -> None:
        """Write out everything queued, in order; on failure requeue the rest for a retry."""
        with self._cond:
            items, self._pending = self._pending, []
        i = 0
        while i < len(items):
            item = items[i]
            if isinstance(item, _Compaction):
                try:
                    await self._compact(item.entries)
                except Exception as exc:
                    # Not retried: the caller waits on it and hears the error.
                    item.done.set_exception(exc)
                    self._resolved(1)
                    self._failed(exc, items[i + 1 :])
                    return
                item.done.set_result(None)
                self._resolved(1)
                i += 1
                continue
            j = i
            while j < len(items) and not isinstance(items[j], _Compaction):
                j += 1
            try:
                await self._append(items[i:j])
            except Exception as exc:
                self._failed(exc, items[i:])
                return
            self._resolved(j - i)
            i = j
        with self._cond:
            self._error = None

    def _resolved(self, count: int) -> None:
        with self._cond:
            self._durable += count
            self._cond.notify_all()

    def _failed(self, exc: BaseException, rest: list[Any]) -> None:
        self.write_errors += 1
        logger.warning("tieredkv journal %s: append failed, will retry: %s", self.path, exc)
        with self._cond:
            self._pending[:0] = rest
            self._error = exc
            self._error_gen += 1
            self._cond.notify_all()

    async def _append(self, batch: list[tuple[Op, bytes, int]]) -> None:
        first_seq = self._next_seq
        data = b"".join(
            encode_record(op, key, slot, first_seq + i) for i, (op, key, slot) in enumerate(batch)
        )
        try:
            await self._file.write(data)
            await self._sync()
        except BaseException:
            # Cut a partly written batch off so later appends do not follow a torn record.
            try:
                await self._file.truncate(self._size)
            except Exception:
                pass
            raise
        self._next_seq += len(batch)
        self._size += len(data)
        self.records_written += len(batch)

    async def _compact(self, entries: dict[bytes, int]) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        data = bytearray(_file_header())
        for sequence, (key, slot) in enumerate(sorted(entries.items(), key=lambda kv: kv[1]), 1):
            data += encode_record(Op.ADD, key, slot, sequence)
        loop = asyncio.get_running_loop()
        async with aiofiles.open(tmp, "wb", opener=_opener) as out:
            await out.write(bytes(data))
            await out.flush()
            await loop.run_in_executor(None, os.fsync, out.fileno())
        await aiofiles.os.replace(tmp, self.path)
        await loop.run_in_executor(None, fsync_dir, self.path.parent)
        await self._file.close()
        self._file = await aiofiles.open(self.path, "ab", opener=_opener)
        self._size = len(data)
        self._next_seq = len(entries) + 1
        self.records_written += len(entries)


@dataclass
class _Compaction:
    entries: dict[bytes, int]
    done: cf.Future[None]
