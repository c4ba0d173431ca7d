"""What every copy backend is and shares: the :class:`CopyBackend` interface, its :data:`Pair`,
the bounds check that runs before any of them touches memory, their reusable buffers, and
:func:`select_backend`, which picks the one a worker uses.

Every backend has the same shape: ``d2h(dev, host, pairs)`` / ``h2d(dev, host, pairs)``, where
each pair ``(host_slot, first_block, block_ids)`` means "device block ``block_ids[j]`` <->
position ``first_block + j`` of ``host_slot``, for every layer", and many chunks move per
call. Copies are issued on the current CUDA stream (the caller's lane stream) and are not
waited for; on CPU they are done when the call returns.

What the backends share beside the interface: reusable buffers for the CUDA copy paths, each
safe against reuse while a copy still reads it, and what a backend derives per registration.

- :class:`IndexUploader`: pinned host buffers for the index tables a batch uploads. Page-locking
  per batch (``tensor.pin_memory()``) is an allocation plus a page-lock on the hot path; these
  buffers are allocated once (all of them together), grown geometrically, and a buffer is
  written again only after the copy that read it has completed (its event, waited for on the
  host).
- :class:`StagingBuffer`: one device buffer of bounded size that a copy moves through piece by
  piece, instead of a buffer as large as the whole batch that is never given back. Reuse from
  another stream waits (on the device) for the last use to finish.
- :class:`RegistrationCache`: what a backend derives once per (KV caches, host pool) pair (views
  or raw pointers), held only while both live. Why not a dict keyed by ``id()``: the id of a dead
  object is handed to the next one, so a new registration could get a dead one's entry (freed or
  stale memory), and every entry would keep its KV caches' memory alive for the backend's life.
  Entries are keyed weakly by the :class:`KVViews` and :class:`HostPool` objects themselves: an
  entry goes when either does, and a value must not refer back to them.

On CPU every copy is done when it returns: no events, nothing pinned.
"""

from __future__ import annotations

import logging
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

import numpy as np
import torch

from tieredkv.protocol import NO_BLOCK, BackendName
from tieredkv.transfer.host_pool import HostPool
from tieredkv.transfer.kv_views import KVViews

Pair = tuple[int, int, Sequence[int]]  # (host_slot, first_block, device block_ids)
logger = logging.getLogger(__name__)


def real_blocks(ids: Sequence[int]) -> list[int]:
    """The device blocks among ``ids`` (holes, :data:`NO_BLOCK`, left out)."""
    return [b for b in ids if b != NO_BLOCK]


def split_holes(host_slot: int, first: int, ids: Sequence[int]) -> list[Pair]:
    """``(host_slot, first, ids)`` as pairs of contiguous real blocks: rows holding
    :data:`NO_BLOCK` (a hybrid model's rows no block fills) are skipped, never copied."""
    if NO_BLOCK not in ids:
        return [(host_slot, first, ids)]
    pairs: list[Pair] = []
    start = None
    for j, block in enumerate([*ids, NO_BLOCK]):
        if block != NO_BLOCK and start is None:
            start = j
        elif block == NO_BLOCK and start is not None:
            pairs.append((host_slot, first + start, tuple(ids[start:j])))
            start = None
    return pairs


def check_pairs(dev: KVViews, host: HostPool, chunk_blocks: int, pairs: Sequence[Pair]) -> None:
    """Raise ValueError for anything that would copy out of bounds.

    A bad id must never reach an index kernel: on CUDA it is a device-side assert that kills
    the process, and for the raw-pointer kernel it is memory corruption.
    """
    for slot, first, ids in pairs:
        if not 0 <= slot < host.num_slots:
            raise ValueError(f"host slot {slot} out of range 0..{host.num_slots - 1}")
        if first < 0 or first + len(ids) > chunk_blocks:
            raise ValueError(
                f"positions {first}..{first + len(ids) - 1} do not fit a chunk of {chunk_blocks}"
            )
        if ids and (min(ids) < 0 or max(ids) >= dev.num_blocks):
            raise ValueError(f"device block ids {list(ids)} out of range 0..{dev.num_blocks - 1}")


class CopyBackend(ABC):
    """A way to move block-granular KV bytes between device caches and host slots."""

    name = "abstract"

    @abstractmethod
    def d2h(self, dev: KVViews, host: HostPool, pairs: Sequence[Pair]) -> None:
        """Device blocks -> host slot positions, all layers."""

    @abstractmethod
    def h2d(self, dev: KVViews, host: HostPool, pairs: Sequence[Pair]) -> None:
        """Host slot positions -> device blocks, all layers."""

    def describe(self) -> str:
        return str(self.name)


