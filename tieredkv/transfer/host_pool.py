"""The host tier's memory: one page-aligned buffer carved into fixed-size slots, page-locked to
the byte, and the guard over which job reads or writes a slot while a copy is in flight.

One slot holds one offload chunk (all layers). Slots are 4 KiB multiples and the buffer is
page-aligned, so a slot can be handed straight to an O_DIRECT read or write of the disk tier
(no bounce buffer). With CUDA the buffer is page-locked, so device copies run at DMA speed:
exactly the bytes asked for, an anonymous mapping registered with CUDA (:class:`PinnedMapping`),
never PyTorch's power-of-two pinned blocks. Without CUDA it is plain anonymous memory. Which
slot belongs to which key is decided by the scheduler-side index, never here; which job may
touch a slot while copies run is :class:`SlotGuard`'s.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import threading
import weakref
from typing import Any, Protocol

import torch

from tieredkv.config import ConfigError, format_size
from tieredkv.disk.format import PAGE_BYTES, align_up  # disk pads slots alike (O_DIRECT)
from tieredkv.transfer.huge_pages import Advice, advise

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------- page-locked memory
# Page-locked host memory of exactly the size asked: an anonymous mapping registered with CUDA.
# Why not ``torch.empty(..., pin_memory=True)``: that goes through PyTorch's caching host
# allocator, which rounds every request up to a power of two and keeps the block for the
# process's life (``host_bytes: 40GiB`` would page-lock 64 GiB of RAM). ``cudaHostRegister``
# on an anonymous mapping locks exactly the pages asked for, and ``cudaHostUnregister`` gives
# them back when the host tier closes.

# cudaHostRegisterPortable | cudaHostRegisterMapped: pinned for every CUDA context, and mapped
# into the device address space (the CuPy backend's kernel reads the pool through UVA).
HOST_REGISTER_FLAGS = 1 | 2
CUDA_ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation: "out of memory"


class HostRegisterError(RuntimeError):
    """``cudaHostRegister`` refused; ``code`` is the cudaError value."""

    def __init__(self, code: int, text: str) -> None:
        super().__init__(f"cudaHostRegister failed: {text} (cudaError {code})")
        self.code = code


class Registrar(Protocol):
    """Page-locks and releases host memory (the CUDA runtime, or a test double)."""

    name: str

    def register(self, ptr: int, size: int) -> None: ...

    def unregister(self, ptr: int) -> None: ...


class TorchCudart:
    """``cudaHostRegister`` through PyTorch's own CUDA runtime bindings."""

    name = "torch.cuda.cudart"

    def __init__(self) -> None:
        self._rt: Any = torch.cuda.cudart()  # initialises CUDA; raises without it
        if not hasattr(self._rt, "cudaHostRegister"):
            raise RuntimeError("this torch build's cudart has no cudaHostRegister")

    def _text(self, code: int) -> str:
        try:
            return str(self._rt.cudaGetErrorString(self._rt.cudaError(code)))
        except Exception:  # noqa: BLE001 - an unknown code still gets reported by number
            return "unknown CUDA error"

    def register(self, ptr: int, size: int) -> None:
        code = int(self._rt.cudaHostRegister(ptr, size, HOST_REGISTER_FLAGS))
        if code:
            self._clear_last_error()
            raise HostRegisterError(code, self._text(code))

    def _clear_last_error(self) -> None:
        """Reset the thread's last CUDA error that the refusal left set: torch checks
        ``cudaGetLastError`` after every kernel launch, so the next one would raise it.
        torch's cudart bindings have no ``cudaGetLastError`` (newer ones might): call it in the
        libcudart this process loaded, if one is mapped (a static cudart cannot be reached)."""
        with contextlib.suppress(Exception):  # best effort: the refusal is what to report
            get_last_error = getattr(self._rt, "cudaGetLastError", None)
            if get_last_error is None:
                lib = loaded_cudart()
                get_last_error = None if lib is None else lib.cudaGetLastError
            if get_last_error is not None:
                get_last_error()

    def unregister(self, ptr: int) -> None:
        code = int(self._rt.cudaHostUnregister(ptr))
        if code:
            raise HostRegisterError(code, self._text(code))


class CupyRuntime:
    """``cudaHostRegister`` through CuPy, for torch builds without the cudart bindings."""

    name = "cupy.cuda.runtime"

    def __init__(self) -> None:
        import cupy

        self._rt = cupy.cuda.runtime

    def register(self, ptr: int, size: int) -> None:
        try:
            self._rt.hostRegister(ptr, size, HOST_REGISTER_FLAGS)
        except self._rt.CUDARuntimeError as exc:
            raise HostRegisterError(int(getattr(exc, "status", -1)), str(exc)) from exc

    def unregister(self, ptr: int) -> None:
        self._rt.hostUnregister(ptr)


