"""The one layer through which slab-file I/O reaches the operating system.

Keeping every syscall of the slab path here means a test can swap in
:class:`tieredkv.testing.faulty_fileio.FaultyFileIO`
and produce ENOSPC, EIO, short reads and writes, bit flips, latency and hangs exactly where it
wants them, against real files, without patching ``os``.

:meth:`FileIO.open` goes through :mod:`tieredkv.disk.private_files`, so every slab-path open
(the slab files, the O_DIRECT probe file) refuses symlinks and anything that is not our own
regular file, with or without injected faults.
"""

from __future__ import annotations

import errno
import os

from tieredkv.disk.private_files import open_private


def _total(bufs: list[memoryview]) -> int:
    return sum(len(b) for b in bufs)


def _advance(bufs: list[memoryview], done: int) -> list[memoryview]:
    """The part of ``bufs`` that remains after the first ``done`` bytes."""
    rest: list[memoryview] = []
    for buf in bufs:
        if done >= len(buf):
            done -= len(buf)
            continue
        rest.append(buf[done:] if done else buf)
        done = 0
    return rest


def _until_done(syscall, fd: int, bufs: list[memoryview], offset: int) -> int:
    """Repeat a positional vector syscall until ``bufs`` are done or it moves 0 bytes."""
    want = _total(bufs)
    done = 0
    while done < want:
        moved = syscall(fd, bufs if done == 0 else _advance(bufs, done), offset + done)
        if moved == 0:
            break
        done += moved
    return done


class FileIO:
    """Positional file I/O on raw descriptors (no Python-level buffering, O_DIRECT-friendly)."""

    def open(self, path: str | os.PathLike[str], flags: int, mode: int = 0o600) -> int:
        """``os.open`` without following a symlink, returning only our own regular file.

        A link at ``path`` raises :class:`~tieredkv.disk.private_files.UntrustedPathError` (a
        ValueError, so it is not mistaken for an I/O failure); nothing is created, truncated or
        opened through it. ``O_NONBLOCK`` makes a FIFO planted there fail the check instead of
        blocking the open; on a regular file it changes nothing.
        """
        return open_private(path, flags | os.O_NONBLOCK, mode)

    def pread_into(self, fd: int, bufs: list[memoryview], offset: int) -> int:
        """Fill ``bufs`` from ``offset``; returns bytes read (less than asked only at EOF).

        A regular file returns a partial read only at end of file or on a signal; looping until
        a read returns 0 separates the two, so a short count always means "the bytes are not
        there".
        """
        return _until_done(os.preadv, fd, bufs, offset)

    def pwrite(self, fd: int, bufs: list[memoryview], offset: int) -> int:
        """Write all of ``bufs`` at ``offset``, looping on partial writes; returns bytes written.

        Returns less than asked only when the kernel accepted nothing more (a write returned 0);
        errors such as ENOSPC or EIO are raised as OSError.
        """
        return _until_done(os.pwritev, fd, bufs, offset)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def fallocate(self, fd: int, length: int) -> None:
        """Reserve ``length`` bytes so later slot writes cannot fail for lack of space."""
        try:
            os.posix_fallocate(fd, 0, length)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            # The filesystem cannot reserve blocks: a sparse file of the right size still works.
            if os.fstat(fd).st_size < length:
                os.ftruncate(fd, length)

    def truncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def size(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def advise_random(self, fd: int) -> None:
        """Slots are read whole and at random: readahead into a neighbour's payload is waste."""
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        except OSError:
            pass

    def close(self, fd: int) -> None:
        os.close(fd)

    def unlink(self, path: str | os.PathLike[str]) -> None:
        os.unlink(path)
