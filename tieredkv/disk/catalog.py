"""The scheduler-side owner of a ``disk_path``: lock, manifest, journal and recovery.

At start-up it answers one question: which ``key -> slot`` entries from the last run can this
engine trust? Only those whose manifest matches this engine's namespace and slot geometry,
whose journal records are intact, and whose slot header on *every* rank's slab file names the
right key. Everything else is dropped and counted by :class:`FailureCause`. Payloads are not
read here (that would read the whole disk at start-up); every later read verifies them.

Slab files belong to the workers (each rank opens and sizes its own ``rank{r}.slab``); the
catalog only reads their headers. When the manifest does not match, the tier starts empty:
the journal is emptied and slab files of ranks that no longer exist are removed, while the
current ranks' files are left for their workers to resize and overwrite. Their old slots can
never be served: nothing indexes them, and a slot is only read for a key after being written
whole for that key, header and checksum included.

What survives a restart: a READY disk entry is served from the in-memory index as soon as its
spill completes; its journal record is queued then and made durable by the journal's flusher a
moment later (or by :meth:`DiskCatalog.flush`, which reports it). Nothing promises more for an
entry whose record is not yet durable: if the engine dies first, that entry is simply not
recovered (a miss). While the disk is full the journal drops records past a bounded backlog
and, once it can write again, rebuilds itself from the live index, so dropped entries are
recovered again from then on; :meth:`flush` does not return while any record it covers is
only in that pending rebuild. A crash before the rebuild leaves the older journal, which may
name keys whose slots were reused by later spills: every recovered entry's slot header must
name its key on every rank (so a reused slot is dropped as ``wrong_key``, a torn one by its
checksum) and every read checks the payload's checksum, so a stale record costs a miss, never
wrong bytes. A cache reset is different: every entry is stale then, yet its header still
verifies, so :meth:`DiskCatalog.record_cleared` makes it durable before it returns (the journal
is cut back to its header, which needs no free space; failing that, the manifest is removed).

``<disk_path>/manifest.json`` (:class:`Manifest`) says what the tier was built for. The journal
only says which key sits in which slot; it means something only for the same namespace and the
same slot geometry. The manifest records those, so that a restart with a different model,
dtype, chunk size or TP size starts empty instead of trusting slots laid out for another
engine. Plain JSON (readable by people and by ``tieredkv inspect``), written atomically, never
pickled. Written once at start-up from synchronous code, so plain ``os`` calls rather than
aiofiles (which would need an event loop just for this). A link planted at ``manifest.json`` is
refused (:class:`~tieredkv.disk.private_files.UntrustedPathError`), one planted at the
temporary file is removed, never followed.

``disk_path`` must be a real directory owned by the engine's user and not writable by group
or others (created 0700 if missing), and no file in it is opened through a symlink: see
:mod:`tieredkv.disk.private_files`. The scheduler checks it here; each worker, which vLLM
starts first, checks it in :class:`~tieredkv.disk.private_files.DiskLock` (its ``rank{r}.lock``)
before opening anything, and again in :meth:`SlabFile.open`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from tieredkv.disk.errors import SlabError
from tieredkv.disk.format import (
    FORMAT_VERSION,
    journal_path,
    manifest_path,
    slab_path,
    slab_rank,
    slot_stride,
)
from tieredkv.disk.journal import Journal, JournalReplay
from tieredkv.disk.private_files import (
    DiskLock,
    FileIO,
    JournalFiles,
    UntrustedPathError,
    create_private_exclusive,
    ensure_private_dir,
    fsync_dir,
    open_private,
    restrict_dir,
)
from tieredkv.disk.slab import SlabFile
from tieredkv.protocol import FailureCause

logger = logging.getLogger(__name__)


# -- the manifest ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    format_version: int
    fingerprint: str  # hex of the 32-byte namespace fingerprint
    payload_bytes: int
    slot_stride: int
    num_slots: int
    world_size: int
    created: float

    @classmethod
    def new(
        cls, fingerprint: bytes, payload_bytes: int, slot_stride: int, num_slots: int,
        world_size: int, created: float | None = None,
    ) -> Manifest:
        return cls(
            FORMAT_VERSION, fingerprint.hex(), payload_bytes, slot_stride, num_slots, world_size,
            time.time() if created is None else created,
        )

    def mismatch(
        self, fingerprint: bytes, payload_bytes: int, slot_stride: int, world_size: int
    ) -> str | None:
        """Why this disk tier's contents cannot serve the given engine, or None if they can.

        ``num_slots`` is deliberately not compared: capacity may change between runs.
        """
        if self.format_version != FORMAT_VERSION:
            return f"format version {self.format_version} != {FORMAT_VERSION}"
        if self.fingerprint != fingerprint.hex():
            return f"namespace fingerprint {self.fingerprint[:16]}... != {fingerprint.hex()[:16]}..."
        if self.payload_bytes != payload_bytes:
            return f"payload_bytes {self.payload_bytes} != {payload_bytes}"
        if self.slot_stride != slot_stride:
            return f"slot stride {self.slot_stride} != {slot_stride}"
        if self.world_size != world_size:
            return f"world size {self.world_size} != {world_size}"
        return None


def _file(path: Path) -> Path:
    path = Path(path)
    return manifest_path(path) if path.is_dir() else path


def load_manifest(path: Path) -> Manifest | None:
    """Read the manifest of a disk tier (``path``: the directory or the file itself).

    Returns None, with a warning, when it is missing, unparseable or incomplete: the caller
    then treats the disk tier as empty, which is always safe. Raises
    :class:`~tieredkv.disk.private_files.UntrustedPathError` (never read as "unreadable")
    when the file is a symlink or not our own regular file.
    """
    file = _file(path)
    try:
        raw = json.loads(_read(file).decode("utf-8"))
        manifest = Manifest(
            format_version=int(raw["format_version"]),
            fingerprint=str(raw["fingerprint"]),
            payload_bytes=int(raw["payload_bytes"]),
            slot_stride=int(raw["slot_stride"]),
            num_slots=int(raw["num_slots"]),
            world_size=int(raw["world_size"]),
            created=float(raw["created"]),
        )
    except FileNotFoundError:
        logger.warning("tieredkv disk tier: no manifest at %s", file)
        return None
    except UntrustedPathError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("tieredkv disk tier: unreadable manifest %s: %s", file, exc)
        return None
    return manifest


def _read(file: Path) -> bytes:
    """The file's bytes, read without following a link; ``O_NONBLOCK``: a FIFO never blocks."""
    fd = open_private(file, os.O_RDONLY | os.O_NONBLOCK)
    with open(fd, "rb", closefd=True) as stream:
        return stream.read()


