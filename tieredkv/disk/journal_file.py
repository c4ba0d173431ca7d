"""The journal's records, from queued to durable: the bounded backlog they wait in, their
format and replay, and the one descriptor the journal appends to.

File format (little-endian): a 16-byte file header (magic ``TKVJRNL1``, version, reserved),
then fixed 56-byte records ``op:u8, pad:3, key:32s, slot:u64, sequence:u64, crc32:u32``, the
crc covering the 52 bytes before it. Replay stops at the first record that is torn, fails its
crc or does not continue the sequence: everything after it is ignored (counted and logged).
:class:`~tieredkv.disk.private_files.JournalFiles` is every system call the journal makes, so
tests can fail any one.

:class:`JournalFile` is the file itself: one unbuffered ``O_APPEND`` descriptor and what is
known durable in it. Every step there is blocking and runs on the journal flusher's executor,
one call per batch or rewrite; why each step is the way it is (cut back after a failed append,
reopen and directory fsync after a rename, no link followed) is in
:mod:`tieredkv.disk.journal`'s docstring.

:class:`Backlog` holds what waits for the flusher, bounded, and :class:`RetryBackoff` spaces
its attempts, so a full or failing disk costs neither unbounded memory nor a busy core. While
writes fail, records keep arriving (slab files are preallocated, so spills go on succeeding on
a full disk). The backlog holds at most ``limit`` records. The record that would go past it
starts an *overflow*: the whole backlog is dropped and every later record is dropped on
arrival, each one counted. Nothing is lost for good: the journal keeps the live index (every
record applied, dropped or not), and its next write is a rebuild of the file from that index
(a compaction). Until the rebuild is durable no flush reports those records durable, and after
it the file says exactly what the dropped records would have said. Between failed attempts the
flusher waits :meth:`RetryBackoff.delay` (doubling from ``first_s`` to ``max_s``) on its
wake-up event, so a failing disk costs one attempt per delay; a caller waiting on the journal
(``flush``, ``compact``, ``close``) wakes it at once. A reset (:class:`Cleared`) makes
everything queued before it moot: :meth:`Backlog.clear` drops it (answering compactions, ending
an overflow) and puts the clear first, where it is never dropped, so a full disk cannot keep it
from being written before anything else.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import logging
import os
import struct
import zlib
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any

from tieredkv.disk.private_files import JournalFiles
from tieredkv.keys import KEY_BYTES

logger = logging.getLogger("tieredkv.disk.journal")  # one logger name for the journal's lines

JOURNAL_MAGIC = b"TKVJRNL1"
JOURNAL_VERSION = 1
_FILE_HEADER = struct.Struct("<8sII")
_BODY = struct.Struct(f"<B3x{KEY_BYTES}sQQ")
_CRC = struct.Struct("<I")
FILE_HEADER_BYTES = _FILE_HEADER.size
RECORD_BYTES = _BODY.size + _CRC.size


class Op(IntEnum):
    ADD = 1
    REMOVE = 2
    CLEAR = 3


def file_header() -> bytes:
    return _FILE_HEADER.pack(JOURNAL_MAGIC, JOURNAL_VERSION, 0)


def encode_record(op: Op, key: bytes, slot: int, sequence: int) -> bytes:
    body = _BODY.pack(op, key, slot, sequence)
    return body + _CRC.pack(zlib.crc32(body))


@dataclass
class JournalReplay:
    """The index a journal describes, and how much of the file could be trusted."""

    entries: dict[bytes, int] = field(default_factory=dict)
    records: int = 0
    valid_bytes: int = 0
    bad_tail_bytes: int = 0
    last_sequence: int = 0
    header_ok: bool = True


def apply_record(entries: dict[bytes, int], owners: dict[int, bytes], op: int, key: bytes, slot: int) -> None:
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


def read_journal(path: Path) -> bytes:
    """The journal's bytes, read without following a link (b"" if there is none)."""
    try:
        fd = JournalFiles().open_read(path)
    except FileNotFoundError:
        return b""
    with open(fd, "rb", closefd=True) as file:
        return file.read()


