"""The journal's records and their file: the format, its replay, and the one descriptor the
journal appends to.

File format (little-endian): a 16-byte file header (magic ``TKVJRNL1``, version, reserved),
then fixed 56-byte records ``op:u8, pad:3, key:32s, slot:u64, sequence:u64, crc32:u32``, the
crc covering the 52 bytes before it. Replay stops at the first record that is torn, fails its
crc or does not continue the sequence: everything after it is ignored (counted and logged).
:class:`JournalFiles` is every system call the journal makes, so tests can fail any one.

:class:`JournalFile` is the file itself: one unbuffered ``O_APPEND`` descriptor and what is
known durable in it. Every step there is blocking and runs on the journal flusher's executor,
one call per batch or rewrite; why each step is the way it is (cut back after a failed append,
reopen and directory fsync after a rename, no link followed) is in
:mod:`tieredkv.disk.journal`'s docstring.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import zlib
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path

from tieredkv.disk.private_files import create_private_exclusive, open_private
from tieredkv.keys import KEY_BYTES

logger = logging.getLogger("tieredkv.disk.journal")  # one logger name for the journal's lines

JOURNAL_MAGIC = b"TKVJRNL1"
JOURNAL_VERSION = 1
_FILE_HEADER = struct.Struct("<8sII")
_BODY = struct.Struct(f"<B3x{KEY_BYTES}sQQ")
_CRC = struct.Struct("<I")
FILE_HEADER_BYTES = _FILE_HEADER.size
RECORD_BYTES = _BODY.size + _CRC.size
NO_KEY = bytes(KEY_BYTES)


class Op(IntEnum):
    ADD = 1
    REMOVE = 2
    CLEAR = 3


def file_header() -> bytes:
    return _FILE_HEADER.pack(JOURNAL_MAGIC, JOURNAL_VERSION, 0)


def encode_record(op: Op, key: bytes, slot: int, sequence: int) -> bytes:
    body = _BODY.pack(op, key, slot, sequence)
    return body + _CRC.pack(zlib.crc32(body))


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class JournalFiles:
    """Every system call the journal makes on its files, one method per step.

    Opens go through :mod:`tieredkv.disk.private_files`; ``O_NONBLOCK`` makes a FIFO planted
    at the path fail at once instead of blocking the open (it means nothing for a regular
    file). Tests subclass this to fail one step (write, fsync, rename, directory fsync,
    reopen) with a real errno against real files.
    """

    def open_log(self, path: Path) -> int:
        """The journal itself, for appending (created 0600 if missing)."""
        return open_private(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK)

    def open_read(self, path: Path) -> int:
        return open_private(path, os.O_RDONLY | os.O_NONBLOCK)

    def create_temp(self, path: Path) -> int:
        """A fresh compaction file; whatever had the name (a planted link) is replaced."""
        return create_private_exclusive(path, os.O_WRONLY | os.O_NONBLOCK)

    def write(self, fd: int, data: bytes) -> None:
        """Write all of ``data`` (a short write is continued; its error, if any, is raised)."""
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            if written <= 0:
                raise OSError(errno.EIO, "write accepted no bytes")
            view = view[written:]

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def size(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def truncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    def replace(self, src: Path, dst: Path) -> None:
        os.replace(src, dst)  # renames a link at dst itself, never its target

    def fsync_dir(self, directory: Path) -> None:
        fsync_dir(directory)

    def unlink(self, path: Path) -> None:
        os.unlink(path)

    def close(self, fd: int) -> None:
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
