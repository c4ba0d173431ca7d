"""Opening files under ``disk_path`` so that nothing planted there can redirect a write.

The disk tier writes into a directory that someone else might have been able to touch before
the engine started. Every open here refuses symlinks (``O_NOFOLLOW``), checks with ``fstat``
that it got a regular file owned by this user, and the directory itself must be owned by this
user and not writable by group or others. Temporary files are created with ``O_EXCL`` after
unlinking whatever had their name, so a planted link is replaced, never followed.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


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