def replay_journal(path: Path) -> JournalReplay:
    """Replay a journal file into ``key -> slot`` and report how much of it was valid.

    Raises UntrustedPathError if ``path`` is a link or not our own regular file.
    """
    path = Path(path)
    result = JournalReplay()
    data = read_journal(path)
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
        apply_record(result.entries, owners, op, key, slot)
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


# -- the file -------------------------------------------------------------------------------


class JournalFile:
    """The journal file at ``path``, appended through ``files`` (the system calls)."""

    def __init__(self, path: Path, files: JournalFiles, replay: JournalReplay) -> None:
        self.path = path
        self.replay = replay  # what the file held when the journal opened it
        self._files = files
        self.next_seq = replay.last_sequence + 1
        # A descriptor (None between a compaction's rename and the reopen), the bytes known
        # durable in it, whether bytes past those may be there (a failed append, a reopen)
        # and whether the last rename still needs its directory fsync.
        self.fd: int | None = None
        self.size = 0
        self.dirty = False
        self.dir_unsynced = False
        self.records_written = 0

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            try:
                self._files.close(fd)
            except OSError as exc:
                logger.warning("tieredkv journal %s: close failed: %s", self.path, exc)

    def open(self) -> None:
        """Open the journal, writing a header into a new or unusable file, cutting a torn tail."""
        replay = self.replay
        fd = self._files.open_log(self.path)
        try:
            os.fchmod(fd, 0o600)
            if not replay.header_ok or replay.valid_bytes == 0:
                self._files.truncate(fd, 0)
                self._files.write(fd, file_header())
                self._files.fsync(fd)
                self.size = FILE_HEADER_BYTES
            else:
                if replay.bad_tail_bytes:
                    self._files.truncate(fd, replay.valid_bytes)
                    self._files.fsync(fd)
                    logger.warning(
                        "tieredkv journal %s: cut off %d bytes of torn tail",
                        self.path, replay.bad_tail_bytes,
                    )
                self.size = replay.valid_bytes
        except BaseException:
            self._files.close(fd)
            raise
        self.fd = fd
        self.dirty = True  # a ``replay`` handed in may be older than the file: check first

    def ready(self) -> int:
        """The descriptor to append to, once the file is safe to append to after a failure.

        Reopens the path after a compaction, makes its rename durable, and cuts off whatever a
        failed append left past the durable size; raises (appending nothing) if any step fails.
        """
        if self.fd is None:
            self.fd = self._files.open_log(self.path)
            self.dirty = True
        if self.dir_unsynced:
            self._files.fsync_dir(self.path.parent)
            self.dir_unsynced = False
        if self.dirty:
            size = self._files.size(self.fd)
            if size < self.size:
                raise OSError(
                    errno.EIO, f"journal shrank to {size} bytes; {self.size} were made durable"
                )
            if size > self.size:
                self._files.truncate(self.fd, self.size)
            self.dirty = False
        return self.fd

    def append(self, batch: list[tuple[Op, bytes, int]]) -> None:
        fd = self.ready()
        first_seq = self.next_seq
        data = b"".join(
            encode_record(op, key, slot, first_seq + i) for i, (op, key, slot) in enumerate(batch)
        )
        self.dirty = True  # part of the batch may reach the file even if this fails
        self._files.write(fd, data)
        self._files.fsync(fd)
        self.dirty = False
        self.next_seq += len(batch)
        self.size += len(data)
        self.records_written += len(batch)

    def clear(self) -> None:
        """Cut the journal back to its header, durably: ``ftruncate`` needs no free blocks, so
        a reset is durable on a full disk. If the cut fails, an atomic rewrite as empty."""
        try:
            if self.fd is None:
                self.fd = self._files.open_log(self.path)
            if self.dir_unsynced:  # else a crash could bring back the file renamed away
                self._files.fsync_dir(self.path.parent)
                self.dir_unsynced = False
            self.dirty = True
            self._files.truncate(self.fd, FILE_HEADER_BYTES)
            self._files.fsync(self.fd)
        except OSError as exc:
            logger.warning(
                "tieredkv journal %s: cutting it back failed (%s); rewriting it empty",
                self.path, exc,
            )
            self.compact({})
            return
        self.dirty = False
        self.size = FILE_HEADER_BYTES

    def compact(self, entries: dict[bytes, int]) -> None:
        data = bytearray(file_header())
        for sequence, (key, slot) in enumerate(sorted(entries.items(), key=lambda kv: kv[1]), 1):
            data += encode_record(Op.ADD, key, slot, sequence)
        tmp = self.path.with_name(self.path.name + ".tmp")
        self._write_temp(tmp, bytes(data))
        try:
            self._files.replace(tmp, self.path)
        except BaseException:
            self._discard(tmp)
            raise
        # The path names the new file now: never write the old one again, whatever fails next.
        self.close()
        self.size = len(data)
        self.next_seq = len(entries) + 1
        self.dir_unsynced = True
        self.records_written += len(entries)
        self.ready()

    def _write_temp(self, tmp: Path, data: bytes) -> None:
        """Write ``data`` durably into a new file at ``tmp`` (removed again on failure)."""
        fd = self._files.create_temp(tmp)
        try:
            try:
                self._files.write(fd, data)
                self._files.fsync(fd)
            finally:
                self._files.close(fd)
        except BaseException:
            self._discard(tmp)
            raise

    def _discard(self, tmp: Path) -> None:
        try:
            self._files.unlink(tmp)
        except OSError:
            pass  # a leftover temporary file is replaced by the next compaction


