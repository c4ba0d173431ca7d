"""The host tier's memory: one page-aligned buffer carved into fixed-size slots.

One slot holds one offload chunk (all layers). Slots are 4 KiB multiples and the buffer is
page-aligned, so a slot can be handed straight to an O_DIRECT read or write of the disk tier
(no bounce buffer). With CUDA the buffer is page-locked, so device copies run at DMA speed:
exactly the bytes asked for, an anonymous mapping registered with CUDA
(:mod:`~tieredkv.transfer.pinned_memory`), never PyTorch's power-of-two pinned blocks.
Without CUDA it is plain anonymous memory. Which slot belongs to which key is decided by the
scheduler-side index, never here.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap

import torch

from tieredkv.config import ConfigError, format_size
from tieredkv.disk.files import PAGE_BYTES, align_up  # disk pads slots alike (O_DIRECT)
from tieredkv.transfer.pinned_memory import (
    CUDA_ERROR_MEMORY_ALLOCATION,
    HostRegisterError,
    PinnedMapping,
    Registrar,
)

logger = logging.getLogger(__name__)


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
        registrar: Registrar | None = None,
    ) -> None:
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
        logger.info(
            "tieredkv host tier: %d slots x %d bytes, %s %s (%s)",
            num_slots, self.slot_bytes, format_size(size),
            "pinned" if self.pinned else "pageable", self.allocation_path,
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
