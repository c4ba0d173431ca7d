"""A host tier that cannot be allocated fails as a ConfigError naming host_bytes."""

from __future__ import annotations

import errno

import pytest

import tieredkv.transfer.host_pool as host_tier
from tieredkv.config import ConfigError
from tieredkv.transfer.host_pool import HostPool


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


def test_pinned_out_of_memory_names_host_bytes(monkeypatch):
    def no_pinned_memory(*args, **kwargs):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(host_tier.torch, "empty", no_pinned_memory)
    with pytest.raises(ConfigError) as err:
        HostPool(4, 4096, pin=True)
    assert err.value.key == "host_bytes" and "pinned" in str(err.value)


def test_other_failures_are_not_dressed_up_as_config_errors(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA driver version is insufficient")

    monkeypatch.setattr(host_tier.torch, "empty", broken)
    with pytest.raises(RuntimeError, match="driver"):
        HostPool(4, 4096, pin=True)

    def no_fd(*args, **kwargs):
        raise OSError(errno.EBADF, "bad file descriptor")

    monkeypatch.setattr(host_tier.mmap, "mmap", no_fd)
    with pytest.raises(OSError) as err:
        HostPool(4, 4096, pin=False)
    assert not isinstance(err.value, ConfigError) and err.value.errno == errno.EBADF


def test_a_normal_pool_still_allocates():
    pool = HostPool(3, 5000, pin=False)
    assert pool.slot_bytes == 8192 and pool.buffer.numel() == 3 * 8192
    pool.slot(2).fill_(7)
    assert int(pool.slot(2)[0]) == 7
    pool.close()
