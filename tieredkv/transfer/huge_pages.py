"""Transparent huge pages for CPU memory a load copies: the host tier and vLLM's CPU KV cache.

Why: a hit's load copies tens of MiB between two regions of 4 KiB pages, ~8,000 of each per
30 MiB. When the engine was busy elsewhere (other requests, other processes) their TLB
entries and page-table lines are cold, and in a VM each miss walks two levels of page tables:
on the 2-core CI VM a cold copy took about twice as long in 4 KiB pages as in 2 MiB pages.
``MADV_HUGEPAGE`` asks for 2 MiB pages where THP is ``madvise`` (the common default) or
``always``; memory already faulted in (vLLM zeroes its KV cache when it allocates it) is
rebuilt in huge pages at once only by ``MADV_COLLAPSE`` (Linux 6.1+). Neither changes a byte;
where THP is ``never`` or the kernel is older, they fail and nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

logger = logging.getLogger("tieredkv")

HUGE_PAGE_BYTES = 2 * 1024 * 1024
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25

_libc = None


def _madvise():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _libc.madvise.restype = ctypes.c_int
    return _libc.madvise


@dataclass(frozen=True)
class Advice:
    """What became of one region: the 2 MiB-aligned bytes inside it that were advised, and
    the errors (``os.strerror`` text) of either call, if any."""

    advised_bytes: int
    hugepage_error: str = ""
    collapse_error: str = ""

    @property
    def ok(self) -> bool:
        return self.advised_bytes > 0 and not self.hugepage_error and not self.collapse_error


def advise(ptr: int, nbytes: int, *, collapse: bool) -> Advice:
    """Ask for huge pages on the whole 2 MiB pages inside ``[ptr, ptr + nbytes)``; with
    ``collapse``, also rebuild the ones already faulted in (synchronous: one copy of them)."""
    lo = -(-ptr // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    hi = (ptr + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if hi <= lo or os.uname().sysname != "Linux":
        return Advice(0)
    madvise = _madvise()
    errors = []
    for advice in (MADV_HUGEPAGE, MADV_COLLAPSE) if collapse else (MADV_HUGEPAGE,):
        if madvise(lo, hi - lo, advice) != 0:
            code = ctypes.get_errno()
            errors.append(f"{os.strerror(code)} ({errno.errorcode.get(code, code)})")
        else:
            errors.append("")
    return Advice(hi - lo, *errors)


def advise_kv_caches(tensors: Iterable) -> None:
    """vLLM's CPU KV cache in huge pages: it is already zeroed, so its pages are rebuilt now
    (``MADV_COLLAPSE``, once, at start-up), each storage once; logged with the time taken."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    started = time.monotonic()
    results = [advise(ptr, n, collapse=True) for ptr, n in storages.items()]
    advised = sum(r.advised_bytes for r in results)
    errors = sorted({e for r in results for e in (r.hugepage_error, r.collapse_error) if e})
    logger.info(
        "tieredkv: vLLM's KV cache (%d MiB): huge pages %s in %.0f ms%s", sum(storages.values()) >> 20,
        f"asked for {advised >> 20} MiB" if advised else "not asked for (under 2 MiB)",
        (time.monotonic() - started) * 1e3, f"; not all granted: {', '.join(errors)}" if errors else "",
    )
