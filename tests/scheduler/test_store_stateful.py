"""The tiered block store assembled from its real parts, checked step by step against a model.

``Store`` below is the smallest honest composition of the parts the connector is built from:
two :class:`TierIndex` (host slots, disk slots), a :class:`HostPool`, a :class:`SlabFile`
doing real I/O through a :class:`FaultyFileIO`, and a :class:`DiskCatalog` journaling the
disk index across restarts. Nothing under test is mocked; only faults are injected (through
the file-I/O layer, or by changing the slab file behind the store's back).

The state machine drives it with puts (new versions of a key invalidate the old copies), spills,
gets (from host, or verified from disk into a host slot), long-lived reader pins, injected
read/write faults (EIO, ENOSPC, short reads and writes, bit flips in header or payload), on-disk
corruption (a flipped byte, or a misdirected write that copies another slot's whole content),
restarts and cache resets, and checks after every step
what DESIGN.md promises ("Tiers", "Failure is a first-class result"):

* a get that returns bytes returns exactly the bytes last put for that key: never another
  version, never another key's bytes; a failed disk read is a typed ``SlabError`` whose kind
  is the one the fault implies, and the entry is dropped (and journaled removed);
* both indexes pass ``check_invariants`` and agree with the model; no slot leaks
  (used slots == live + doomed entries);
* a pinned entry is never evicted: until unpinned it stays READY in the same slot, or, if the
  store dropped it on purpose (re-put, failed read, reset), doomed with its slot still held;
  the bytes of a pinned slot never change;
* the slab file holds exactly what the model says (corruption undone): the store never writes
  into a slot that is indexed or pinned, and never keeps a stale version of a key on disk;
* after a restart the recovered index is exactly the journaled one minus the entries whose
  header is corrupted (``checksum``) or names another key (``wrong_key``), and every recovered
  entry reads back the right bytes or the typed failure its corruption implies.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.scheduler.index_checks import check_invariants
from tieredkv.disk.catalog import DiskCatalog
from tieredkv.disk.errors import SlabError
from tieredkv.disk.format import HEADER_BYTES, HEADER_USED, payload_checksum, unpack_header
from tieredkv.disk.slab import SlabFile
from tieredkv.protocol import FailureCause
from tieredkv.scheduler.tier_index import SlotState, TierIndex
from tieredkv.testing.faulty_fileio import FaultyFileIO
from tieredkv.transfer.host_pool import HostPool

HOST_SLOTS = 4
DISK_SLOTS = 6
PAYLOAD = 8 * 1024
NUM_KEYS = 12
SLOT_RAW = HEADER_BYTES + PAYLOAD  # header + payload (8 KiB is already 4 KiB-aligned)
FINGERPRINT = hashlib.sha256(b"tieredkv tests/test_store_stateful namespace").digest()
KEYS = [hashlib.sha256(f"store-key-{i}".encode()).digest() for i in range(NUM_KEYS)]


# The machine's many examples each open, restart and close a disk tier, and each of those
# fsyncs the journal and manifest: on a busy disk that alone takes seconds. A RAM-backed
# directory keeps the file fast; the example tests below use pytest's tmp_path (a real disk).
_SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


@functools.lru_cache(maxsize=512)
def payload(key: bytes, version: int) -> bytes:
    """The bytes of ``key`` at ``version``: derivable anywhere, so every check is exact."""
    seed = hashlib.blake2b(key + version.to_bytes(8, "little"), digest_size=64).digest()
    return (seed * (PAYLOAD // len(seed) + 1))[:PAYLOAD]


# ------------------------------------------------------------------------------ the store


@dataclass
class GetResult:
    source: str  # "host" | "disk" | "miss" | "failed"
    data: bytes | None = None
    error: SlabError | None = None
    evicted: list[tuple[bytes, int]] = field(default_factory=list)


@dataclass
class SpillResult:
    status: str  # "written" | "no_slot" | "failed"
    error: SlabError | None = None
    evicted: list[tuple[bytes, int]] = field(default_factory=list)


class Store:
    """Host tier over disk tier, composed the way the scheduler + worker halves compose them
    (all in one thread, every copy synchronous)."""

    def __init__(self, root: Path, io: FaultyFileIO | None = None) -> None:
        self.disk_path = Path(root) / "disk"
        self.io = io if io is not None else FaultyFileIO()
        self.pool = HostPool(HOST_SLOTS, PAYLOAD, pin=False)
        self.host = TierIndex("host", HOST_SLOTS)
        self.pins: list[tuple[str, bytes]] = []  # long-lived reader pins
        self._open_disk()

    # -- lifecycle

    def _open_disk(self) -> None:
        self.catalog = DiskCatalog.open(
            self.disk_path, FINGERPRINT, PAYLOAD, DISK_SLOTS, world_size=1
        )
        self.slab_path = self.catalog.slab_path(0)
        self.slab = SlabFile.open(self.slab_path, DISK_SLOTS, PAYLOAD, FINGERPRINT, io=self.io)
        self.disk = TierIndex("disk", DISK_SLOTS)
        for key, slot in self.catalog.recovered.items():
            self.disk.restore(key, slot)

    def restart(self) -> None:
        """Release the readers, close catalog and slab, reopen both; host memory is lost."""
        self.release_pins()
        self.catalog.close()
        self.slab.close()
        self._open_disk()
        self.host = TierIndex("host", HOST_SLOTS)
        self.pool.buffer.fill_(0xA5)  # what a new process finds in its host pool: not our bytes

    def close(self) -> None:
        self.catalog.close()
        self.slab.close()
        self.pool.close()

    def reset(self) -> None:
        """``reset_cache``: both tiers emptied; pinned entries become doomed."""
        self.host.clear()
        self.disk.clear()
        self.catalog.record_cleared()

    # -- slots

    def host_bytes(self, slot: int) -> bytes:
        return bytes(self.pool.slot_memoryview(slot)[:PAYLOAD])

    def index(self, tier: str) -> TierIndex:
        return self.host if tier == "host" else self.disk

    def _drop_disk(self, key: bytes) -> None:
        self.disk.remove(key)
        self.catalog.record_removed(key)

    # -- operations

    def put(self, key: bytes, data: bytes) -> tuple[bool, list[tuple[bytes, int]]]:
        """Store new bytes for ``key`` in the host tier; older copies in both tiers go first.

        Returns ``(stored, evicted)``; not stored (a miss) when no host slot can be had.
        """
        self.host.remove(key)
        if key in self.disk:
            self._drop_disk(key)
        got = self.host.allocate(key)
        if got is None:
            return False, []
        slot, evicted = got
        self.pool.slot_memoryview(slot)[:PAYLOAD] = data
        if not self.host.mark_ready(key):
            raise AssertionError("a fresh host write was doomed")
        return True, evicted

    def spill(self, key: bytes) -> SpillResult:
        """Copy a READY host entry that is not on disk into a disk slot and journal it."""
        if not self.host.is_ready(key) or key in self.disk:
            raise ValueError("spill needs a READY host entry that is not on disk")
        got = self.disk.allocate(key)
        if got is None:
            return SpillResult("no_slot")
        dslot, evicted = got
        for victim, _ in evicted:
            self.catalog.record_removed(victim)
        self.host.pin(key)
        try:
            hslot = self.host.get(key).slot  # type: ignore[union-attr]
            try:
                self.slab.write_slot(dslot, key, self.pool.slot_memoryview(hslot))
            except SlabError as exc:
                self.disk.abort(key)
                return SpillResult("failed", exc, evicted)
            if not self.disk.mark_ready(key):
                raise AssertionError("a disk write was doomed while nobody else could touch it")
            self.catalog.record_written(key, dslot)
            return SpillResult("written", None, evicted)
        finally:
            self.host.unpin(key)

    def get(self, key: bytes) -> GetResult:
        """The bytes of ``key``: from a host slot, or verified from disk into a new host slot."""
        if self.host.is_ready(key):
            self.host.pin(key)
            try:
                data = self.host_bytes(self.host.get(key).slot)  # type: ignore[union-attr]
            finally:
                self.host.unpin(key)
            self.host.touch(key)
            return GetResult("host", data)
        if not self.disk.is_ready(key):
            return GetResult("miss")
        self.disk.pin(key)
        try:
            dslot = self.disk.get(key).slot  # type: ignore[union-attr]
            got = self.host.allocate(key)
            if got is None:
                return GetResult("miss")
            hslot, evicted = got
            try:
                self.slab.read_slot_into(dslot, key, self.pool.slot_memoryview(hslot))
            except SlabError as exc:
                self.host.abort(key)
                self._drop_disk(key)
                return GetResult("failed", None, exc, evicted)
            if not self.host.mark_ready(key):
                raise AssertionError("a host load was doomed while nobody else could touch it")
            self.disk.touch(key)
            return GetResult("disk", self.host_bytes(hslot), None, evicted)
        finally:
            self.disk.unpin(key)

    def pin_reader(self, tier: str, key: bytes) -> int:
        """A long-lived reader holds ``key``'s slot in ``tier``; returns the slot."""
        index = self.index(tier)
        index.pin(key)
        self.pins.append((tier, key))
        return index.get(key).slot  # type: ignore[union-attr]

    def unpin_reader(self, tier: str, key: bytes) -> None:
        self.pins.remove((tier, key))
        self.index(tier).unpin(key)

    def release_pins(self) -> None:
        while self.pins:
            self.unpin_reader(*self.pins[-1])

    # -- checks

    def read_clean(self, slot: int, key: bytes) -> bytes | SlabError:
        """Read ``slot`` as ``key`` through a separate read-only slab with plain I/O."""
        out = bytearray(PAYLOAD)
        with SlabFile.open(
            self.slab_path, DISK_SLOTS, PAYLOAD, FINGERPRINT, create=False, readonly=True
        ) as slab:
            try:
                slab.read_slot_into(slot, key, memoryview(out))
            except SlabError as exc:
                return exc
        return bytes(out)

    def raw_slot(self, slot: int) -> bytearray:
        """The raw header + payload of a disk slot, read straight from the file."""
        fd = os.open(self.slab_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return bytearray(os.pread(fd, SLOT_RAW, slot * self.slab.slot_stride))
        finally:
            os.close(fd)

    def copy_on_disk(self, src: int, dst: int) -> None:
        """Overwrite slot ``dst`` with the raw content of slot ``src`` (a misdirected write)."""
        raw = bytes(self.raw_slot(src))
        fd = os.open(self.slab_path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.pwrite(fd, raw, dst * self.slab.slot_stride)
        finally:
            os.close(fd)

    def flip_on_disk(self, slot: int, offset: int, mask: int) -> None:
        """Corrupt one byte of ``slot`` (offset from the slot's start) behind the store's back."""
        fd = os.open(self.slab_path, os.O_RDWR | os.O_CLOEXEC)
        try:
            where = slot * self.slab.slot_stride + offset
            (byte,) = os.pread(fd, 1, where)
            os.pwrite(fd, bytes([byte ^ mask]), where)
        finally:
            os.close(fd)


# ------------------------------------------------------------------------------ faults

READ_FAULTS = ("read_eio", "short_read", "flip_payload", "flip_header")
WRITE_FAULTS = ("write_eio", "write_enospc", "short_write")
EXPECTED_KIND = {
    "read_eio": FailureCause.IO_ERROR,
    "short_read": FailureCause.SHORT_READ,
    "flip_payload": FailureCause.CHECKSUM,
    "flip_header": FailureCause.CHECKSUM,
    "write_eio": FailureCause.IO_ERROR,
    "write_enospc": FailureCause.NO_SPACE,
    "short_write": FailureCause.IO_ERROR,
}


def inject(io: FaultyFileIO, fault: str, path: Path, *, offset: int = 0, bit: int = 0,
           missing: int = 1) -> None:
    """Arm ``fault`` for the next slot read or write of the slab at ``path`` (only that file:
    the O_DIRECT probe at open is never hit)."""
    where = str(path)
    if fault == "read_eio":
        io.fail_reads(errno.EIO, times=1, path=where)
    elif fault == "short_read":
        io.short_reads(missing, times=1, path=where)
    elif fault == "flip_payload":
        io.flip_read_bit(HEADER_BYTES + offset % PAYLOAD, bit, times=1, path=where)
    elif fault == "flip_header":
        io.flip_read_bit(offset % HEADER_USED, bit, times=1, path=where)
    elif fault == "write_eio":
        io.fail_writes(errno.EIO, times=1, path=where)
    elif fault == "write_enospc":
        io.fail_writes(errno.ENOSPC, times=1, path=where)
    elif fault == "short_write":
        io.short_writes(missing, times=1, path=where)
    else:
        raise ValueError(fault)


# ------------------------------------------------------------------------------ the machine


@dataclass
class Reader:
    tier: str
    key: bytes
    slot: int
    version: int
    removed: bool = False  # the store dropped the entry on purpose: doomed, slot still held


class StoreMachine(RuleBasedStateMachine):
    """The store against a model that predicts every outcome: hit, miss, eviction, and the
    exact failure kind of every disk read and write (so a wrong success fails too)."""

    # Restarts, resets and corruption wipe or spoil most of the state the other rules build
    # up: a few per example, so that each still reaches full tiers, evictions and good loads.
    max_restarts = 2
    max_resets = 1
    max_corruptions = 2

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="tieredkv-store-", dir=_SCRATCH))
        self.store = Store(self.root)
        self.version: dict[bytes, int] = dict.fromkeys(KEYS, 0)
        self.m_host: dict[bytes, int] = {}  # key -> slot of live READY host entries
        self.m_disk: dict[bytes, int] = {}  # key -> slot of live READY disk entries
        # What each disk slot holds: the (key, version) its last successful write (or a
        # misdirected copy) put there, and the bytes flipped in it since, offset -> xor mask.
        self.content: dict[int, tuple[bytes, int]] = {}
        self.flips: dict[int, dict[int, int]] = {}
        self.readers: list[Reader] = []
        self.pending: dict[str, str] = {}  # "read"/"write" -> armed fault
        self.faults_fired = 0
        self.stats: Counter[str] = Counter()

    def teardown(self) -> None:
        try:
            self.store.close()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    # -- model helpers

    def _pinned(self, tier: str, key: bytes) -> int:
        return sum(1 for r in self.readers if r.tier == tier and r.key == key and not r.removed)

    def _doomed(self, tier: str) -> set[bytes]:
        return {r.key for r in self.readers if r.tier == tier and r.removed}

    def _live(self, tier: str) -> dict[bytes, int]:
        return self.m_host if tier == "host" else self.m_disk

    def _can_allocate(self, tier: str, key: bytes) -> bool:
        live = self._live(tier)
        if key in self._doomed(tier):
            return False
        num_slots = HOST_SLOTS if tier == "host" else DISK_SLOTS
        free = num_slots - len(live) - len(self._doomed(tier))
        return free > 0 or any(self._pinned(tier, k) == 0 for k in live)

    def _drop(self, tier: str, key: bytes) -> None:
        """The store removed ``key`` from ``tier`` on purpose: pinned readers now hold a doomed
        entry."""
        if self._live(tier).pop(key, None) is not None:
            for r in self.readers:
                if r.tier == tier and r.key == key:
                    r.removed = True

    def _evicted(self, tier: str, evicted: list[tuple[bytes, int]]) -> None:
        live = self._live(tier)
        for key, slot in evicted:
            assert live.get(key) == slot, f"{tier} evicted {key.hex()[:8]} from a slot it lacked"
            assert self._pinned(tier, key) == 0, f"{tier} evicted pinned {key.hex()[:8]}"
            del live[key]
        self.stats[f"{tier}_evictions"] += len(evicted)

    def _fired(self, op: str) -> str | None:
        fault = self.pending.pop(op, None)
        if fault is not None:
            self.faults_fired += 1
        return fault

    def _header_flipped(self, slot: int) -> bool:
        return any(off < HEADER_USED for off in self.flips.get(slot, {}))

    def _slot_verdict(self, key: bytes, slot: int, fault: str | None = None) -> FailureCause | None:
        """How a verified read of ``slot`` as ``key`` ends, with ``fault`` injected into it,
        in the order the slab checks: I/O, length, header, key, payload checksum."""
        assert slot in self.content, f"disk slot {slot} is indexed but its last write was torn"
        if fault in ("read_eio", "short_read"):
            return EXPECTED_KIND[fault]
        if fault == "flip_header" or self._header_flipped(slot):
            return FailureCause.CHECKSUM
        if self.content[slot][0] != key:
            return FailureCause.WRONG_KEY
        if fault == "flip_payload" or self.flips.get(slot):
            return FailureCause.CHECKSUM
        return None

    def _expected_read(self, key: bytes, slot: int) -> FailureCause | None:
        return self._slot_verdict(key, slot, self._fired("read"))

    def _check_get(self, key: bytes, result: GetResult) -> None:
        """Whatever a get returns, it is never bytes other than the latest put's."""
        if result.data is not None:
            assert result.data == payload(key, self.version[key]), (
                f"get({key.hex()[:8]}) served bytes that are not version {self.version[key]}"
            )

    # -- rules

    @rule(i=st.integers(0, NUM_KEYS - 1))
    def put(self, i: int) -> None:
        key = KEYS[i]
        self.version[key] += 1
        self._drop("host", key)
        self._drop("disk", key)
        expect_stored = self._can_allocate("host", key)
        stored, evicted = self.store.put(key, payload(key, self.version[key]))
        assert stored == expect_stored
        self._evicted("host", evicted)
        if stored:
            self.m_host[key] = self.store.host.get(key).slot  # type: ignore[union-attr]
        self.stats["put_stored" if stored else "put_miss"] += 1

    @precondition(lambda self: any(k not in self.m_disk for k in self.m_host))
    @rule(pick=st.integers(0, 1 << 16))
    def spill(self, pick: int) -> None:
        candidates = sorted(k for k in self.m_host if k not in self.m_disk)
        self._spill(candidates[pick % len(candidates)])

    @rule(i=st.integers(0, NUM_KEYS - 1))
    def put_and_spill(self, i: int) -> None:
        """The common write path in one step, so the disk tier fills and churns."""
        self.put(i)
        if KEYS[i] in self.m_host:
            self._spill(KEYS[i])

    @precondition(lambda self: len(self.m_disk) < NUM_KEYS)
    @rule(pick=st.integers(0, 1 << 16))
    def put_and_spill_new(self, pick: int) -> None:
        """Put and spill a key that is not on disk yet: fills the disk tier until it evicts."""
        fresh = [i for i, key in enumerate(KEYS) if key not in self.m_disk]
        self.put_and_spill(fresh[pick % len(fresh)])

    def _spill(self, key: bytes) -> None:
        can = self._can_allocate("disk", key)
        result = self.store.spill(key)
        if not can:
            assert result.status == "no_slot", result
            self.stats["spill_no_slot"] += 1
            return
        assert result.status != "no_slot"
        self._evicted("disk", result.evicted)
        fault = self._fired("write")
        slot = result.error.slot if result.error is not None else self.store.disk.get(key).slot  # type: ignore[union-attr]
        if fault is None:
            assert result.status == "written", result
            self.m_disk[key] = slot
            self.content[slot] = (key, self.version[key])
            self.flips.pop(slot, None)  # rewritten whole
            self.stats["spill_written"] += 1
        else:
            assert result.status == "failed", (fault, result)
            assert result.error is not None and result.error.kind == EXPECTED_KIND[fault]
            assert key not in self.store.disk
            if fault == "short_write":  # a torn slot: nothing may ever read it as data
                self.content.pop(slot, None)
                self.flips.pop(slot, None)
            self.stats[f"spill_{fault}"] += 1

    def _do_get(self, key: bytes) -> None:
        expected_source = "miss"
        if key in self.m_host:
            expected_source = "host"
        elif key in self.m_disk and self._can_allocate("host", key):
            expected_source = "disk"
        result = self.store.get(key)
        self._check_get(key, result)
        if expected_source != "disk":
            assert result.source == expected_source, (expected_source, result)
            assert not result.evicted
            self.stats[f"get_{expected_source}"] += 1
            return
        self._evicted("host", result.evicted)
        dslot = self.m_disk[key]
        kind = self._expected_read(key, dslot)
        if kind is None:
            assert result.source == "disk", result
            assert result.data == payload(key, self.version[key])
            self.m_host[key] = self.store.host.get(key).slot  # type: ignore[union-attr]
            self.stats["get_disk"] += 1
        else:
            assert result.source == "failed", (kind, result)
            assert result.error is not None and result.error.kind == kind, (kind, result.error)
            assert result.error.slot == dslot
            # Dropped from the disk tier, and no host copy was left behind.
            self._drop("disk", key)
            assert key not in self.store.host and key not in self.store.disk
            self.stats[f"get_failed_{kind.value}"] += 1

    @rule(i=st.integers(0, NUM_KEYS - 1))
    def get(self, i: int) -> None:
        self._do_get(KEYS[i])

    # Verified loads from disk are the path that matters most: two rules (rules are drawn
    # uniformly) so they are not crowded out by gets of absent keys. A host copy of the key
    # is dropped first, as a host eviction would, so that the get has to go to disk.
    @precondition(lambda self: bool(self.m_disk))
    @rule(pick=st.integers(0, 1 << 16))
    def get_from_disk(self, pick: int) -> None:
        key = sorted(self.m_disk)[pick % len(self.m_disk)]
        if key in self.m_host:
            self.store.host.remove(key)
            self._drop("host", key)
        self._do_get(key)

    @precondition(lambda self: bool(self.m_disk))
    @rule(pick=st.integers(0, 1 << 16))
    def load_from_disk(self, pick: int) -> None:
        self.get_from_disk(pick)

    @precondition(lambda self: len(self.readers) < 3 and bool(self.m_host or self.m_disk))
    @rule(tier=st.sampled_from(["host", "disk"]), pick=st.integers(0, 1 << 16))
    def pin_reader(self, tier: str, pick: int) -> None:
        live = self._live(tier)
        if not live:
            tier = "disk" if tier == "host" else "host"
            live = self._live(tier)
        key = sorted(live)[pick % len(live)]
        slot = self.store.pin_reader(tier, key)
        assert slot == live[key]
        self.readers.append(Reader(tier, key, slot, self.version[key]))
        self.stats[f"pin_{tier}"] += 1

    @precondition(lambda self: bool(self.readers))
    @rule(pick=st.integers(0, 1 << 16))
    def unpin_reader(self, pick: int) -> None:
        reader = self.readers.pop(pick % len(self.readers))
        self._check_reader(reader)
        self.store.unpin_reader(reader.tier, reader.key)
        if reader.removed and not any(
            r.tier == reader.tier and r.key == reader.key for r in self.readers
        ):
            index = self.store.index(reader.tier)
            assert not index.is_doomed(reader.key), "last unpin left a doomed entry behind"
            self.stats["unpin_doomed"] += 1

    @precondition(lambda self: "read" not in self.pending)
    @rule(fault=st.sampled_from(READ_FAULTS), offset=st.integers(0, PAYLOAD - 1),
          bit=st.integers(0, 7), missing=st.integers(1, SLOT_RAW))
    def inject_read_fault(self, fault: str, offset: int, bit: int, missing: int) -> None:
        inject(self.store.io, fault, self.store.slab_path, offset=offset, bit=bit, missing=missing)
        self.pending["read"] = fault

    @precondition(lambda self: "write" not in self.pending)
    @rule(fault=st.sampled_from(WRITE_FAULTS), missing=st.integers(1, SLOT_RAW))
    def inject_write_fault(self, fault: str, missing: int) -> None:
        inject(self.store.io, fault, self.store.slab_path, missing=missing)
        self.pending["write"] = fault

    def _corruptions(self) -> int:
        return sum(n for name, n in self.stats.items() if name.startswith("corrupt_"))

    @precondition(lambda self: bool(self.m_disk) and self._corruptions() < self.max_corruptions)
    @rule(pick=st.integers(0, 1 << 16), where=st.sampled_from(["payload", "header"]),
          offset=st.integers(0, PAYLOAD - 1), mask=st.integers(1, 255))
    def corrupt_on_disk(self, pick: int, where: str, offset: int, mask: int) -> None:
        key = sorted(self.m_disk)[pick % len(self.m_disk)]
        slot = self.m_disk[key]
        at = HEADER_BYTES + offset if where == "payload" else offset % HEADER_USED
        self.store.flip_on_disk(slot, at, mask)
        flips = self.flips.setdefault(slot, {})
        flips[at] = flips.get(at, 0) ^ mask
        if not flips[at]:
            del flips[at]
        self.stats[f"corrupt_{where}"] += 1

    @precondition(
        lambda self: len(self.m_disk) >= 2 and self._corruptions() < self.max_corruptions
    )
    @rule(dst=st.integers(0, 1 << 16), src=st.integers(0, 1 << 16))
    def misdirected_write(self, dst: int, src: int) -> None:
        """The device wrote one slot's whole content over another's (header included): a read
        of the victim must fail ``wrong_key``, never serve the other key's bytes.

        The copied content must name another key: an older copy of the victim's own key would
        stand for a lost write, which no checksum can see. Real keys are content hashes (the
        same key, the same bytes), so only this test's versions could tell it apart.
        """
        victims = sorted(self.m_disk.items(), key=lambda kv: kv[1])
        key, target = victims[dst % len(victims)]
        sources = [s for _, s in victims if s != target and self.content[s][0] != key]
        if not sources:
            return
        source = sources[src % len(sources)]
        self.store.copy_on_disk(source, target)
        self.content[target] = self.content[source]
        self.flips[target] = dict(self.flips.get(source, {}))
        self.stats["corrupt_misdirected"] += 1

    @precondition(lambda self: bool(self.m_disk) and self.stats["restart"] < self.max_restarts)
    @rule()
    def restart(self) -> None:
        for reader in self.readers:
            self._check_reader(reader)
        # Recovery checks each journaled entry's header (not its payload).
        expected: dict[bytes, int] = {}
        dropped: Counter[FailureCause] = Counter()
        for key, slot in self.m_disk.items():
            if self._header_flipped(slot):
                dropped[FailureCause.CHECKSUM] += 1
            elif self.content[slot][0] != key:
                dropped[FailureCause.WRONG_KEY] += 1
            else:
                expected[key] = slot
        self.store.restart()
        catalog = self.store.catalog
        assert catalog.recovered == expected
        assert catalog.dropped_at_recovery == dict(dropped)
        for key, slot in catalog.recovered.items():
            got = self.store.read_clean(slot, key)
            kind = self._slot_verdict(key, slot)
            if kind is not None:
                assert isinstance(got, SlabError) and got.kind is kind, (kind, got)
            else:
                assert got == payload(key, self.version[key]), "recovered entry has wrong bytes"
        self.readers.clear()
        self.m_host = {}
        self.m_disk = dict(expected)
        self.stats["restart"] += 1

    @precondition(
        lambda self: bool(self.m_host or self.m_disk) and self.stats["reset"] < self.max_resets
    )
    @rule()
    def reset(self) -> None:
        self.store.reset()
        for key in list(self.m_host):
            self._drop("host", key)
        for key in list(self.m_disk):
            self._drop("disk", key)
        self.stats["reset"] += 1

    # -- invariants

    def _check_reader(self, r: Reader) -> None:
        index = self.store.index(r.tier)
        if r.removed:
            assert index.get(r.key) is None and index.is_doomed(r.key)
        else:
            placement = index.get(r.key)
            assert placement is not None, f"pinned {r.tier} entry {r.key.hex()[:8]} vanished"
            assert placement.state is SlotState.READY and placement.slot == r.slot
            assert placement.pins >= 1
        if r.tier == "host":
            assert self.store.host_bytes(r.slot) == payload(r.key, r.version), (
                "a pinned host slot was overwritten"
            )
        else:
            self._check_disk_slot(r.slot)

    def _check_disk_slot(self, slot: int) -> None:
        """The file holds exactly what the model says (corruption undone): the store never
        wrote into an indexed or pinned slot."""
        assert slot in self.content, f"disk slot {slot} is indexed but its last write was torn"
        key, version = self.content[slot]
        raw = self.store.raw_slot(slot)
        for off, mask in self.flips.get(slot, {}).items():
            raw[off] ^= mask
        header = unpack_header(bytes(raw[:HEADER_BYTES]), slot=slot)
        assert header.key == key, f"disk slot {slot} was overwritten while indexed or pinned"
        want = payload(key, version)
        assert header.checksum == payload_checksum(want)
        assert bytes(raw[HEADER_BYTES:]) == want

    @invariant()
    def tiers_agree_with_model(self) -> None:
        store = self.store
        for tier in ("host", "disk"):
            index = store.index(tier)
            live = self._live(tier)
            check_invariants(index)
            assert sorted(index.keys()) == sorted(live)
            for key, slot in live.items():
                placement = index.get(key)
                assert placement is not None
                assert placement.state is SlotState.READY and placement.slot == slot
                assert placement.pins == self._pinned(tier, key)
            doomed = self._doomed(tier)
            assert index.doomed_count == len(doomed)
            assert all(index.is_doomed(k) for k in doomed)
            # No slot leaks: every used slot is a live entry or a doomed one still pinned.
            assert index.used_slots == len(index) + index.doomed_count
            assert index.writing_count == 0
        assert sum(store.io.faults.values()) == self.faults_fired

    @invariant()
    def bytes_are_right(self) -> None:
        for key, slot in self.m_host.items():
            assert self.store.host_bytes(slot) == payload(key, self.version[key]), (
                f"host slot {slot} does not hold version {self.version[key]} of its key"
            )
        for key, slot in self.m_disk.items():
            self._check_disk_slot(slot)
            held, version = self.content[slot]
            if held == key:  # (else a misdirected write replaced it: reads fail wrong_key)
                assert version == self.version[key], f"disk keeps a stale version of {key.hex()[:8]}"
        for reader in self.readers:
            self._check_reader(reader)


StoreMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestStoreMachine = StoreMachine.TestCase


# ------------------------------------------------------------------------------ examples


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(tmp_path)
    try:
        yield s
    finally:
        s.close()


def put(store: Store, i: int, version: int = 1) -> bytes:
    key = KEYS[i]
    stored, _ = store.put(key, payload(key, version))
    assert stored
    return key


def test_spilled_entry_survives_restart(store: Store) -> None:
    key = put(store, 0)
    assert store.spill(key).status == "written"
    store.restart()
    assert store.catalog.recovered == {key: store.disk.get(key).slot}  # type: ignore[union-attr]
    assert key not in store.host  # host memory is gone
    result = store.get(key)
    assert result.source == "disk" and result.data == payload(key, 1)
    # Now in both tiers again; a second get is a host hit with the same bytes.
    assert store.get(key) == GetResult("host", payload(key, 1))


def test_corrupted_payload_is_a_typed_miss_and_is_dropped(store: Store) -> None:
    key = put(store, 0)
    assert store.spill(key).status == "written"
    slot = store.disk.get(key).slot  # type: ignore[union-attr]
    store.flip_on_disk(slot, HEADER_BYTES + 1234, 0x10)
    store.restart()
    # The header is intact, so the entry is recovered; its payload fails the checksum on read.
    assert store.catalog.recovered == {key: slot}
    result = store.get(key)
    assert result.source == "failed" and result.data is None
    assert result.error is not None and result.error.kind is FailureCause.CHECKSUM
    assert key not in store.disk and key not in store.host
    assert store.host.used_slots == 0 and store.disk.used_slots == 0
    assert store.get(key).source == "miss"
    # The drop was journaled: the next restart does not bring it back.
    store.restart()
    assert store.catalog.recovered == {}


