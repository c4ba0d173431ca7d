"""A :class:`FileIO` with programmable faults: the disk tier's syscalls, made to fail on cue.

Tests and soak runs swap it in for :class:`tieredkv.disk.private_files.FileIO` to produce EIO,
ENOSPC, short reads, bit flips, slow and hung calls, exactly where they choose.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from tieredkv.disk.private_files import FileIO, _total

_OPS = ("open", "read", "write", "fsync", "fallocate")


@dataclass
class _Rule:
    op: str
    action: str  # "error" | "short" | "flip" | "delay" | "hang"
    times: int | None  # None: every matching call; N: the next N matching calls
    offsets: frozenset[int] | None = None
    path: str | None = None
    flags: int = 0
    err: int = errno.EIO
    nbytes: int = 0
    byte: int = 0
    bit: int = 0
    seconds: float = 0.0
    event: threading.Event | None = None
    hits: int = field(default=0)


class FaultyFileIO(FileIO):
    """A :class:`FileIO` with programmable faults, for tests here and in other packages.

    Each ``fail_*``/``short_*``/``flip_*``/``delay``/``hang`` call adds a rule. A rule matches
    one operation (``open``, ``read``, ``write``, ``fsync``, ``fallocate``) and optionally only
    calls whose start offset is in ``at`` (use ``SlabFile.slot_offset(slot)``), whose path
    contains ``path`` and, for opens, whose flags include ``flags``. ``times=None`` fires on
    every matching call, ``times=N`` on the next N. Rules are applied in the order added;
    ``clear()`` removes them all. Thread-safe: rules may be added while I/O runs.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rules: list[_Rule] = []
        self._paths: dict[int, str] = {}
        self._events: list[threading.Event] = []
        self.calls: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()

    # -- programming faults -------------------------------------------------------------

    def _add(self, rule: _Rule) -> _Rule:
        if rule.op not in _OPS:
            raise ValueError(f"unknown op {rule.op!r}; expected one of {', '.join(_OPS)}")
        with self._lock:
            self._rules.append(rule)
        return rule

    @staticmethod
    def _offsets(at: Iterable[int] | int | None) -> frozenset[int] | None:
        if at is None:
            return None
        return frozenset([at]) if isinstance(at, int) else frozenset(at)

    def fail(
        self, op: str, err: int = errno.EIO, *, times: int | None = None,
        at: Iterable[int] | int | None = None, path: str | None = None, flags: int = 0,
    ) -> None:
        """Raise ``OSError(err)`` from ``op`` instead of doing it."""
        self._add(_Rule(op, "error", times, self._offsets(at), path, flags=flags, err=err))

    def fail_writes(self, err: int = errno.EIO, **kw: object) -> None:
        self.fail("write", err, **kw)  # type: ignore[arg-type]

    def fail_reads(self, err: int = errno.EIO, **kw: object) -> None:
        self.fail("read", err, **kw)  # type: ignore[arg-type]

    def short_reads(
        self, missing: int, *, times: int | None = None, at: Iterable[int] | int | None = None,
        path: str | None = None,
    ) -> None:
        """Reads report ``missing`` fewer bytes than asked (the tail is left as it was)."""
        self._add(_Rule("read", "short", times, self._offsets(at), path, nbytes=missing))

    def short_writes(
        self, missing: int, *, times: int | None = None, at: Iterable[int] | int | None = None,
        path: str | None = None,
    ) -> None:
        """Writes stop ``missing`` bytes early: only a 4 KiB-aligned prefix reaches the file.

        The prefix is rounded down to 4 KiB so that the partial write also works under
        O_DIRECT; the file then holds a torn slot, as after a crash mid-write.
        """
        self._add(_Rule("write", "short", times, self._offsets(at), path, nbytes=missing))

    def flip_read_bit(
        self, byte: int, bit: int = 0, *, times: int | None = None,
        at: Iterable[int] | int | None = None, path: str | None = None,
    ) -> None:
        """Flip one bit of the data a read returns (``byte`` counts from the read's start)."""
        self._add(_Rule("read", "flip", times, self._offsets(at), path, byte=byte, bit=bit))

    def delay(
        self, op: str, seconds: float, *, times: int | None = None,
        at: Iterable[int] | int | None = None, path: str | None = None,
    ) -> None:
        """Sleep ``seconds`` before doing ``op`` (a slow device)."""
        self._add(_Rule(op, "delay", times, self._offsets(at), path, seconds=seconds))

    def hang(
        self, op: str, *, times: int | None = None, at: Iterable[int] | int | None = None,
        path: str | None = None,
    ) -> threading.Event:
        """Block ``op`` until the returned event is set (or :meth:`release_all`)."""
        event = threading.Event()
        self._add(_Rule(op, "hang", times, self._offsets(at), path, event=event))
        with self._lock:
            self._events.append(event)
        return event

    def release_all(self) -> None:
        """Unblock every hung call, now and later."""
        with self._lock:
            for event in self._events:
                event.set()

    def clear(self) -> None:
        """Remove every rule (hung calls are released first)."""
        self.release_all()
        with self._lock:
            self._rules.clear()

    # -- matching ----------------------------------------------------------------------

    def _take(self, op: str, fd: int | None, offset: int | None, path: str | None = None,
              flags: int = 0) -> list[_Rule]:
        """The rules that fire for this call, with their counters consumed atomically."""
        if path is None and fd is not None:
            path = self._paths.get(fd)
        fired: list[_Rule] = []
        with self._lock:
            self.calls[op] += 1
            for rule in self._rules:
                if rule.op != op:
                    continue
                if rule.offsets is not None and offset not in rule.offsets:
                    continue
                if rule.path is not None and (path is None or rule.path not in path):
                    continue
                if rule.flags and (flags & rule.flags) != rule.flags:
                    continue
                if rule.times is not None:
                    if rule.times <= 0:
                        continue
                    rule.times -= 1
                rule.hits += 1
                self.faults[f"{op}:{rule.action}"] += 1
                fired.append(rule)
            self._rules = [r for r in self._rules if r.times is None or r.times > 0]
        return fired

    @staticmethod
    def _before(rules: list[_Rule]) -> None:
        """Apply latency, hangs and errors, in that order."""
        for rule in rules:
            if rule.action == "delay":
                time.sleep(rule.seconds)
            elif rule.action == "hang" and rule.event is not None:
                rule.event.wait()
        for rule in rules:
            if rule.action == "error":
                raise OSError(rule.err, os.strerror(rule.err))

    # -- the FileIO interface ------------------------------------------------------------

    def open(self, path: str | os.PathLike[str], flags: int, mode: int = 0o600) -> int:
        self._before(self._take("open", None, None, os.fspath(path), flags))
        fd = super().open(path, flags, mode)
        with self._lock:
            self._paths[fd] = os.fspath(path)
        return fd

    def pread_into(self, fd: int, bufs: list[memoryview], offset: int) -> int:
        rules = self._take("read", fd, offset)
        self._before(rules)
        got = super().pread_into(fd, bufs, offset)
        for rule in rules:
            if rule.action == "short":
                got = max(0, got - rule.nbytes)
            elif rule.action == "flip" and rule.byte < got:
                _flip(bufs, rule.byte, rule.bit)
        return got

    def pwrite(self, fd: int, bufs: list[memoryview], offset: int) -> int:
        rules = self._take("write", fd, offset)
        self._before(rules)
        shorts = [r.nbytes for r in rules if r.action == "short"]
        if not shorts:
            return super().pwrite(fd, bufs, offset)
        want = _total(bufs)
        keep = max(0, want - max(shorts)) // 4096 * 4096
        cut: list[memoryview] = []
        left = keep
        for buf in bufs:
            if left <= 0:
                break
            cut.append(buf[:left])
            left -= min(left, len(buf))
        return super().pwrite(fd, cut, offset) if cut else 0

    def fsync(self, fd: int) -> None:
        self._before(self._take("fsync", fd, None))
        super().fsync(fd)

    def fallocate(self, fd: int, length: int) -> None:
        self._before(self._take("fallocate", fd, None))
        super().fallocate(fd, length)

    def close(self, fd: int) -> None:
        with self._lock:
            self._paths.pop(fd, None)
        super().close(fd)


def _flip(bufs: list[memoryview], index: int, bit: int) -> None:
    for buf in bufs:
        if index < len(buf):
            buf[index] ^= 1 << bit
            return
        index -= len(buf)
