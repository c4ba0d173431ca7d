"""One rank's slab file: a preallocated array of fixed, self-describing disk slots.

Slot ``i`` starts at ``i * slot_stride`` and holds a 4 KiB header (see ``format``) followed by
the payload padded to 4 KiB (offsets, strides and file names: ``files``). Fixed slots mean no allocator on disk, no fragmentation and no
metadata to keep consistent: which key lives in which slot is the scheduler's index (and its
journal); the slot itself only has to prove, on every read, that it holds exactly that key's
bytes for this namespace.

Writes and reads are one positional ``pwritev``/``preadv`` of ``[header, payload]`` each, with
O_DIRECT where the filesystem allows: payload buffers come from the host tier, whose slots
are page-aligned and 4 KiB-padded, so no bounce copy is needed on the hot path.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import logging
import mmap
import os
import threading
import time
from pathlib import Path

from tieredkv.disk.errors import SlabError, slab_error_from_oserror
from tieredkv.disk.format import (
    HEADER_BYTES,
    PAGE_BYTES,
    SlotHeader,
    align_up,
    pack_header_into,
    payload_checksum,
    slot_offset,
    slot_stride,
    unpack_header,
)
from tieredkv.disk.private_files import FileIO, ensure_private_dir
from tieredkv.keys import FINGERPRINT_BYTES, KEY_BYTES
from tieredkv.protocol import FailureCause

logger = logging.getLogger(__name__)

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_warned_buffered: set[str] = set()
_warned_lock = threading.Lock()


def _aligned_buffer(size: int) -> mmap.mmap:
    """A page-aligned, zeroed buffer: anonymous mappings always start on a page boundary."""
    return mmap.mmap(-1, max(size, PAGE_BYTES), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def _is_aligned(view: memoryview) -> bool:
    """True if ``view`` starts on a 4 KiB boundary (read-only buffers are treated as not)."""
    if view.readonly or len(view) == 0:
        return False
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) % PAGE_BYTES == 0


def _as_bytes_view(buf: object) -> memoryview:
    view = memoryview(buf)  # type: ignore[arg-type]
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def _warn_buffered(directory: Path, why: str) -> None:
    key = str(directory)
    with _warned_lock:
        if key in _warned_buffered:
            return
        _warned_buffered.add(key)
    logger.warning(
        "tieredkv disk tier: O_DIRECT unavailable in %s (%s); using buffered I/O "
        "(every read is still verified; the page cache will hold spilled chunks)",
        directory, why,
    )


def probe_direct(directory: Path, io: FileIO) -> tuple[bool, str]:
    """Try one aligned O_DIRECT write and read of a scratch file in ``directory``.

    Some filesystems refuse O_DIRECT at open (EINVAL), others only at the first I/O; one real
    round trip answers both without touching slot data. Returns ``(ok, reason_if_not)``.
    The scratch file's name is predictable, so whatever has it (a stale probe, a planted
    symlink) is unlinked first and the file is created ``O_EXCL`` through ``io.open``, which
    never follows a link: nothing outside ``directory`` is written.
    """
    if not _O_DIRECT:
        return False, "this platform has no O_DIRECT"
    probe = directory / f".odirect-probe-{os.getpid()}-{threading.get_ident()}"
    _unlink_quietly(io, probe)
    try:
        fd = io.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | _O_DIRECT, 0o600)
    except OSError as exc:
        # Some filesystems create the file and only then refuse O_DIRECT: do not leave it.
        if exc.errno != errno.EEXIST:
            _unlink_quietly(io, probe)
        return False, f"open with O_DIRECT failed: {os.strerror(exc.errno or 0)}"
    buf = _aligned_buffer(PAGE_BYTES)
    try:
        view = memoryview(buf)
        view[:8] = b"tkvprobe"
        if io.pwrite(fd, [view], 0) != PAGE_BYTES:
            return False, "O_DIRECT probe write was short"
        view[:8] = bytes(8)
        if io.pread_into(fd, [view], 0) != PAGE_BYTES or bytes(view[:8]) != b"tkvprobe":
            return False, "O_DIRECT probe read did not return what was written"
        return True, ""
    except OSError as exc:
        return False, f"O_DIRECT I/O failed: {os.strerror(exc.errno or 0)}"
    finally:
        view.release()
        buf.close()
        try:
            io.close(fd)
        finally:
            _unlink_quietly(io, probe)


def _unlink_quietly(io: FileIO, path: Path) -> None:
    try:
        io.unlink(path)
    except OSError:
        pass


class _ThreadBuffers(threading.local):
    """Per-thread aligned header and bounce buffers, so concurrent slots never share one."""

    header: mmap.mmap | None = None
    header_view: memoryview | None = None
    bounce: mmap.mmap | None = None
    bounce_view: memoryview | None = None


class SlabFile:
    """``num_slots`` slots of ``payload_bytes`` each in one file; safe for concurrent slots.

    Calls on *different* slots may run concurrently from any threads (positional I/O, per-thread
    buffers). Two concurrent calls on the *same* slot are the caller's bug: the scheduler's
    index never issues them.
    """

    def __init__(
        self, path: Path, fd: int, num_slots: int, payload_bytes: int, fingerprint: bytes,
        io: FileIO, direct: bool, readonly: bool,
    ) -> None:
        self.path = path
        self.num_slots = num_slots
        self.payload_bytes = payload_bytes
        self.padded_bytes = align_up(payload_bytes)
        self.slot_stride = slot_stride(payload_bytes)
        self.fingerprint = fingerprint
        self.direct = direct
        self.readonly = readonly
        self._io = io
        self._fd = fd
        self._lock = threading.Lock()
        self._inflight = 0
        self._closing = False
        self._tls = _ThreadBuffers()
        self._zero_header = memoryview(_aligned_buffer(HEADER_BYTES))
        # Unique and increasing across restarts as long as the clock does not go backwards.
        self._sequence = itertools.count(time.time_ns())

    # -- opening ------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        path: Path,
        num_slots: int,
        payload_bytes: int,
        fingerprint: bytes,
        io: FileIO | None = None,
        direct: bool | None = None,
        *,
        create: bool = True,
        readonly: bool = False,
    ) -> SlabFile:
        """Open (and by default create and size) a slab file.

        ``create=True`` (a worker's own slab): create it 0600 if absent and preallocate or
        trim it to exactly ``num_slots`` slots, so a full disk shows up now, not mid-spill.
        ``create=False`` (catalog, tools): the file must exist (else ``missing``) and is used
        as it is; slots past its end read as ``short_read``. ``direct=None`` probes O_DIRECT
        once in the file's directory and falls back to buffered I/O with one warning.

        With ``create=True`` the directory is first checked (created 0700 if missing) with
        :func:`~tieredkv.disk.private_files.ensure_private_dir`; the file is never opened
        through a symlink. Both refusals raise
        :class:`~tieredkv.disk.private_files.UntrustedPathError` (a ValueError, not a
        SlabError: an unsafe directory is a start-up error, not a slot failure).
        """
        path = Path(path)
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        if payload_bytes <= 0:
            raise ValueError(f"payload_bytes must be > 0, got {payload_bytes}")
        if len(fingerprint) != FINGERPRINT_BYTES:
            raise ValueError(f"fingerprint must be {FINGERPRINT_BYTES} bytes")
        io = io or FileIO()
        readonly = readonly and not create
        if create:
            ensure_private_dir(path.parent)
        elif not os.path.lexists(path):
            raise SlabError(FailureCause.MISSING, "slab file does not exist", path=path)
        if direct is None:
            directory = path.parent
            direct, why = probe_direct(directory, io) if not readonly else (False, "read-only")
            if not direct and not readonly:
                _warn_buffered(directory, why)
        flags = os.O_RDONLY if readonly else os.O_RDWR
        if create:
            flags |= os.O_CREAT
        if direct:
            flags |= _O_DIRECT
        try:
            fd = io.open(path, flags, 0o600)
        except OSError as exc:
            raise slab_error_from_oserror(exc, "open", path=path) from exc
        try:
            if create:
                os.fchmod(fd, 0o600)  # an existing file of ours keeps no wider mode
                target = num_slots * slot_stride(payload_bytes)
                size = io.size(fd)
                if size < target:
                    io.fallocate(fd, target)
                elif size > target:
                    io.truncate(fd, target)
            if not direct:
                io.advise_random(fd)
        except OSError as exc:
            io.close(fd)
            raise slab_error_from_oserror(exc, "preallocate", path=path) from exc
        slab = cls(path, fd, num_slots, payload_bytes, fingerprint, io, direct, readonly)
        logger.debug(
            "tieredkv slab %s: %d slots x %d bytes (%s)",
            path, num_slots, slab.slot_stride, "O_DIRECT" if direct else "buffered",
        )
        return slab

    # -- helpers ------------------------------------------------------------------------

    def slot_offset(self, slot: int) -> int:
        """Byte offset of ``slot``'s header in the file."""
        return slot_offset(slot, self.slot_stride)

    def _check(self, slot: int, key: bytes | None = None) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"disk slot {slot} out of range 0..{self.num_slots - 1}")
        if key is not None and len(key) != KEY_BYTES:
            raise ValueError(f"key must be {KEY_BYTES} bytes, got {len(key)}")

    def _acquire(self, slot: int) -> int:
        with self._lock:
            if self._closing:
                raise SlabError(FailureCause.MISSING, "slab file is closed", slot=slot, path=self.path)
            self._inflight += 1
            return self._fd

    def _release(self) -> None:
        with self._lock:
            self._inflight -= 1
            if self._closing and self._inflight == 0:
                self._close_fd()

    def _close_fd(self) -> None:
        # Only with no I/O in flight: a descriptor number closed under a running pwritev could be
        # reused by another file, and the write would land there.
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            self._io.close(fd)

    def _header_buffer(self) -> memoryview:
        tls = self._tls
        if tls.header_view is None:
            tls.header = _aligned_buffer(HEADER_BYTES)
            tls.header_view = memoryview(tls.header)
        return tls.header_view

    def _bounce_buffer(self) -> memoryview:
        tls = self._tls
        if tls.bounce_view is None:
            tls.bounce = _aligned_buffer(self.padded_bytes)
            tls.bounce_view = memoryview(tls.bounce)[: self.padded_bytes]
        return tls.bounce_view

    def _direct_ok(self, view: memoryview) -> bool:
        return len(view) >= self.padded_bytes and _is_aligned(view)

    # -- slot I/O -----------------------------------------------------------------------

    def write_slot(
        self, slot: int, key: bytes, payload: memoryview, aliases: tuple[bytes, ...] = ()
    ) -> None:
        """Write ``key``'s payload and header into ``slot`` with one ``pwritev``.

        ``aliases``: the keys of the entry's other blocks, listed in the header (see
        :mod:`tieredkv.disk.format`) so that a restart finds the entry by any of its blocks.

        ``payload`` is normally a host-tier slot (``HostPool.slot_memoryview``): page-aligned
        and ``align_up(payload_bytes)`` long, written as is; anything else is first copied to an
        aligned per-thread buffer when O_DIRECT needs it. Only the first ``payload_bytes``
        count.

        Crash safety: header and payload go out in one call, but nothing makes a multi-page
        write atomic: after a crash any subset of its pages may have reached the disk. That is
        safe because the header carries the xxh3 checksum of *this* payload and is itself
        checksummed. A new header over a half-old payload, an old header over a half-new
        payload, or a torn header all fail verification on read (``checksum``); and an old
        header with its old, complete payload is still exactly the old key's bytes, which the
        header names. Ordering the payload first and the header last would add a second
        syscall and still need an fsync between them to mean anything; the checksum gives the
        guarantee without either. The scheduler journals the entry only after every rank
        confirmed its write, and every read verifies, so no fsync is needed per slot.
        """
        self._check(slot, key)
        if self.readonly:
            raise ValueError(f"{self.path} was opened read-only")
        view = _as_bytes_view(payload)
        if len(view) < self.payload_bytes:
            raise ValueError(f"payload has {len(view)} bytes, slot needs {self.payload_bytes}")
        data = view[: self.payload_bytes]
        if self.direct and not self._direct_ok(view):
            body = self._bounce_buffer()
            body[: self.payload_bytes] = data
        elif len(view) >= self.padded_bytes:
            body = view[: self.padded_bytes]
        else:
            body = data
        header = self._header_buffer()
        pack_header_into(
            header, fingerprint=self.fingerprint, key=key, payload_len=self.payload_bytes,
            checksum=payload_checksum(data), sequence=next(self._sequence), aliases=aliases,
        )
        self._write_at(slot, [header, body], "write")

    def read_slot_into(self, slot: int, key: bytes, out: memoryview) -> SlotHeader:
        """Read ``slot`` into ``out`` with one ``preadv`` and prove it is ``key``'s payload.

        Checks magic, format version, header checksum, namespace fingerprint
        (``wrong_namespace``), key (``wrong_key``), length and the payload checksum
        (``checksum``); a truncated file gives ``short_read``, an OSError ``io_error``. On any
        failure the content of ``out`` is undefined and must not be used.
        """
        self._check(slot, key)
        view = _as_bytes_view(out)
        if view.readonly:
            raise ValueError("out must be writable")
        if len(view) < self.payload_bytes:
            raise ValueError(f"out has {len(view)} bytes, slot needs {self.payload_bytes}")
        bounced = self.direct and not self._direct_ok(view)
        if bounced:
            body = self._bounce_buffer()
        elif len(view) >= self.padded_bytes:
            body = view[: self.padded_bytes]
        else:
            body = view[: self.payload_bytes]
        header_buf = self._header_buffer()
        fd = self._acquire(slot)
        try:
            got = self._io.pread_into(fd, [header_buf, body], self.slot_offset(slot))
        except OSError as exc:
            raise slab_error_from_oserror(exc, "read", slot=slot, path=self.path) from exc
        finally:
            self._release()
        need = HEADER_BYTES + self.payload_bytes
        if got < need:
            raise SlabError(
                FailureCause.SHORT_READ, f"read {got} of {need} bytes", slot=slot, path=self.path
            )
        header = self._verify_header(header_buf, slot, key)
        data = body[: self.payload_bytes]
        actual = payload_checksum(data)
        if actual != header.checksum:
            raise SlabError(
                FailureCause.CHECKSUM,
                f"payload checksum {actual:#018x}, header says {header.checksum:#018x}",
                slot=slot, path=self.path,
            )
        if bounced:
            view[: self.payload_bytes] = data
        return header

    def read_header(self, slot: int, key: bytes | None = None) -> SlotHeader:
        """Read and verify only ``slot``'s 4 KiB header (no payload checksum); cheap enough to
        check every journaled entry at start-up. ``key`` is checked when given."""
        self._check(slot, key)
        header_buf = self._header_buffer()
        fd = self._acquire(slot)
        try:
            got = self._io.pread_into(fd, [header_buf], self.slot_offset(slot))
        except OSError as exc:
            raise slab_error_from_oserror(exc, "read header", slot=slot, path=self.path) from exc
        finally:
            self._release()
        if got < HEADER_BYTES:
            raise SlabError(
                FailureCause.SHORT_READ, f"read {got} of {HEADER_BYTES} header bytes",
                slot=slot, path=self.path,
            )
        return self._verify_header(header_buf, slot, key)

    def _verify_header(self, buf: memoryview, slot: int, key: bytes | None) -> SlotHeader:
        header = unpack_header(buf, slot=slot, path=self.path)
        if header.fingerprint != self.fingerprint:
            raise SlabError(
                FailureCause.WRONG_NAMESPACE, "slot belongs to another namespace",
                slot=slot, path=self.path,
            )
        if header.payload_len != self.payload_bytes:
            raise SlabError(
                FailureCause.WRONG_NAMESPACE,
                f"payload length {header.payload_len}, expected {self.payload_bytes}",
                slot=slot, path=self.path,
            )
        if key is not None and header.key != key:
            raise SlabError(
                FailureCause.WRONG_KEY, f"slot holds key {header.key.hex()[:16]}...",
                slot=slot, path=self.path,
            )
        return header

    def invalidate_slot(self, slot: int) -> None:
        """Zero ``slot``'s header so it reads as ``missing`` until written again."""
        self._check(slot)
        if self.readonly:
            raise ValueError(f"{self.path} was opened read-only")
        self._write_at(slot, [self._zero_header], "invalidate")

    def _write_at(self, slot: int, bufs: list[memoryview], action: str) -> None:
        """One positional write at the slot's start; an error or a short write is a SlabError."""
        want = sum(len(buf) for buf in bufs)
        fd = self._acquire(slot)
        try:
            written = self._io.pwrite(fd, bufs, self.slot_offset(slot))
        except OSError as exc:
            raise slab_error_from_oserror(exc, action, slot=slot, path=self.path) from exc
        finally:
            self._release()
        if written != want:
            raise SlabError(
                FailureCause.IO_ERROR, f"short write: {written} of {want} bytes",
                slot=slot, path=self.path,
            )

    def sync(self) -> None:
        """Make every completed write durable (for tools; the hot path relies on checksums)."""
        fd = self._acquire(-1)
        try:
            self._io.fsync(fd)
        except OSError as exc:
            raise slab_error_from_oserror(exc, "fsync", path=self.path) from exc
        finally:
            self._release()

    def close(self) -> None:
        """Close the file; I/O still in flight finishes first, later calls fail ``missing``."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            if self._inflight == 0:
                self._close_fd()

    @property
    def closed(self) -> bool:
        return self._closing

    def __enter__(self) -> SlabFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "O_DIRECT" if self.direct else "buffered"
        return f"SlabFile({self.path}, {self.num_slots} slots x {self.slot_stride} B, {mode})"

