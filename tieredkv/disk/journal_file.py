"""The journal's file: one unbuffered ``O_APPEND`` descriptor and what is known durable in it.

Every step here is blocking and runs on the journal flusher's executor, one call per batch or
rewrite; why each step is the way it is (cut back after a failed append, reopen and directory
fsync after a rename, no link followed) is in :mod:`tieredkv.disk.journal`'s docstring.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

from tieredkv.disk.journal_records import (
    FILE_HEADER_BYTES,
    JournalFiles,
    JournalReplay,
    Op,
    encode_record,
    file_header,
)

logger = logging.getLogger("tieredkv.disk.journal")  # one logger name for the journal's lines


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