# ---------------------------------------------------------------- shared buffers


class Event(Protocol):
    """What is needed of a CUDA event (a test double stands in on CPU)."""

    def record(self, stream: object = None) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


EventFactory = Callable[[torch.device], Event | None]


def cuda_event(device: torch.device) -> Event | None:
    """An event recorded where ``device``'s current stream is now; None on CPU."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class IndexUploader:
    """Copies int64 index tables to the device through reused pinned host buffers.

    ``count`` buffers take turns, so a batch need not wait for the upload of the one before
    it; a buffer whose upload may still be in flight is waited for before it is written.
    """

    def __init__(
        self, pin: bool, *, count: int = 2, min_elems: int = 1024,
        new_event: EventFactory = cuda_event,
    ) -> None:
        self._pin = pin
        self._min = min_elems
        self._new_event = new_event
        self._buffers: list[torch.Tensor | None] = [None] * count
        self._events: list[Event | None] = [None] * count
        self._next = 0
        self._lock = threading.Lock()  # lanes are threads; a backend may serve two
        self.allocations = 0  # buffers made so far (reuse keeps it flat)

    def capacities(self) -> list[int]:
        return [0 if b is None else b.numel() for b in self._buffers]

    def _free_index(self) -> int:
        """A buffer no copy reads any more: one already done, else the oldest, waited for."""
        count = len(self._buffers)
        for step in range(count):
            i = (self._next + step) % count
            event = self._events[i]
            if event is None or event.query():
                return i
        i = self._next
        event = self._events[i]
        assert event is not None
        event.synchronize()
        return i

    def _grow_all(self, size: int) -> None:
        """Give every buffer ``size`` elements at once, so that after one warm-up call no later
        call of that size allocates pinned memory (an implicit cross-stream synchronisation):
        growing one buffer at a time left the next call to allocate the other. A buffer a copy
        may still read is waited for before it is dropped."""
        for j, old in enumerate(self._buffers):
            if old is not None and old.numel() >= size:
                continue
            event = self._events[j]
            if event is not None:
                event.synchronize()
                self._events[j] = None
            self._buffers[j] = torch.empty(size, dtype=torch.int64, pin_memory=self._pin)
            self.allocations += 1

    def upload(self, values: np.ndarray, out: torch.Tensor) -> torch.Tensor:
        """Copy ``values`` (int64, ``out.numel()`` of them) into ``out``; asynchronous on CUDA."""
        n = int(values.size)
        if n != out.numel():
            raise ValueError(f"{n} index values for a destination of {out.numel()}")
        with self._lock:
            i = self._free_index()
            self._events[i] = None  # done: no copy reads it any more
            buffer = self._buffers[i]
            if buffer is None or buffer.numel() < n:
                self._grow_all(max(n, 2 * max(self.capacities()), self._min))
                buffer = self._buffers[i]
                assert buffer is not None
            host = buffer[:n]
            host.numpy()[:] = values.reshape(-1)
            out.view(-1).copy_(host, non_blocking=True)
            self._events[i] = self._new_event(out.device)
            self._next = (i + 1) % len(self._buffers)
        return out


class StagingBuffer:
    """A device buffer of at most ``limit_bytes`` (or one piece, if a piece is larger).

    A copy takes it with :meth:`take` and gives it back with :meth:`release` after issuing its
    last use. Pieces of one call reuse it in the order of their one stream; a later call on
    another stream first makes that stream wait for the last use (a device-side wait).
    """

    def __init__(self, limit_bytes: int, new_event: EventFactory = cuda_event) -> None:
        if limit_bytes <= 0:
            raise ValueError(f"staging limit must be > 0 bytes, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self._new_event = new_event
        self._buffer: torch.Tensor | None = None
        self._event: Event | None = None
        self.allocations = 0

    @property
    def capacity_bytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def pieces(self, piece_bytes: int) -> int:
        """How many pieces of ``piece_bytes`` fit the bound (at least one)."""
        return max(1, self.limit_bytes // piece_bytes)

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """``nbytes`` of uint8 staging on ``device``, free of any earlier copy."""
        buffer = self._buffer
        if buffer is None or buffer.numel() < nbytes or buffer.device != device:
            if self._event is not None:
                self._event.synchronize()  # the old buffer goes only once nothing reads it
                self._event = None
            size = max(nbytes, min(self.limit_bytes, 2 * self.capacity_bytes))
            buffer = self._buffer = torch.empty(size, dtype=torch.uint8, device=device)
            self.allocations += 1
        elif self._event is not None and device.type == "cuda":
            torch.cuda.current_stream(device).wait_event(self._event)  # type: ignore[arg-type]
        return buffer[:nbytes]

    def release(self, device: torch.device) -> None:
        """The last use of the buffer has been issued on ``device``'s current stream."""
        self._event = self._new_event(device)