def write_manifest(path: Path, manifest: Manifest) -> None:
    """Write the manifest atomically (temp file, fsync, rename, fsync of the directory), 0600.

    The temporary file is created ``O_EXCL`` after unlinking whatever had its name, and the
    rename replaces a link at ``manifest.json`` itself, so no write follows a planted link.
    """
    file = _file(path)
    tmp = file.with_name(file.name + ".tmp")
    data = (json.dumps(asdict(manifest), indent=2, sort_keys=True) + "\n").encode()
    fd = create_private_exclusive(tmp, os.O_WRONLY | os.O_NONBLOCK, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, file)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dir_fd = os.open(file.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


# -- the catalog ----------------------------------------------------------------------------


def verify_headers(
    disk_path: Path,
    entries: Mapping[bytes, int],
    *,
    fingerprint: bytes,
    payload_bytes: int,
    num_slots: int,
    world_size: int,
    io: FileIO | None = None,
    aliases: dict[bytes, tuple[bytes, ...]] | None = None,
) -> tuple[dict[bytes, int], Counter[FailureCause]]:
    """Keep the entries whose slot header is right on every rank; count the rest by kind.

    With ``aliases`` given, it is filled with each kept entry's alias keys (its other blocks),
    which every rank's header must list alike (a rank that disagrees drops the entry as
    ``wrong_key``: they were written by one job).
    """
    good = dict(entries)
    dropped: Counter[FailureCause] = Counter()
    stride = slot_stride(payload_bytes)
    seen: dict[bytes, tuple[bytes, ...]] = {}
    for rank in range(world_size):
        if not good:
            break
        path = slab_path(disk_path, rank)
        try:
            slab = SlabFile.open(
                path, num_slots, payload_bytes, fingerprint, io=io, create=False, readonly=True
            )
        except SlabError as exc:
            dropped[exc.kind] += len(good)
            good.clear()
            break
        with slab:
            try:
                size = os.lstat(path).st_size  # the file SlabFile.open just checked
            except OSError:
                size = 0
            for key, slot in sorted(good.items(), key=lambda kv: kv[1]):
                if (slot + 1) * stride > size:
                    dropped[FailureCause.SHORT_READ] += 1
                    del good[key]
                    continue
                try:
                    header = slab.read_header(slot, key)
                except SlabError as exc:
                    dropped[exc.kind] += 1
                    del good[key]
                    continue
                if rank == 0:
                    seen[key] = header.aliases
                elif seen.get(key) != header.aliases:
                    dropped[FailureCause.WRONG_KEY] += 1
                    del good[key]
    if aliases is not None:
        aliases.update((key, seen[key]) for key in good if seen.get(key))
    return good, dropped


class DiskCatalog:
    """An open, locked disk tier; ``recovered`` is the verified index from the last run."""

    def __init__(
        self,
        disk_path: Path,
        fingerprint: bytes,
        payload_bytes: int,
        num_slots: int,
        world_size: int,
        lock: DiskLock,
        journal: Journal,
        manifest: Manifest,
        recovered: dict[bytes, int],
        dropped: Counter[FailureCause],
        reset_reason: str | None,
        journal_tail_bytes: int = 0,
        recovered_aliases: dict[bytes, tuple[bytes, ...]] | None = None,
    ) -> None:
        self.disk_path = disk_path
        self.fingerprint = fingerprint
        self.payload_bytes = payload_bytes
        self.slot_stride = slot_stride(payload_bytes)
        self.num_slots = num_slots
        self.world_size = world_size
        self.manifest = manifest
        self.recovered = recovered
        # key -> the keys of the entry's other blocks (from its slot headers); absent: none
        self.recovered_aliases = recovered_aliases or {}
        self.dropped_at_recovery: dict[FailureCause, int] = dict(dropped)
        self.reset_reason = reset_reason
        self.journal_tail_bytes = journal_tail_bytes
        self._lock = lock
        self._journal = journal
        self._closed = False
        self._reported_dropped = 0

    @classmethod
    def open(
        cls,
        disk_path: Path,
        fingerprint: bytes,
        payload_bytes: int,
        num_slots: int,
        world_size: int,
        io: FileIO | None = None,
        journal_files: JournalFiles | None = None,
    ) -> DiskCatalog:
        """Lock ``disk_path`` and recover the last run's verified index (see module docstring).

        ``io`` and ``journal_files``: the system calls for the slab headers and the journal
        (tests pass fault-injecting ones).

        Raises ``ConfigError`` if another engine holds the directory, ``UntrustedPathError``
        (a ValueError naming ``disk_path`` or the file) if the directory is not private to this
        user or a file in it is a symlink or not ours, and ``SlabError`` or ``OSError`` if it
        cannot be written at all.
        """
        disk_path = Path(disk_path).expanduser()
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        # Before the first open under it: a missing directory is created 0700; one that is a
        # symlink, not ours, or writable by group or others is refused (UntrustedPathError,
        # naming disk_path) rather than fixed, since someone else may already have been in it.
        ensure_private_dir(disk_path)
        restrict_dir(disk_path)
        lock = DiskLock(disk_path)
        try:
            return cls._open_locked(
                disk_path, fingerprint, payload_bytes, num_slots, world_size, io, lock, journal_files
            )
        except BaseException:
            lock.close()
            raise

    @classmethod
    def _open_locked(
        cls, disk_path: Path, fingerprint: bytes, payload_bytes: int, num_slots: int,
        world_size: int, io: FileIO | None, lock: DiskLock, journal_files: JournalFiles | None,
    ) -> DiskCatalog:
        stride = slot_stride(payload_bytes)
        journal_file = journal_path(disk_path)
        # lexists: a dangling link at manifest.json is refused by load_manifest, not ignored.
        has_manifest = os.path.lexists(manifest_path(disk_path))
        old = load_manifest(disk_path) if has_manifest else None
        if old is None:
            reason: str | None = "unreadable manifest" if has_manifest else "new disk tier"
        else:
            reason = old.mismatch(fingerprint, payload_bytes, stride, world_size)
        recovered: dict[bytes, int] = {}
        recovered_aliases: dict[bytes, tuple[bytes, ...]] = {}
        dropped: Counter[FailureCause] = Counter()
        replay = JournalReplay()
        if reason is None:
            replay = Journal.replay(journal_file)
            entries = dict(replay.entries)
            out_of_range = [k for k, slot in entries.items() if slot >= num_slots]
            for key in out_of_range:
                del entries[key]
            if out_of_range:
                dropped[FailureCause.MISSING] += len(out_of_range)
            recovered, bad = verify_headers(
                disk_path, entries, fingerprint=fingerprint, payload_bytes=payload_bytes,
                num_slots=num_slots, world_size=world_size, io=io, aliases=recovered_aliases,
            )
            dropped.update(bad)
            logger.info(
                "tieredkv disk tier %s: recovered %d entries, dropped %s",
                disk_path, len(recovered),
                ", ".join(f"{k.value}={n}" for k, n in sorted(dropped.items())) or "none",
            )
        else:
            journal_file.unlink(missing_ok=True)
            _remove_stale_ranks(disk_path, world_size)
            log = logger.info if reason == "new disk tier" else logger.warning
            log("tieredkv disk tier %s: starting empty (%s)", disk_path, reason)
        journal = Journal(journal_file, replay=replay, files=journal_files)
        try:
            journal.compact(recovered)
            manifest = Manifest.new(
                fingerprint, payload_bytes, stride, num_slots, world_size,
                created=old.created if reason is None and old is not None else None,
            )
            write_manifest(disk_path, manifest)
        except BaseException:
            journal.close()
            raise
        return cls(
            disk_path, fingerprint, payload_bytes, num_slots, world_size, lock, journal,
            manifest, recovered, dropped, reset_reason=reason,
            journal_tail_bytes=replay.bad_tail_bytes, recovered_aliases=recovered_aliases,
        )

    def slab_path(self, rank: int) -> Path:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} out of range 0..{self.world_size - 1}")
        return slab_path(self.disk_path, rank)

    @property
    def journal_path(self) -> Path:
        return journal_path(self.disk_path)

    def record_written(self, key: bytes, slot: int) -> None:
        """Journal ``key`` at ``slot``: call only after *every* rank confirmed its write."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"disk slot {slot} out of range 0..{self.num_slots - 1}")
        self._journal.record_add(key, slot)

    def record_removed(self, key: bytes) -> None:
        """Journal that ``key`` left the disk tier (evicted, dropped, or failed a read)."""
        self._journal.record_remove(key)

    def record_cleared(self, timeout: float | None = 10.0) -> bool:
        """Make the whole disk tier's emptying (``reset_cache``) durable before returning:
        its entries are stale now, yet their slot headers would still verify at a restart.

        True once the journal holds nothing from before. Otherwise (the journal could be
        neither cut back nor rewritten) it logs an error and removes the manifest, so that a
        restart starts empty; False either way, and an error if even that failed.
        """
        try:
            self._journal.clear(timeout)
            return True
        except SlabError as exc:
            error: Exception = exc
        try:
            os.unlink(manifest_path(self.disk_path))
            fsync_dir(self.disk_path)
        except FileNotFoundError:
            pass  # removed by an earlier failed reset
        except OSError as exc:
            logger.error(
                "tieredkv disk tier %s: a cache reset could not be made durable (%s) nor the "
                "manifest removed (%s): a restart may recover entries from before the reset",
                self.disk_path, error, exc,
            )
            return False
        logger.error(
            "tieredkv disk tier %s: a cache reset could not be made durable in the journal "
            "(%s); removed the manifest, so the next start begins with an empty disk tier",
            self.disk_path, error,
        )
        return False

    def flush(self, timeout: float | None = 10.0) -> None:
        """Block until every record so far is durable (tests, shutdown)."""
        self._journal.flush(timeout)

    @property
    def journal(self) -> Journal:
        return self._journal

    def take_counter_deltas(self) -> dict[str, int]:
        """The journal's counters since the last call, for the scheduler's stats snapshot:
        ``journal_records_dropped``, records dropped while the disk was full (see
        :mod:`tieredkv.disk.journal_file`)."""
        dropped = self._journal.records_dropped
        delta, self._reported_dropped = dropped - self._reported_dropped, dropped
        return {"journal_records_dropped": delta} if delta else {}

    def close(self) -> None:
        """Flush the journal and release the lock (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._journal.close()
        finally:
            self._lock.close()

    def __enter__(self) -> DiskCatalog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _remove_stale_ranks(disk_path: Path, world_size: int) -> None:
    """Delete slab files of ranks this engine does not have (a smaller TP size than before)."""
    for entry in disk_path.iterdir():
        rank = slab_rank(entry.name)
        if rank is not None and rank >= world_size:
            try:
                entry.unlink()
            except OSError as exc:
                logger.warning("tieredkv disk tier: could not remove %s: %s", entry, exc)
