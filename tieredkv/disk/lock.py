"""One engine per ``disk_path``: an advisory ``flock`` on ``<disk_path>/lock``.

Two engines sharing slab files would overwrite each other's slots and journals. ``flock`` is
released by the kernel when the holder dies (even on SIGKILL), so a crashed engine never
leaves a stale lock behind, and the pid written into the file lets the second engine say who
holds it. The file itself is never deleted: unlinking a lock file races with its next taker.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from tieredkv.config import ConfigError

LOCK_NAME = "lock"


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


class DiskLock:
    """An exclusive lock on a disk tier, held until :meth:`close` (or process exit)."""

    def __init__(self, disk_path: Path, name: str = LOCK_NAME) -> None:
        # Workers lock ``rank{r}.lock`` before opening their slab, so a second engine's
        # workers (started before its scheduler) fail before they touch a live slab file.
        self.disk_path = Path(disk_path)
        self.path = self.disk_path / name
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            pid = _read_pid(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                who = f"pid {pid}" if pid is not None else "pid unknown"
                raise ConfigError(
                    "disk_path", str(self.disk_path), f"already in use by another engine ({who})"
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

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
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    release = close

    def __enter__(self) -> DiskLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def holder(disk_path: Path) -> int | None:
        """The pid holding ``disk_path``'s lock, or None if it is free; never takes it away.

        Probes with a shared, non-blocking lock that is dropped at once. Returns -1 when the
        lock is held but the holder's pid is unreadable.
        """
        path = Path(disk_path) / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                pid = _read_pid(fd)
                return pid if pid is not None else -1
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)
