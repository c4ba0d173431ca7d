"""The journal's file format and its replay: records, checksums, and what a file describes.

File format (little-endian): a 16-byte file header (magic ``TKVJRNL1``, version, reserved),
then fixed 56-byte records ``op:u8, pad:3, key:32s, slot:u64, sequence:u64, crc32:u32``, the
crc covering the 52 bytes before it. Replay stops at the first record that is torn, fails its
crc or does not continue the sequence: everything after it is ignored (counted and logged).
:class:`JournalFiles` is every system call the journal makes, so tests can fail any one.
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