def cuda_registrar() -> Registrar:
    """The first CUDA runtime binding that can page-lock memory here."""
    try:
        return TorchCudart()
    except (AssertionError, AttributeError, RuntimeError) as torch_exc:
        try:
            return CupyRuntime()
        except ImportError:
            raise RuntimeError(
                f"no CUDA runtime binding can page-lock host memory: torch.cuda.cudart() "
                f"failed ({torch_exc}) and cupy is not installed"
            ) from torch_exc


def cudart_path(maps: str) -> str | None:
    """The path of the shared libcudart in ``maps`` (``/proc/self/maps``'s text), if any."""
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
        path = fields[5].strip() if len(fields) == 6 else ""
        if os.path.basename(path).startswith("libcudart.so"):
            return path
    return None


def loaded_cudart() -> Any:
    """The libcudart already mapped into this process (dlopen returns that same copy, whose
    per-thread error state torch reads), or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            path = cudart_path(maps.read())
        return None if path is None else ctypes.CDLL(path)
    except OSError:
        return None


def _release(registrar: Registrar, ptr: int, mapping: mmap.mmap) -> None:
    """Unregister, then unmap (the unmap waits for any view still alive: BufferError)."""
    with contextlib.suppress(Exception):  # a dying CUDA context must not raise from close/gc
        registrar.unregister(ptr)
    with contextlib.suppress(BufferError):
        mapping.close()


class PinnedMapping:
    """``size`` bytes of anonymous, page-aligned memory, page-locked until :meth:`close`.

    ``pinned_bytes`` is what was registered: ``size`` rounded up to the OS page (equal to
    ``size`` whenever it is a page multiple, as host slots are).
    """

    def __init__(self, size: int, registrar: Registrar | None = None) -> None:
        if size <= 0:
            raise ValueError(f"size must be > 0, got {size}")
        self.size = size
        self.pinned_bytes = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        registrar = registrar if registrar is not None else cuda_registrar()
        self.registrar_name = registrar.name
        mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        dont_fork = getattr(mmap, "MADV_DONTFORK", None)  # Linux only
        if dont_fork is not None:
            # A fork() (a worker, a subprocess without exec) would otherwise copy every page of
            # the host tier into the child; pinned pages are no use there anyway.
            with contextlib.suppress(OSError):
                mapping.madvise(dont_fork)
        tensor = torch.frombuffer(mapping, dtype=torch.uint8)
        ptr = tensor.data_ptr()
        try:
            registrar.register(ptr, self.pinned_bytes)
        except BaseException:
            del tensor
            with contextlib.suppress(BufferError):
                mapping.close()
            raise
        self.tensor: torch.Tensor = tensor
        # Unregister even if close() is never called; not at interpreter exit, where the CUDA
        # context may already be gone and the OS takes the memory back anyway.
        self._finalizer = weakref.finalize(self, _release, registrar, ptr, mapping)
        self._finalizer.atexit = False

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Unpin and unmap; views handed out before must no longer be used."""
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self._finalizer()


# ---------------------------------------------------------------- the pool