def test_injected_read_fault_is_typed_and_drops_the_entry(store: Store) -> None:
    keys = [put(store, i) for i in range(3)]
    for key in keys:
        assert store.spill(key).status == "written"
    store.restart()
    expected = {
        keys[0]: FailureCause.IO_ERROR, keys[1]: FailureCause.SHORT_READ, keys[2]: FailureCause.CHECKSUM,
    }
    inject(store.io, "read_eio", store.slab_path)
    result = store.get(keys[0])
    inject(store.io, "short_read", store.slab_path, missing=100)
    results = [result, store.get(keys[1])]
    inject(store.io, "flip_header", store.slab_path, offset=50, bit=3)
    results.append(store.get(keys[2]))
    for key, res in zip(keys, results, strict=True):
        assert res.source == "failed" and res.error is not None
        assert res.error.kind is expected[key]
        assert key not in store.disk
    store.restart()
    assert store.catalog.recovered == {}


def test_pinned_entries_survive_pressure(store: Store) -> None:
    hot = put(store, 0)
    assert store.spill(hot).status == "written"
    host_slot = store.pin_reader("host", hot)
    disk_slot = store.pin_reader("disk", hot)
    for round_ in range(1, 4):
        for i in range(1, NUM_KEYS):
            key = put(store, i, round_)
            result = store.spill(key)
            assert result.status == "written"
            assert all(victim != hot for victim, _ in result.evicted)
            assert store.host.get(hot).slot == host_slot  # type: ignore[union-attr]
            assert store.disk.get(hot).slot == disk_slot  # type: ignore[union-attr]
    assert store.host.evictions > 0 and store.disk.evictions > 0
    assert store.host_bytes(host_slot) == payload(hot, 1)
    assert store.read_clean(disk_slot, hot) == payload(hot, 1)
    store.unpin_reader("host", hot)
    store.unpin_reader("disk", hot)
    # Unpinned, the hot entry is evictable again like any other.
    for i in range(1, HOST_SLOTS + 1):
        put(store, i, 9)
    assert hot not in store.host
    for tier in ("host", "disk"):
        check_invariants(store.index(tier))
