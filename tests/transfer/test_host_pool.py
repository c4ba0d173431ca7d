"""The host tier pins exactly the bytes asked for; one that cannot be allocated fails as a
ConfigError naming host_bytes."""

from __future__ import annotations

import errno
import gc
import mmap
import os
import types

import pytest
import torch

import tieredkv.transfer.host_pool as host_tier
from tieredkv.config import ConfigError
from tieredkv.transfer.host_pool import (
    CUDA_ERROR_MEMORY_ALLOCATION,
    HostPool,
    HostRegisterError,
    PinnedMapping,
    TorchCudart,
)


@pytest.mark.parametrize(
    "num_slots",
    [
        2**62 // 4096,  # 4 EiB: mmap fails with ENOMEM
        2**64 // 4096,  # beyond ssize_t: mmap raises OverflowError
    ],
)
def test_unallocatable_pageable_pool_names_host_bytes(num_slots):
    with pytest.raises(ConfigError) as err:
        HostPool(num_slots, 4096, pin=False)
    assert err.value.key == "host_bytes"
    assert "host_bytes" in str(err.value) and "lower host_bytes" in str(err.value)
    assert isinstance(err.value.__cause__, OSError | OverflowError)


class _Registrar:
    """Stands in for cudaHostRegister (no GPU here): records what would be page-locked."""

    name = "test"

    def __init__(self, fail: HostRegisterError | None = None) -> None:
        self.fail = fail
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []

    def register(self, ptr: int, size: int) -> None:
        if self.fail is not None:
            raise self.fail
        self.registered[ptr] = size

    def unregister(self, ptr: int) -> None:
        self.unregistered.append(ptr)


# 5 slots of 192 KiB: 960 KiB, not a power of two, a multiple of any OS page size up to 64 KiB.
ODD_SLOTS, ODD_SLOT_BYTES = 5, 3 * 65536


def test_pinned_pool_page_locks_exactly_the_requested_bytes():
    """Not PyTorch's caching host allocator, which would round 960 KiB up to 1 MiB (and
    host_bytes 40GiB up to 64 GiB), kept for the process's life."""
    registrar = _Registrar()
    pool = HostPool(ODD_SLOTS, ODD_SLOT_BYTES, pin=True, registrar=registrar)
    requested = ODD_SLOTS * ODD_SLOT_BYTES
    assert pool.pinned and pool.allocation_path == "cudaHostRegister (test)"
    assert pool.requested_bytes == pool.pinned_bytes == pool.buffer.numel() == requested
    assert registrar.registered == {pool.buffer.data_ptr(): requested}
    assert pool.buffer.data_ptr() % mmap.PAGESIZE == 0
    pool.slot(4).fill_(3)  # the mapping is real, writable memory
    assert int(pool.slot(4)[-1]) == 3
    ptr = pool.buffer.data_ptr()
    pool.close()
    assert registrar.unregistered == [ptr]
    pool.close()  # twice is harmless
    assert registrar.unregistered == [ptr]


def test_pinned_pool_is_unregistered_when_dropped_without_close():
    registrar = _Registrar()
    pool = HostPool(2, 4096, pin=True, registrar=registrar)
    ptr = pool.buffer.data_ptr()
    del pool
    gc.collect()
    assert registrar.unregistered == [ptr]


def test_pageable_pool_allocates_exactly_the_requested_bytes():
    pool = HostPool(ODD_SLOTS, ODD_SLOT_BYTES, pin=False)
    assert not pool.pinned and pool.allocation_path == "mmap (pageable)"
    assert pool.pinned_bytes == 0
    assert pool.requested_bytes == pool.buffer.numel() == ODD_SLOTS * ODD_SLOT_BYTES
    assert pool.buffer.data_ptr() % mmap.PAGESIZE == 0
    pool.close()


def test_pinned_out_of_memory_names_host_bytes():
    registrar = _Registrar(HostRegisterError(CUDA_ERROR_MEMORY_ALLOCATION, "out of memory"))
    with pytest.raises(ConfigError) as err:
        HostPool(4, 4096, pin=True, registrar=registrar)
    message = str(err.value)
    assert err.value.key == "host_bytes" and "pinned" in message and "16KiB" in message
    assert "lower host_bytes" in message and "ulimit -l" in message
    assert isinstance(err.value.__cause__, HostRegisterError)


