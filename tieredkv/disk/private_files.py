"""A disk tier's files at the operating system: who may touch them (only this user's private
files, and one engine), and the raw I/O on their descriptors.

Opening files under ``disk_path`` so that nothing planted there can redirect a write. The disk
tier writes into a directory that someone else might have been able to touch before the engine
started. Every open here refuses symlinks (``O_NOFOLLOW``), checks with ``fstat`` that it got a
regular file owned by this user, and the directory itself must be owned by this user and not
writable by group or others. Temporary files are created with ``O_EXCL`` after unlinking
whatever had their name, so a planted link is replaced, never followed.

One engine per ``disk_path``: :class:`DiskLock`, an open-file-description lock on
``<disk_path>/lock``. Two engines sharing slab files would overwrite each other's slots and
journals. The lock is a Linux OFD lock (``F_OFD_SETLK``, a write lock on the whole file): like
``flock`` it belongs to the open file, conflicts even within one process, and is released by
the kernel when the holder dies (even on SIGKILL), so a crashed engine never leaves a stale
lock behind. Unlike ``flock`` it can be *queried* without being taken (``F_OFD_GETLK``):
:meth:`DiskLock.holder` (``tieredkv inspect``/``verify``) never holds a lock, so a tool looking
at a tier can never make an engine starting at that moment fail. The pid written into the file
lets the second engine say who holds it. The file itself is never deleted: unlinking a lock
file races with its next taker. It is opened like every other file here (no symlink followed,
only our own regular file), after ``disk_path`` itself was checked.

Earlier builds locked with ``flock``, which does not see this lock nor it them: stop an old
engine before starting a new one on the same directory.

:class:`FileIO` is the one layer through which slab-file I/O reaches the operating system: its
:meth:`FileIO.open` is :func:`open_private`, and keeping every syscall of the slab path there
means a test can swap in :class:`tieredkv.testing.faulty_fileio.FaultyFileIO` and produce
ENOSPC, EIO, short reads and writes, bit flips, latency and hangs exactly where it wants them,
against real files, without patching ``os``. :class:`JournalFiles` is the same seam for the
journal's file (its opens and whole-buffer writes on top of :class:`FileIO`'s calls).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
import time
from pathlib import Path

from tieredkv.config import ConfigError
from tieredkv.disk.format import LOCK_NAME, lock_path


class UntrustedPathError(ValueError):
    """A path under (or being) ``disk_path`` is not safe to use; the message says why."""


def _owner_name(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def ensure_private_dir(path: Path | str, *, key: str = "disk_path") -> Path:
    """Create ``path`` 0700 if missing; refuse it unless it is a real directory we own alone.

    Raises :class:`UntrustedPathError` naming ``key`` when ``path`` is a symlink, not a
    directory, owned by another user, or writable by group or others.
    """
    path = Path(path)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        try:
            path.mkdir(mode=0o700, parents=True)
        except FileExistsError:
            pass  # created concurrently: checked below like any existing directory
        except OSError as exc:
            raise UntrustedPathError(
                f"tieredkv: {key} {str(path)!r} could not be created: {exc.strerror or exc}"
            ) from exc
        info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise UntrustedPathError(
            f"tieredkv: {key} {str(path)!r} is a symlink; give the real directory instead"
        )
    if not stat.S_ISDIR(info.st_mode):
        raise UntrustedPathError(f"tieredkv: {key} {str(path)!r} exists and is not a directory")
    uid = os.geteuid()
    if info.st_uid != uid:
        raise UntrustedPathError(
            f"tieredkv: {key} {str(path)!r} is owned by {_owner_name(info.st_uid)}, not by the "
            f"engine's user {_owner_name(uid)}; use a directory the engine's user owns"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UntrustedPathError(
            f"tieredkv: {key} {str(path)!r} is writable by group or others (mode "
            f"{stat.S_IMODE(info.st_mode):04o}); run `chmod 700 {path}` or use a private directory"
        )
    return path


def restrict_dir(path: Path | str, *, key: str = "disk_path") -> None:
    """Drop group and other access from a directory :func:`ensure_private_dir` accepted.

    Goes through a descriptor opened without following a link, so a directory swapped for a
    symlink meanwhile is refused, never chmodded through; the mode becomes 0700.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UntrustedPathError(
                f"tieredkv: {key} {str(path)!r} is not a real directory (a symlink?)"
            ) from exc
        raise
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid():
            raise UntrustedPathError(
                f"tieredkv: {key} {str(path)!r} is owned by {_owner_name(info.st_uid)}"
            )
        if stat.S_IMODE(info.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def check_private_fd(fd: int, path: Path | str) -> os.stat_result:
    """Refuse an open descriptor that is not a regular file owned by this user."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise UntrustedPathError(f"tieredkv: {str(path)!r} is not a regular file")
    if info.st_uid != os.geteuid():
        raise UntrustedPathError(
            f"tieredkv: {str(path)!r} is owned by {_owner_name(info.st_uid)}, not by the engine's user"
        )
    if info.st_nlink > 1:
        raise UntrustedPathError(
            f"tieredkv: {str(path)!r} has {info.st_nlink} hard links; tieredkv's files have one"
        )
    return info


def open_private(path: Path | str, flags: int, mode: int = 0o600) -> int:
    """``os.open`` that never follows a symlink and only returns our own regular file.

    A symlink at ``path`` fails with :class:`UntrustedPathError` (not a bare ELOOP), so the
    caller's log names the file; nothing is truncated or created through the link. ``O_TRUNC``
    is applied only after the checks pass, so a planted hard link is refused, not emptied.
    """
    truncate = bool(flags & os.O_TRUNC)
    try:
        fd = os.open(path, (flags & ~os.O_TRUNC) | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UntrustedPathError(
                f"tieredkv: {str(path)!r} is a symlink; tieredkv never follows links under disk_path"
            ) from exc
        raise
    try:
        check_private_fd(fd, path)
        if truncate:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_private_exclusive(path: Path | str, flags: int = os.O_WRONLY, mode: int = 0o600) -> int:
    """A new, empty file at ``path`` that nobody else could have prepared (temp files).

    Whatever had the name (a stale temp file, a planted symlink) is unlinked first; the link
    itself is removed, never its target. ``O_EXCL`` then guarantees the file is ours.
    """
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = open_private(path, flags | os.O_CREAT | os.O_EXCL, mode)
    os.fchmod(fd, mode)
    return fd


# -- the one-engine lock --------------------------------------------------------------------

# struct flock (Linux, 64-bit off_t): l_type, l_whence, l_start, l_len, l_pid; the kernel's
# struct is padded to 32 bytes, so the argument buffer is passed that long.
_FLOCK = struct.Struct("@hhqqi")
_FLOCK_BYTES = 32
# A lock held by someone whose pid is not (yet) in the file: an engine between taking the lock
# and writing its pid. Waiting this long for it to appear costs nothing when the lock is free.
_UNKNOWN_HOLDER_WAIT_S = 2.0
_UNKNOWN_HOLDER_POLL_S = 0.02


def _flock_arg(lock_type: int) -> bytes:
    return _FLOCK.pack(lock_type, os.SEEK_SET, 0, 0, 0).ljust(_FLOCK_BYTES, b"\0")


def _try_lock(fd: int) -> bool:
    """Take the whole-file OFD write lock without waiting; False if someone holds it."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock_arg(fcntl.F_WRLCK))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _is_locked(fd: int) -> bool:
    """Whether anyone holds a lock on the file that would conflict with ours (takes none)."""
    out = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _flock_arg(fcntl.F_WRLCK))
    return _FLOCK.unpack_from(out)[0] != fcntl.F_UNLCK


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


