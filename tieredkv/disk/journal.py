"""The scheduler's append-only journal of the disk index, so a restart finds its prefixes.

The scheduler half owns the index (key -> disk slot). It records an ``ADD`` only after *every*
TP rank has confirmed its slot write (that decision is the caller's: the journal cannot know
how many ranks exist) and a ``REMOVE`` when it evicts or drops an entry. Recording is a
non-blocking append to an in-memory queue (a reset is not: see below); a dedicated
thread running its own asyncio loop writes the queued records and fsyncs them in batches
every ``flush_interval_s`` (about 50 ms), so the engine's step never waits on disk. A record
that arrives after :meth:`Journal.close` (vLLM shutting down) is logged and dropped, never
raised into the caller.

While writes fail (a full disk) the queue is bounded and retries back off
(:mod:`tieredkv.disk.journal_file`'s backlog): past ``max_backlog`` records the journal stops
queueing, counts what it drops (``records_dropped``), logs once, and its next write rebuilds
the file from the live index it keeps, which says everything the dropped records would have.

A reset (:meth:`Journal.clear`, the cache's ``reset_cache``) is durable before it returns:
every entry is stale then, yet its slot header would still verify at a restart. It drops
what is queued and cuts the file back to its header (``ftruncate`` needs no free space).

Losing the last few records in a crash is harmless: an entry that is not journaled is simply
not recovered, and an entry that is journaled is verified against its slot header at start-up
and its payload checksum on every read, so a stale record can cost a miss, never wrong bytes.
What must not happen is losing records that :meth:`Journal.flush` reported durable (a flush
that returned covers every record recorded before it, dropped ones included: it waits for the
rebuild), so:

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

The file format and its replay are in :mod:`tieredkv.disk.journal_file`; a torn or corrupt
tail that replay ignored is cut off the next time the journal is opened for writing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from tieredkv.disk import journal_file
from tieredkv.disk.errors import SlabError, slab_error_from_oserror
from tieredkv.disk.journal_file import (
    Backlog,
    Cleared,
    Compaction,
    JournalFile,
    JournalReplay,
    Op,
    RetryBackoff,
    apply_record,
    replay_journal,
)
from tieredkv.disk.private_files import JournalFiles, ensure_private_dir
from tieredkv.keys import KEY_BYTES
from tieredkv.protocol import FailureCause

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_AFTER_FAILURE = {
    "append": "its records stay queued, up to the backlog's cap, and are retried with backoff",
    "compaction": "not retried; appends go on into the file the journal path names",
    "rebuild": "retried with backoff; records stay dropped until it succeeds",
    "reset": "retried with backoff; the caller heard the error",
}


# A running journal is rewritten once it holds this many records since its last rewrite
# (or 4x the live entries, whichever is more): bounded size, rare rewrites.
COMPACT_MIN_RECORDS = 1024


class Journal:
    """Append-only journal with a background flusher; see the module docstring."""

    def __init__(
        self, path: Path, flush_interval_s: float = 0.05, replay: JournalReplay | None = None,
        files: JournalFiles | None = None, max_backlog: int | None = None,
        backoff: RetryBackoff | None = None,
        new_loop: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop,
    ) -> None:
        """Open (or create, 0600) the journal for appending, cutting off a torn tail.

        ``replay``: the result of :meth:`replay` on this file, if the caller already has it.
        ``files``: the system calls to use (tests pass one that injects faults).
        ``max_backlog``: records queued at most while writes fail (default
        ``BACKLOG_MAX_RECORDS``, read at each call); ``backoff``: the waits
        between failed attempts (see :mod:`tieredkv.disk.journal_file`).
        ``new_loop``: makes the flusher's event loop, whose clock times its waits (tests pass
        one on a clock they move, to check the backoff without measuring time).
        Raises :class:`~tieredkv.disk.private_files.UntrustedPathError` when the journal's
        directory is not private or its path is a link or not our own regular file.
        """
        self.path = Path(path)
        self.flush_interval_s = flush_interval_s
        self._files = files if files is not None else JournalFiles()
        ensure_private_dir(self.path.parent)
        self.opened_replay = replay if replay is not None else Journal.replay(self.path)
        self._cond = threading.Condition()
        self._backlog = Backlog(max_backlog or journal_file.BACKLOG_MAX_RECORDS)
        self._backoff = backoff if backoff is not None else RetryBackoff()
        self._queued = 0  # items ever recorded (dropped ones too)
        self._durable = 0  # items ever made durable (or superseded by a compaction)
        self._error: BaseException | None = None
        self._error_gen = 0
        self._failing = 0  # failed attempts since the last success (logs once per streak)
        self._stopping = False
        self._finished = False  # the flusher has exited: nothing queued becomes durable now
        self._closed = False
        # The live index as the records describe it (dropped ones too), kept for compactions
        # and rebuilds; changed under _cond, since a rebuild copies it on the flusher thread.
        self._live: dict[bytes, int] = dict(self.opened_replay.entries)
        self._owners: dict[int, bytes] = {slot: key for key, slot in self._live.items()}
        self._since_compaction = 0
        self.runtime_compactions = 0
        self.rebuilds = 0
        self._file = JournalFile(self.path, self._files, self.opened_replay)
        self.write_errors = 0
        self.dropped_after_close = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._new_loop = new_loop
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

    # -- recording (any thread, never blocks on disk) ------------------------------------

    @property
    def records_written(self) -> int:
        """Records written to the file (a compaction's count its entries)."""
        return self._file.records_written

    @property
    def records_dropped(self) -> int:
        """Records dropped because the backlog was full (each covered by a rebuild)."""
        return self._backlog.dropped

    @property
    def overflowing(self) -> bool:
        """True from an overflow until its rebuild is durable."""
        with self._cond:
            return self._backlog.episode

    def _closed_drop(self) -> None:
        """Count (and log the first) record that arrived after close."""
        self.dropped_after_close += 1
        if self.dropped_after_close == 1:
            logger.warning(
                "tieredkv journal %s: a record arrived after close and was dropped (that entry "
                "is not recovered after a restart; later ones count in dropped_after_close)",
                self.path,
            )

    def _record(self, op: Op, key: bytes, slot: int) -> None:
        """Queue a record (or drop it, see :class:`Backlog`); past a bound, queue a compaction
        too, so the file never grows without limit on a long-running server (the caller never
        waits for it)."""
        with self._cond:
            if self._stopping:
                self._closed_drop()
                return
            self._queued += 1
            apply_record(self._live, self._owners, op, key, slot)
            started = self._backlog.add((op, key, slot))
            self._since_compaction += 1
            if not self._backlog.overflowing and self._since_compaction >= max(
                COMPACT_MIN_RECORDS, 4 * len(self._live)
            ):
                # Written at the flusher's next turn: a kick would bypass the backoff.
                self._since_compaction = 0
                self._queued += 1
                self._backlog.add(Compaction(dict(self._live), cf.Future()))
                self.runtime_compactions += 1
        if started:  # in the caller's thread, once per episode
            logger.warning(
                "tieredkv journal %s: %d records wait while writes fail; dropping records until "
                "the journal is rebuilt from the live index (entries spilled meanwhile are not "
                "recovered if the engine dies before then; dropped records count in "
                "journal_records_dropped)", self.path, self._backlog.limit,
            )

    def record_add(self, key: bytes, slot: int) -> None:
        """Journal ``key`` at ``slot``; call only once every rank confirmed its write."""
        if len(key) != KEY_BYTES:
            raise ValueError(f"key must be {KEY_BYTES} bytes, got {len(key)}")
        self._record(Op.ADD, key, slot)

    def record_remove(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"key must be {KEY_BYTES} bytes, got {len(key)}")
        self._record(Op.REMOVE, key, 0)

    def clear(self, timeout: float | None = 10.0) -> None:
        """Forget every entry, durably before returning (see the module docstring); raises
        SlabError if that is not known durable (it is retried before anything else)."""
        done: cf.Future[None] = cf.Future()
        with self._cond:
            if self._stopping:
                raise SlabError(FailureCause.IO_ERROR, "journal is closed", path=self.path)
            self._live.clear()
            self._owners.clear()
            self._since_compaction = 0
            self._queued += 1
            self._backlog.clear(Cleared([done], self._queued))
        self._kick()
        self._await(done, timeout, "journal reset")

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
        with self._cond:
            if self._stopping:
                raise RuntimeError(f"journal {self.path} is closed")
            self._live = dict(entries)
            self._owners = {slot: key for key, slot in self._live.items()}
            self._since_compaction = 0
            self._queued += 1
            self._backlog.add(Compaction(dict(entries), done))
        self._kick()
        self._await(done, timeout, "journal compaction")

    def _await(self, done: cf.Future[None], timeout: float | None, what: str) -> None:
        """Wait for the flusher to resolve ``done``; its OSError or a timeout as SlabError."""
        try:
            done.result(timeout)
        except OSError as exc:
            raise slab_error_from_oserror(exc, what, path=self.path) from exc
        except cf.TimeoutError:
            raise SlabError(FailureCause.TIMEOUT, f"{what} took over {timeout} s",
                            path=self.path) from None

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
        loop = self._new_loop()
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
            await self._blocking(self._file.open)
        except BaseException as exc:
            started.set_exception(exc)
            return
        started.set_result(None)
        try:
            while True:
                # A failing disk is retried after the backoff's delay, not every interval; a
                # caller waiting (flush, compact, close) wakes the loop at once.
                wait = max(self.flush_interval_s, self._backoff.delay)
                try:
                    await asyncio.wait_for(self._wake.wait(), wait)
                except TimeoutError:
                    pass
                self._wake.clear()
                await self._drain()
                with self._cond:
                    if self._stopping and (not self._backlog.items or self._error is not None):
                        break
        finally:
            self._file.close()
            with self._cond:
                self._finished = True
                self._cond.notify_all()

    async def _blocking(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run a blocking file step on the loop's executor (one call per batch or rewrite)."""
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def _drain(self) -> None:
        """Write out everything queued, in order; on failure requeue the rest for a retry.

        A pending reset goes first; after an overflow the next write is the rebuild, then
        whatever was queued after it.
        """
        with self._cond:
            cleared = self._backlog.take_clear()
        if cleared is not None and not await self._clear(cleared, []):
            return
        with self._cond:
            rebuild = self._backlog.overflowing
            if rebuild:  # the snapshot and its place in the order, taken together
                entries, covered = dict(self._live), self._queued
                waiters = self._backlog.rebuilding()
        if rebuild and not await self._rebuild(entries, covered, waiters):
            return
        with self._cond:
            items = self._backlog.take()
        if not items:
            if rebuild:
                self._succeeded()
            return
        i = 0
        while i < len(items):
            item = items[i]
            if isinstance(item, Cleared):  # arrived after the first look
                if not await self._clear(item, items[i + 1 :]):
                    return
                i += 1
                continue
            if isinstance(item, Compaction):
                try:
                    await self._blocking(self._file.compact, item.entries)
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
            while j < len(items) and not isinstance(items[j], (Compaction, Cleared)):
                j += 1
            try:
                await self._blocking(self._file.append, items[i:j])
            except Exception as exc:
                self._failed(exc, items[i:], "append")
                return
            self._resolved(j - i, records=j - i)
            i = j
        self._succeeded()

    async def _rebuild(
        self, entries: dict[bytes, int], covered: int, waiters: list[cf.Future[None]]
    ) -> bool:
        """Rewrite the journal from the live index after an overflow; True once durable."""
        try:
            await self._blocking(self._file.compact, entries)
        except Exception as exc:
            with self._cond:
                self._backlog.rebuild_failed()
            self._failed(exc, [], "rebuild")
            for done in waiters:
                done.set_exception(exc)
            return False
        with self._cond:
            self._durable = max(self._durable, covered)  # every record up to the snapshot
            dropped = self._backlog.rebuilt()
            self._cond.notify_all()
        for done in waiters:
            done.set_result(None)
        self.rebuilds += 1
        logger.warning(
            "tieredkv journal %s: rebuilt from the live index (%d entries), covering %d dropped "
            "records; journaling again", self.path, len(entries), dropped,
        )
        return True

    async def _clear(self, item: Cleared, rest: list[Any]) -> bool:
        """Cut the journal back to no entries (see :meth:`clear`); True once durable."""
        try:
            await self._blocking(self._file.clear)
        except Exception as exc:
            self._failed(exc, [Cleared([], item.covered), *rest], "reset")
            for done in item.dones:
                done.set_exception(exc)
            return False
        with self._cond:
            self._durable = max(self._durable, item.covered)  # all before it is moot
            self._cond.notify_all()
        for done in item.dones:
            done.set_result(None)
        self._succeeded()
        return True

    def _succeeded(self) -> None:
        with self._cond:
            self._error = None
        self._backoff.succeeded()
        if self._failing:
            logger.warning(
                "tieredkv journal %s: writing again after %d failed attempts", self.path, self._failing
            )
            self._failing = 0

    def _resolved(self, count: int, records: int = 0) -> None:
        with self._cond:
            self._durable += count
            self._backlog.written(records)
            self._cond.notify_all()

    def _failed(self, exc: BaseException, rest: list[Any], what: str) -> None:
        self.write_errors += 1
        self._failing += 1
        delay = self._backoff.failed()
        log = logger.warning if self._failing == 1 else logger.debug
        log("tieredkv journal %s: %s failed (%s; next try in %.2f s): %s",
            self.path, what, _AFTER_FAILURE[what], delay, exc)
        exc.with_traceback(None)  # its frames would pin the failed batch (up to the cap)
        with self._cond:
            self._backlog.requeue(rest)
            self._error = exc
            self._error_gen += 1
            self._cond.notify_all()