def test_other_failures_are_not_dressed_up_as_config_errors(monkeypatch):
    registrar = _Registrar(HostRegisterError(35, "CUDA driver version is insufficient"))
    with pytest.raises(RuntimeError, match="host_bytes.*driver") as err:
        HostPool(4, 4096, pin=True, registrar=registrar)
    assert not isinstance(err.value, ConfigError)

    def no_fd(*args, **kwargs):
        raise OSError(errno.EBADF, "bad file descriptor")

    monkeypatch.setattr(host_tier.mmap, "mmap", no_fd)
    with pytest.raises(OSError) as os_err:
        HostPool(4, 4096, pin=False)
    assert not isinstance(os_err.value, ConfigError) and os_err.value.errno == errno.EBADF


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pinned_pool_is_exactly_the_requested_size_and_page_locked():
    pool = HostPool(ODD_SLOTS, ODD_SLOT_BYTES, pin=True)
    requested = ODD_SLOTS * ODD_SLOT_BYTES
    assert pool.allocation_path.startswith("cudaHostRegister")
    assert pool.pinned_bytes == requested == pool.buffer.numel()
    assert pool.buffer.is_pinned() and pool.slot(3).is_pinned()
    device = torch.arange(ODD_SLOT_BYTES, device="cuda").to(torch.uint8)
    pool.slot(3).copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(pool.slot(3), device.cpu())
    pool.close()


def test_a_normal_pool_still_allocates():
    pool = HostPool(3, 5000, pin=False)
    assert pool.slot_bytes == 8192 and pool.buffer.numel() == 3 * 8192
    pool.slot(2).fill_(7)
    assert int(pool.slot(2)[0]) == 7
    pool.close()


# ---------------------------------------------------------------------- fork, CUDA error state


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding ``address``, from /proc/self/smaps."""
    with open("/proc/self/smaps", encoding="utf-8") as smaps:
        inside = False
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and ":" not in head:
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(
    not hasattr(mmap, "MADV_DONTFORK") or not os.path.exists("/proc/self/smaps"),
    reason="MADV_DONTFORK and /proc/self/smaps are Linux's",
)
def test_the_pinned_host_tier_is_not_copied_into_a_forked_child():
    """Marked MADV_DONTFORK (smaps VmFlag "dc", do not copy on fork) before it is page-locked: a fork() would otherwise copy
    the whole host tier into the child."""
    flags_at_register: list[list[str]] = []

    class Recording(_Registrar):
        def register(self, ptr: int, size: int) -> None:
            flags_at_register.append(_vm_flags(ptr))
            super().register(ptr, size)

    pool = HostPool(ODD_SLOTS, ODD_SLOT_BYTES, pin=True, registrar=Recording())
    assert "dc" in flags_at_register[0]
    assert "dc" in _vm_flags(pool.buffer.data_ptr() + pool.buffer.numel() - 1)
    pool.close()


class _Cudart:
    """torch.cuda.cudart() as a CUDA build has it; cudaHostRegister refuses with ``code``."""

    def __init__(self, code: int, with_get_last_error: bool, calls: list[str]) -> None:
        self.code, self.calls = code, calls
        if with_get_last_error:
            self.cudaGetLastError = lambda: calls.append("cudaGetLastError") or self.code

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append("cudaHostRegister")
        return self.code

    def cudaHostUnregister(self, ptr: int) -> int:
        return 0

    def cudaError(self, code: int) -> int:
        return code

    def cudaGetErrorString(self, code: int) -> str:
        return "out of memory"


@pytest.mark.parametrize("binding_has_it", [True, False], ids=["cudart-binding", "libcudart"])
def test_a_refused_registration_clears_the_cuda_error_it_left(monkeypatch, binding_has_it):
    """The refusal stays the thread's last CUDA error, which torch's check after the next
    kernel launch would raise: it is cleared before the refusal is reported."""
    calls: list[str] = []
    cudart = _Cudart(CUDA_ERROR_MEMORY_ALLOCATION, binding_has_it, calls)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    library = types.SimpleNamespace(cudaGetLastError=lambda: calls.append("libcudart") or 0)
    monkeypatch.setattr(host_tier, "loaded_cudart", lambda: library)
    with pytest.raises(HostRegisterError) as err:
        PinnedMapping(4096, TorchCudart())
    assert err.value.code == CUDA_ERROR_MEMORY_ALLOCATION
    cleared = "cudaGetLastError" if binding_has_it else "libcudart"
    assert calls == ["cudaHostRegister", cleared]


def test_the_loaded_libcudart_is_found_in_the_process_maps():
    maps = (
        "7f00-7f10 r--p 00000000 fe:00 11   /usr/lib/libc.so.6\n"
        "7f20-7f30 r-xp 00000000 00:00 0 \n"
        "7f40-7f50 r-xp 00001000 fe:00 12   /venv/nvidia/cuda_runtime/lib/libcudart.so.12\n"
    )
    assert host_tier.cudart_path(maps) == "/venv/nvidia/cuda_runtime/lib/libcudart.so.12"
    assert host_tier.cudart_path(maps.splitlines()[0]) is None