class DiskLock:
    """An exclusive lock on a disk tier, held until :meth:`close` (or process exit).

    Raises :class:`~tieredkv.config.ConfigError` (naming ``disk_path`` and the holder's pid)
    when another engine holds it, and
    :class:`~tieredkv.disk.private_files.UntrustedPathError` when ``disk_path`` is not a
    private directory of this user or the lock file is a link or not our own regular file.
    """

    def __init__(self, disk_path: Path, name: str = LOCK_NAME) -> None:
        # Workers lock ``rank{r}.lock`` before opening their slab, so a second engine's
        # workers (started before its scheduler) fail before they touch a live slab file.
        # This is also each process's first open under disk_path: check the directory here.
        self.disk_path = ensure_private_dir(Path(disk_path))
        self.path = self.disk_path / name
        fd = open_private(self.path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK, 0o600)
        try:
            self._acquire(fd)
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)  # drops the lock too, if it was taken
            raise
        self._fd: int | None = fd

    def _acquire(self, fd: int) -> None:
        deadline = time.monotonic() + _UNKNOWN_HOLDER_WAIT_S
        while not _try_lock(fd):
            pid = _read_pid(fd)
            if pid is None and time.monotonic() < deadline:
                time.sleep(_UNKNOWN_HOLDER_POLL_S)  # the holder has not written its pid yet
                continue
            who = f"pid {pid}" if pid is not None else "pid unknown"
            raise ConfigError(
                "disk_path", f"already in use by another engine ({who})", value=str(self.disk_path)
            )

    @property
    def held(self) -> bool:
        return self._fd is not None

    def close(self) -> None:
        """Release the lock (idempotent). The pid is cleared so tools do not report a ghost."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock_arg(fcntl.F_UNLCK))
        finally:
            os.close(fd)

    release = close

    def __enter__(self) -> DiskLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def holder(disk_path: Path) -> int | None:
        """The pid holding ``disk_path``'s lock, or None if it is free.

        Only queries the lock (``F_OFD_GETLK``); it takes none, not even briefly, so it never
        gets in the way of an engine taking the lock. Returns -1 when the lock is held but the
        holder's pid is unreadable. Raises UntrustedPathError if the lock file is a link or not
        our own regular file.
        """
        path = lock_path(disk_path)
        try:
            fd = open_private(path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        try:
            if not _is_locked(fd):
                return None
            pid = _read_pid(fd)
            return pid if pid is not None else -1
        finally:
            os.close(fd)


# -- raw I/O on the tier's descriptors ------------------------------------------------------


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

        A link at ``path`` raises :class:`UntrustedPathError` (a
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


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class JournalFiles(FileIO):
    """Every system call the journal makes on its files, one method per step: its opens, its
    whole-buffer write, its rename here; fsync, size, truncate, unlink and close are
    :class:`FileIO`'s, the same calls the slab makes.

    Opens go through :func:`open_private`; ``O_NONBLOCK`` makes a FIFO planted at the path fail
    at once instead of blocking the open (it means nothing for a regular file). Tests subclass
    this to fail one step (write, fsync, rename, directory fsync, reopen) with a real errno
    against real files.
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

    def replace(self, src: Path, dst: Path) -> None:
        os.replace(src, dst)  # renames a link at dst itself, never its target

    def fsync_dir(self, directory: Path) -> None:
        fsync_dir(directory)