def _is_allocation_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says the memory could not be had (as opposed to any other fault)."""
    if isinstance(exc, OverflowError | MemoryError):
        return True
    if isinstance(exc, OSError):
        return exc.errno == errno.ENOMEM
    if isinstance(exc, HostRegisterError):
        return exc.code == CUDA_ERROR_MEMORY_ALLOCATION
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    if oom is not None and isinstance(exc, oom):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


class HostPool:
    """A pool of ``num_slots`` slots of ``slot_bytes`` each (rounded up to 4 KiB)."""

    def __init__(
        self, num_slots: int, slot_bytes: int, pin: bool | None = None,
        registrar: Registrar | None = None, huge_pages: bool = False,
    ) -> None:
        """``huge_pages``: a pageable pool asks for transparent huge pages before its first
        byte is written (:mod:`~tieredkv.transfer.huge_pages`); a pinned one is unaffected."""
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        if slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be > 0, got {slot_bytes}")
        self.num_slots = num_slots
        self.payload_bytes = slot_bytes
        self.slot_bytes = align_up(slot_bytes)
        self.total_bytes = self.num_slots * self.slot_bytes
        want_pin = torch.cuda.is_available() if pin is None else pin
        self._mmap: mmap.mmap | None = None
        self._pinned: PinnedMapping | None = None
        self.pinned = False
        self.huge_pages: Advice | None = None  # what huge_pages=True got (pageable pools)
        size = max(self.total_bytes, PAGE_BYTES)
        self.requested_bytes = size
        try:
            if want_pin:
                # Exactly `size` bytes page-locked (not PyTorch's power-of-two caching blocks).
                self._pinned = PinnedMapping(size, registrar)
                self.buffer = self._pinned.tensor
                self.pinned = True
            else:
                # An anonymous mapping is page-aligned (O_DIRECT-safe) and lazily committed.
                self._mmap = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                self.buffer = torch.frombuffer(self._mmap, dtype=torch.uint8)
                if huge_pages:
                    self.huge_pages = advise(self.buffer.data_ptr(), size, collapse=False)
        except Exception as exc:
            if self._mmap is not None:
                with contextlib.suppress(BufferError):
                    self._mmap.close()
                self._mmap = None
            kind = "pinned" if want_pin else "pageable"
            what = (
                f"this rank's share of the host tier ({format_size(size)} of {kind} memory, "
                f"{num_slots} slots x {self.slot_bytes} bytes)"
            )
            if not _is_allocation_failure(exc):
                if want_pin:  # no CUDA binding, a driver refusal: still name the setting
                    raise RuntimeError(
                        f"tieredkv: host_bytes: {what} cannot be page-locked: {exc}"
                    ) from exc
                raise
            raise ConfigError(
                "host_bytes",
                f"{what} cannot be {'page-locked' if want_pin else 'allocated'}: {exc}; lower "
                "host_bytes (it is per engine, split across TP ranks)" + (
                    ", or allow more page-locked memory (ulimit -l, the container's memory "
                    "limit)" if want_pin else ""
                ),
                value=size,
            ) from exc
        self.allocation_path = (
            f"cudaHostRegister ({self._pinned.registrar_name})" if self._pinned else "mmap (pageable)"
        )
        self.pinned_bytes = self._pinned.pinned_bytes if self._pinned else 0
        huge = self.huge_pages
        logger.info(
            "tieredkv host tier: %d slots x %d bytes, %s %s (%s)%s",
            num_slots, self.slot_bytes, format_size(size),
            "pinned" if self.pinned else "pageable", self.allocation_path,
            "" if huge is None else
            f", huge pages asked for {format_size(huge.advised_bytes)}" if huge.ok else
            f", huge pages not available ({huge.hugepage_error or 'pool under 2 MiB'})",
        )

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"host slot {slot} out of range 0..{self.num_slots - 1}")

    def slot(self, slot: int) -> torch.Tensor:
        """The payload bytes of one slot (a view, no copy)."""
        self._check(slot)
        start = slot * self.slot_bytes
        return self.buffer[start : start + self.payload_bytes]

    def slot_padded(self, slot: int) -> torch.Tensor:
        """The whole 4 KiB-aligned slot, padding included (what O_DIRECT I/O moves)."""
        self._check(slot)
        start = slot * self.slot_bytes
        return self.buffer[start : start + self.slot_bytes]

    def slot_memoryview(self, slot: int) -> memoryview:
        """A writable memoryview of the padded slot, for positional disk I/O."""
        return memoryview(self.slot_padded(slot).numpy()).cast("B")

    def close(self) -> None:
        """Release the memory; views handed out before must no longer be used."""
        self.buffer = torch.empty(0, dtype=torch.uint8)
        if self._pinned is not None:
            self._pinned.close()
            self._pinned = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                # A view is still alive somewhere; the mapping goes when it does.
                pass
            self._mmap = None


# ---------------------------------------------------------------- slots in flight


class SlotGuard:
    """A per-host-slot in-flight map: many readers or one writer, refused rather than waited for.

    The scheduler's index pins every slot a job touches, so a conflict here is a bug upstream (or
    a disk read that timed out but is still writing into its slot). Either way the engine must
    not let a second job write a slot that another job is still reading or writing: the guard
    refuses the late job, which then fails with ``copy_error`` instead of corrupting bytes that
    are, or are about to be, served. Thread-safe: the event loop, the h2d lane thread (host-tier
    loads go there directly) and the worker thread (inline loads) all take slots.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._readers: dict[int, int] = {}
        self._writers: set[int] = set()

    def try_read(self, slot: int) -> bool:
        with self._lock:
            if slot not in self._writers:
                self._readers[slot] = self._readers.get(slot, 0) + 1
                return True
        return self._refuse(slot, "read", "a job is writing it")

    def try_write(self, slot: int) -> bool:
        with self._lock:
            if slot in self._writers:
                why = "another job is writing it"
            elif self._readers.get(slot):
                why = "a job is reading it"
            else:
                self._writers.add(slot)
                return True
        return self._refuse(slot, "write", why)

    def release(self, slot: int, write: bool) -> None:
        with self._lock:
            if write:
                self._writers.discard(slot)
                return
            count = self._readers.get(slot, 0) - 1
            if count > 0:
                self._readers[slot] = count
            else:
                self._readers.pop(slot, None)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._writers) + len(self._readers)

    def _refuse(self, slot: int, what: str, why: str) -> bool:
        logger.error(
            "tieredkv: refused to %s host slot %d while %s (the slot would be corrupted); "
            "the job fails with copy_error", what, slot, why,
        )
        return False