# -- the backlog (see the module docstring) -----------------------------------------------

# About 5 MiB of queued records (~170 B each in memory), several seconds of the busiest
# spilling; past it a rebuild (one record per live entry) is the cheaper way back.
BACKLOG_MAX_RECORDS = 1 << 15
RETRY_FIRST_S = 0.05
RETRY_MAX_S = 5.0


@dataclass
class Compaction:
    """A rewrite of the journal as exactly ``entries``; ``done`` answers the caller."""

    entries: dict[bytes, int]
    done: cf.Future[None]


@dataclass
class Cleared:
    """A reset of the journal to no entries; ``dones`` answer the callers waiting for it and
    ``covered`` counts the items recorded up to it (all made moot by it)."""

    dones: list[cf.Future[None]]
    covered: int


class RetryBackoff:
    """Exponential backoff between failed attempts: ``first_s``, doubling, capped at ``max_s``."""

    def __init__(self, first_s: float = RETRY_FIRST_S, max_s: float = RETRY_MAX_S) -> None:
        if not 0 < first_s <= max_s:
            raise ValueError(f"need 0 < first_s <= max_s, got {first_s} and {max_s}")
        self.first_s = first_s
        self.max_s = max_s
        self.failures = 0  # failed attempts since the last success

    @property
    def delay(self) -> float:
        """Seconds to wait before the next attempt (0 while nothing is failing)."""
        if not self.failures:
            return 0.0
        return min(self.max_s, self.first_s * 2.0 ** min(self.failures - 1, 64))

    def failed(self) -> float:
        """Count a failed attempt; the delay before the next one."""
        self.failures += 1
        return self.delay

    def succeeded(self) -> None:
        self.failures = 0