# ---------------------------------------------------------------- per registration

T = TypeVar("T")


def _host_signature(host: HostPool) -> tuple[int, int]:
    """What an entry read off the pool: a closed pool has another buffer."""
    return host.buffer.data_ptr(), host.buffer.numel()


class RegistrationCache(Generic[T]):
    """``build(dev, host)``, computed once per live pair (thread-safe: both lanes use it)."""

    def __init__(self, build: Callable[[KVViews, HostPool], T]) -> None:
        self._build = build
        self._by_dev: weakref.WeakKeyDictionary[
            KVViews, weakref.WeakKeyDictionary[HostPool, tuple[tuple[int, int], T]]
        ] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def get(self, dev: KVViews, host: HostPool) -> T:
        signature = _host_signature(host)
        with self._lock:
            per_host = self._by_dev.get(dev)
            if per_host is None:
                per_host = self._by_dev[dev] = weakref.WeakKeyDictionary()
            entry = per_host.get(host)
            if entry is None or entry[0] != signature:
                entry = per_host[host] = (signature, self._build(dev, host))
            return entry[1]

    def __len__(self) -> int:
        """Live entries (for tests and diagnostics)."""
        with self._lock:
            return sum(len(per_host) for per_host in list(self._by_dev.values()))


def select_backend(
    name: str = BackendName.AUTO,
    *,
    kv: KVViews | None = None,
    host: HostPool | None = None,
    vllm_copy_op: object | None = None,
    device: torch.device | None = None,
) -> CopyBackend:
    """The backend ``copy_backend`` names, checked against what this machine can run.

    ``auto``: on CUDA the GPU-verified default (torch); on CPU the native C copier, or torch's
    numpy-backed path (with a warning) when the extension is missing. The backends are
    imported here, not at the top: each of them imports this module.
    """
    from tieredkv.transfer.backends.cupy_backend import CupyCopyBackend
    from tieredkv.transfer.backends.native_backend import NativeCopyBackend
    from tieredkv.transfer.backends.torch_backend import TorchCopyBackend
    from tieredkv.transfer.backends.vllm_backend import VllmCopyBackend

    try:
        choice = BackendName(str(name).lower())
    except ValueError:
        raise ValueError(
            f"copy_backend={name!r}: expected one of {', '.join(BackendName)}"
        ) from None
    if device is None:
        device = kv.device if kv is not None else torch.device("cpu")
    if choice is BackendName.TORCH:
        return TorchCopyBackend()
    if choice is BackendName.NATIVE:
        ok, why = NativeCopyBackend.available(device)
        if not ok:
            raise ValueError(f"copy_backend='native' is not available here: {why}")
        return NativeCopyBackend()
    if choice is BackendName.VLLM:
        ok, why = VllmCopyBackend.available(vllm_copy_op, device)  # type: ignore[arg-type]
        if not ok:
            raise ValueError(f"copy_backend='vllm' is not available here: {why}")
        return VllmCopyBackend(vllm_copy_op)  # type: ignore[arg-type]
    if choice is BackendName.CUPY:
        ok, why = CupyCopyBackend.available(device, host)
        if not ok:
            raise ValueError(f"copy_backend='cupy' is not available here: {why}")
        return CupyCopyBackend(device)
    # BackendName.AUTO
    if device.type == "cuda":
        # torch's batched copies on the lane's stream, through the pool's device mapping:
        # verified on an H100 and an H200. CuPy passed the same checks and is about as fast
        # (benchmarks/results/gpu/), but needs cupy installed; it stays opt-in (copy_backend: cupy).
        return TorchCopyBackend()
    ok, why = NativeCopyBackend.available(device)
    if ok:
        return NativeCopyBackend()
    if device.type == "cpu":
        logger.warning("tieredkv: CPU copies use the slower numpy path: %s", why)
    return TorchCopyBackend()
