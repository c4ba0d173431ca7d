"""Typed failures of the disk tier.

Every way a slot can fail to give back its exact bytes has a name, so callers count and drop
entries by kind instead of parsing messages, and a failure can never be confused with data.
"""

from __future__ import annotations

import errno
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from tieredkv.protocol import FailureCause


class SlabError(Exception):
    """A disk-tier operation failed; ``kind`` says how, the message says where.

    ``pending`` is set only for timeouts: the I/O that timed out may still be running in a pool
    thread, and the buffer it was given must not be reused until that future is done.
    """

    def __init__(
        self,
        kind: FailureCause,
        message: str,
        *,
        slot: int | None = None,
        path: Path | str | None = None,
        pending: Future[Any] | None = None,
    ) -> None:
        where = []
        if slot is not None:
            where.append(f"slot {slot}")
        if path is not None:
            where.append(str(path))
        suffix = f" ({', '.join(where)})" if where else ""
        super().__init__(f"{kind.value}: {message}{suffix}")
        self.kind = kind
        self.slot = slot
        self.path = path
        self.pending = pending


_NO_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_MISSING_ERRNOS = {errno.ENOENT}


def kind_for_oserror(exc: OSError) -> FailureCause:
    """Map an OSError to the failure kind a caller acts on (full disk is not a broken disk)."""
    if exc.errno in _NO_SPACE_ERRNOS:
        return FailureCause.NO_SPACE
    if exc.errno in _MISSING_ERRNOS:
        return FailureCause.MISSING
    return FailureCause.IO_ERROR


def slab_error_from_oserror(
    exc: OSError, action: str, *, slot: int | None = None, path: Path | str | None = None
) -> SlabError:
    """A SlabError for an OSError raised while doing ``action``; keeps errno in the message."""
    name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return SlabError(
        kind_for_oserror(exc), f"{action} failed: [{name}] {exc.strerror or exc}", slot=slot, path=path
    )