class Backlog:
    """The items waiting for the flusher, at most ``limit`` records (see the module docstring).

    Not thread-safe: the journal calls it under its own lock. ``records`` counts the records
    queued or being written, neither durable nor dropped yet. Compactions are never dropped
    (each holds at most the live index, and at most one is queued per
    ``COMPACT_MIN_RECORDS`` records): during an overflow the rebuild answers them.
    """

    def __init__(self, limit: int = BACKLOG_MAX_RECORDS) -> None:
        if limit < 1:
            raise ValueError(f"the journal backlog limit must be >= 1, got {limit}")
        self.limit = limit
        self.items: list[Any] = []
        self.records = 0
        self.overflowing = False  # records are dropped; the next write is a rebuild
        self.episode = False  # an overflow began and no rebuild has succeeded since
        self.dropped = 0  # records ever dropped
        self.episode_dropped = 0  # records dropped in this episode, not yet in a snapshot
        self._covering = 0  # records dropped that the rebuild being written covers
        self.waiters: list[cf.Future[None]] = []  # compactions the next rebuild answers

    def add(self, item: Any) -> bool:
        """Queue ``item``, or drop it while overflowing; True when this call began an episode."""
        if isinstance(item, Compaction):
            if self.overflowing:
                self.waiters.append(item.done)
            else:
                self.items.append(item)
            return False
        if not self.overflowing and self.records < self.limit:
            self.items.append(item)
            self.records += 1
            return False
        started = not self.episode
        self.overflow()
        self.dropped += 1
        self.episode_dropped += 1
        return started

    def take(self) -> list[Any]:
        """Everything queued, for the flusher to write (still counted until written)."""
        items, self.items = self.items, []
        return items

    def written(self, records: int) -> None:
        self.records -= records

    def clear(self, item: Cleared) -> None:
        """A reset: what is queued is moot (its records are not counted as dropped), the
        overflow ends (the live index is empty) and ``item`` goes first, absorbing a clear
        still pending."""
        answered, self.waiters = self.waiters, []
        for old in self.items:
            if isinstance(old, Compaction):
                answered.append(old.done)
            elif isinstance(old, Cleared):
                item.dones[:0] = old.dones
            else:
                self.records -= 1
        self.items = [item]
        self.overflowing = self.episode = False
        self.episode_dropped = self._covering = 0
        for done in answered:  # superseded: the state they described no longer exists
            done.set_result(None)

    def take_clear(self) -> Cleared | None:
        """The pending reset, if one is first in line (it is written before anything else)."""
        if self.items and isinstance(self.items[0], Cleared):
            return self.items.pop(0)
        return None

    def requeue(self, rest: list[Any]) -> None:
        """Put back what a failed write did not write (dropped instead while overflowing);
        what came before a reset, queued or in ``rest``, is moot and goes, uncounted."""
        pending = bool(self.items) and isinstance(self.items[0], Cleared)
        cut = len(rest) if pending else max(
            (n for n, item in enumerate(rest) if isinstance(item, Cleared)), default=0
        )
        moot, rest = rest[:cut], rest[cut:]
        for item in moot:
            if isinstance(item, Compaction):
                item.done.set_result(None)
            elif isinstance(item, Cleared):  # the reset after it answers its callers
                (rest[0] if rest else self.items[0]).dones[:0] = item.dones
            else:
                self.records -= 1
        if self.overflowing:
            self._drop(rest)
        else:
            self.items[:0] = rest

    def overflow(self) -> None:
        """Drop everything queued (but a pending reset) and every record from now on, until
        the next rebuild."""
        self.overflowing = True
        self.episode = True
        items, self.items = self.items, []
        self._drop(items)

    def rebuilding(self) -> list[cf.Future[None]]:
        """The rebuild took its snapshot: records from now on are queued again (dropped
        anew if it fails). Returns the compactions it answers."""
        self.overflowing = False
        self._covering, self.episode_dropped = self.episode_dropped, 0
        waiters, self.waiters = self.waiters, []
        return waiters

    def rebuild_failed(self) -> None:
        """Back to dropping: what was queued since the snapshot, too; the next rebuild
        covers all of it."""
        self.episode_dropped += self._covering
        self._covering = 0
        self.overflow()

    def rebuilt(self) -> int:
        """A rebuild is durable: the episode ends (unless records were dropped while it was
        written; the next rebuild covers those). Returns the records this one covered."""
        covered, self._covering = self._covering, 0
        self.episode = self.overflowing
        return covered

    def _drop(self, items: list[Any]) -> None:
        for item in items:
            if isinstance(item, Cleared):
                self.items.insert(0, item)  # never dropped: it goes before the rebuild
            elif isinstance(item, Compaction):
                self.waiters.append(item.done)
            else:
                self.records -= 1
                self.dropped += 1
                self.episode_dropped += 1
