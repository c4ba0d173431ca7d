"""The scheduler's append-only journal of the disk index, so a restart finds its prefixes.

The scheduler half owns the index (key -> disk slot). It records an ``ADD`` only after *every*
TP rank has confirmed its slot write (that decision is the caller's: the journal cannot know
how many ranks exist), a ``REMOVE`` when it evicts or drops an entry, and a ``CLEAR`` when
the cache is reset. Recording is a non-blocking append to an in-memory queue; a dedicated
thread running its own asyncio loop writes the queued records and fsyncs them in batches
every ``flush_interval_s`` (about 50 ms), so the engine's step never waits on disk. A record
that arrives after :meth:`Journal.close` (vLLM shutting down) is logged and dropped, never
raised into the caller.

Losing the last few records in a crash is harmless: an entry that is not journaled is simply
not recovered, and an entry that is journaled is verified against its slot header at start-up
and its payload checksum on every read, so a stale record can cost a miss, never wrong bytes.
What must not happen is losing records that :meth:`Journal.flush` reported durable, so:

* Appends go through one unbuffered ``O_APPEND`` descriptor, not an aiofiles file object:
  aiofiles' files are buffered, and after a failed write the buffer still held the failed
  batch, so the retry wrote it twice; the duplicate sequence numbers end replay, which then
  dropped everything after them. A raw descriptor holds nothing between calls. After any
  failure the file is cut back to its last durable size before the next append (no append
  happens while that cut fails). The blocking write+fsync of a batch runs as one call on the
  flusher loop's executor, which is all aiofiles would do for it.
* A compaction writes a temporary file, fsyncs it, renames it over the journal and fsyncs
  the directory. Once the rename happened the old descriptor is closed whatever fails next:
  the journal reopens the new file, and until the directory fsync succeeds no further record
  is reported durable (each append retries it first).
* Every file is opened through :mod:`tieredkv.disk.private_files` (no symlink followed, only
  our own single-link regular file; the temporary file is created ``O_EXCL`` after unlinking
  whatever had its name), so a planted link makes the journal refuse with
  :class:`~tieredkv.disk.private_files.UntrustedPathError` instead of writing elsewhere.

The file format and its replay are in :mod:`tieredkv.disk.journal_records`; a torn or corrupt
tail that replay ignored is cut off the next time the journal is opened for writing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import errno
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tieredkv.disk.errors import SlabError, slab_error_from_oserror
from tieredkv.disk.journal_records import (
    FILE_HEADER_BYTES,
    NO_KEY,
    JournalFiles,
    JournalReplay,
    Op,
    apply_record,
    encode_record,
    file_header,
    replay_journal,
)
from tieredkv.disk.private_files import ensure_private_dir
from tieredkv.keys import KEY_BYTES
from tieredkv.protocol import FailureCause

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_AFTER_FAILURE = {
    "append": "its records stay queued and are retried",
    "compaction": "not retried; appends go on into the file the journal path names",
}


# A running journal is rewritten once it holds this many records since its last rewrite
# (or 4x the live entries, whichever is more): bounded size, rare rewrites.
COMPACT_MIN_RECORDS = 1024


class Journal:
    """Append-only journal with a background flusher; see the module docstring."""

    def __init__(
        self, path: Path, flush_interval_s: float = 0.05, replay: JournalReplay | None = None,
        files: JournalFiles | None = None,
    ) -> None:
        """Open (or create, 0600) the journal for appending, cutting off a torn tail.

        ``replay``: the result of :meth:`replay` on this file, if the caller already has it.
        ``files``: the system calls to use (tests pass one that injects faults).
        Raises :class:`~tieredkv.disk.private_files.UntrustedPathError` when the journal's
        directory is not private or its path is a link or not our own regular file.
        """
        self.path = Path(path)
        self.flush_interval_s = flush_interval_s
        self._files = files if files is not None else JournalFiles()
        ensure_private_dir(self.path.parent)
        self.opened_replay = replay if replay is not None else Journal.replay(self.path)
        self._cond = threading.Condition()
        self._pending: list[Any] = []
        self._queued = 0  # items ever queued
        self._durable = 0  # items ever made durable (or superseded by a compaction)
        self._error: BaseException | None = None
        self._error_gen = 0
        self._failing = 0  # failed attempts since the last success (logs once per streak)
        self._stopping = False
        self._finished = False  # the flusher has exited: nothing queued becomes durable now
        self._closed = False
        self._next_seq = self.opened_replay.last_sequence + 1
        # The live index as the records describe it, kept for runtime compactions.
        self._live: dict[bytes, int] = dict(self.opened_replay.entries)
        self._owners: dict[int, bytes] = {slot: key for key, slot in self._live.items()}
        self._since_compaction = 0
        self.runtime_compactions = 0
        # The file: a descriptor (None between a compaction's rename and the reopen), the
        # bytes known durable in it, whether bytes past those may be there (a failed append,
        # a reopen) and whether the last rename still needs its directory fsync.
        self._fd: int | None = None
        self._size = 0
        self._dirty = False
        self._dir_unsynced = False
        self.records_written = 0
        self.write_errors = 0
        self.dropped_after_close = 0
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
        """Replay a journal file into ``key -> slot`` (see :func:`replay_journal`)."""
        return replay_journal(path)

    @staticmethod
    def recover(path: Path) -> dict[bytes, int]:
        """``key -> slot`` as the journal at ``path`` describes it (empty if absent)."""
        return Journal.replay(path).entries

    # -- recording (any thread, never blocks on disk) ------------------------------------

    def _queue(self, item: Any) -> bool:
        """Queue ``item`` for the flusher; False (and nothing queued) once closed."""
        with self._cond:
            if not self._stopping:
                self._pending.append(item)
                self._queued += 1
                return True
            self.dropped_after_close += 1
            dropped = self.dropped_after_close
        if dropped == 1:
            logger.warning(
                "tieredkv journal %s: a record arrived after close and was dropped (that entry "
                "is not recovered after a restart; later ones count in dropped_after_close)",
                self.path,
            )
        return False

    def _record(self, op: Op, key: bytes, slot: int) -> None:
        """Queue a record; past a bound, queue a compaction too, so the file never grows
        without limit on a long-running server (the caller never waits for it)."""
        if not self._queue((op, key, slot)):
            return
        apply_record(self._live, self._owners, op, key, slot)
        self._since_compaction += 1
        if self._since_compaction >= max(COMPACT_MIN_RECORDS, 4 * len(self._live)):
            self._since_compaction = 0
            if self._queue(_Compaction(dict(self._live), cf.Future())):
                self.runtime_compactions += 1
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
        self._record(Op.CLEAR, NO_KEY, 0)

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
                lambda: self._durable >= target or self._error_gen != generation or self._finished,
                timeout,
            )
            if self._durable >= target:
                return
            error = self._error
            finished = self._finished
        if isinstance(error, OSError):
            raise slab_error_from_oserror(error, "journal append", path=self.path) from error
        if error is not None:
            raise SlabError(FailureCause.IO_ERROR, f"journal append failed: {error}", path=self.path)
        if finished:
            raise SlabError(FailureCause.IO_ERROR, "journal flusher has stopped", path=self.path)
        raise SlabError(FailureCause.TIMEOUT, f"journal flush took over {timeout} s", path=self.path)

    def compact(self, entries: Mapping[bytes, int], timeout: float | None = 60.0) -> None:
        """Atomically rewrite the journal as exactly ``entries`` (one ADD each).

        ``entries`` must be the complete index as of this call: records queued before it are
        superseded, records queued after it are appended after the rewrite. A crash leaves
        either the old journal or the new one, never a mix. Raises SlabError when the rewrite
        is not known durable; the journal then goes on appending to whichever file the path
        names.
        """
        done: cf.Future[None] = cf.Future()
        self._live = dict(entries)
        self._owners = {slot: key for key, slot in self._live.items()}
        self._since_compaction = 0
        if not self._queue(_Compaction(dict(entries), done)):
            raise RuntimeError(f"journal {self.path} is closed")
        self._kick()
        try:
            done.result(timeout)
        except OSError as exc:
            raise slab_error_from_oserror(exc, "journal compaction", path=self.path) from exc
        except cf.TimeoutError:
            raise SlabError(
                FailureCause.TIMEOUT, f"journal compaction took over {timeout} s", path=self.path
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
            await self._blocking(self._open)
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
            self._close_fd()
            with self._cond:
                self._finished = True
                self._cond.notify_all()

    async def _blocking(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run a blocking file step on the loop's executor (one call per batch or rewrite)."""
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                self._files.close(fd)
            except OSError as exc:
                logger.warning("tieredkv journal %s: close failed: %s", self.path, exc)

    def _open(self) -> None:
        """Open the journal, writing a header into a new or unusable file, cutting a torn tail."""
        replay = self.opened_replay
        fd = self._files.open_log(self.path)
        try:
            os.fchmod(fd, 0o600)
            if not replay.header_ok or replay.valid_bytes == 0:
                self._files.truncate(fd, 0)
                self._files.write(fd, file_header())
                self._files.fsync(fd)
                self._size = FILE_HEADER_BYTES
            else:
                if replay.bad_tail_bytes:
                    self._files.truncate(fd, replay.valid_bytes)
                    self._files.fsync(fd)
                    logger.warning(
                        "tieredkv journal %s: cut off %d bytes of torn tail",
                        self.path, replay.bad_tail_bytes,
                    )
                self._size = replay.valid_bytes
        except BaseException:
            self._files.close(fd)
            raise
        self._fd = fd
        self._dirty = True  # a ``replay`` handed in may be older than the file: check first

    async def _drain(self) -> None:
        """Write out everything queued, in order; on failure requeue the rest for a retry."""
        with self._cond:
            items, self._pending = self._pending, []
        i = 0
        while i < len(items):
            item = items[i]
            if isinstance(item, _Compaction):
                try:
                    await self._blocking(self._compact, item.entries)
                except Exception as exc:
                    # Not retried: the caller waits on it and hears the error. The journal's
                    # own error state is set first, so a flush() the caller starts next sees
                    # this failure as already known rather than as a new one.
                    self._resolved(1)
                    self._failed(exc, items[i + 1 :], "compaction")
                    item.done.set_exception(exc)
                    return
                item.done.set_result(None)
                self._resolved(1)
                i += 1
                continue
            j = i
            while j < len(items) and not isinstance(items[j], _Compaction):
                j += 1
            try:
                await self._blocking(self._append, items[i:j])
            except Exception as exc:
                self._failed(exc, items[i:], "append")
                return
            self._resolved(j - i)
            i = j
        with self._cond:
            self._error = None
        if self._failing:
            logger.warning(
                "tieredkv journal %s: writing again after %d failed attempts", self.path, self._failing
            )
            self._failing = 0

    def _resolved(self, count: int) -> None:
        with self._cond:
            self._durable += count
            self._cond.notify_all()

    def _failed(self, exc: BaseException, rest: list[Any], what: str) -> None:
        self.write_errors += 1
        self._failing += 1
        log = logger.warning if self._failing == 1 else logger.debug
        log("tieredkv journal %s: %s failed (%s): %s", self.path, what, _AFTER_FAILURE[what], exc)
        with self._cond:
            self._pending[:0] = rest
            self._error = exc
            self._error_gen += 1
            self._cond.notify_all()

    def _ready(self) -> int:
        """The descriptor to append to, once the file is safe to append to after a failure.

        Reopens the path after a compaction, makes its rename durable, and cuts off whatever a
        failed append left past the durable size; raises (appending nothing) if any step fails.
        """
        if self._fd is None:
            self._fd = self._files.open_log(self.path)
            self._dirty = True
        if self._dir_unsynced:
            self._files.fsync_dir(self.path.parent)
            self._dir_unsynced = False
        if self._dirty:
            size = self._files.size(self._fd)
            if size < self._size:
                raise OSError(
                    errno.EIO, f"journal shrank to {size} bytes; {self._size} were made durable"
                )
            if size > self._size:
                self._files.truncate(self._fd, self._size)
            self._dirty = False
        return self._fd

    def _append(self, batch: list[tuple[Op, bytes, int]]) -> None:
        fd = self._ready()
        first_seq = self._next_seq
        data = b"".join(
            encode_record(op, key, slot, first_seq + i) for i, (op, key, slot) in enumerate(batch)
        )
        self._dirty = True  # part of the batch may reach the file even if this fails
        self._files.write(fd, data)
        self._files.fsync(fd)
        self._dirty = False
        self._next_seq += len(batch)
        self._size += len(data)
        self.records_written += len(batch)

    def _compact(self, entries: dict[bytes, int]) -> None:
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
        self._close_fd()
        self._size = len(data)
        self._next_seq = len(entries) + 1
        self._dir_unsynced = True
        self.records_written += len(entries)
        self._ready()

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


@dataclass
class _Compaction:
    entries: dict[bytes, int]
    done: cf.Future[None]
