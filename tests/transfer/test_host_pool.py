"""The host tier pins exactly the bytes asked for; one that cannot be allocated fails as a
ConfigError naming host_bytes."""

from __future__ import annotations

import errno
import gc
import mmap

import pytest
import torch

import tieredkv.transfer.host_pool as host_tier
from tieredkv.config import ConfigError
from tieredkv.transfer.host_pool import HostPool
from tieredkv.transfer.pinned_memory import CUDA_ERROR_MEMORY_ALLOCATION, HostRegisterError


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
