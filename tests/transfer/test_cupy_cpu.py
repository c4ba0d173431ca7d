"""The CuPy backend's calls into CuPy, checked on CPU against a stub ``cupy`` that has only the
names real CuPy has (``cupy_backends/cuda/api/runtime.pxd``), so a misspelt or invented CuPy
function fails here instead of silently disabling the backend on a GPU."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from test_copy_backends import C, _views

from tieredkv.transfer.backends.cupy_backend import CupyCopyBackend
from tieredkv.transfer.host_pool import HostPool

# cudaMemoryType, as CuPy's runtime module exposes it.
UNREGISTERED, HOST, DEVICE = 0, 1, 2


class _PointerAttributes:
    """CuPy's ``PointerAttributes``: exactly these four read-only fields."""

    __slots__ = ("device", "devicePointer", "hostPointer", "type")

    def __init__(self, device: int, device_pointer: int, host_pointer: int, kind: int) -> None:
        self.device, self.devicePointer, self.hostPointer, self.type = (
            device, device_pointer, host_pointer, kind,
        )


class _CUDARuntimeError(RuntimeError):
    pass


def _stub_cupy(pointer_attributes) -> types.ModuleType:
    """A ``cupy`` module whose runtime has the real CuPy names only (and no hostGetDevicePointer)."""
    runtime = types.SimpleNamespace(
        pointerGetAttributes=pointer_attributes,
        hostRegister=None, hostUnregister=None, CUDARuntimeError=_CUDARuntimeError,
        memoryTypeUnregistered=UNREGISTERED, memoryTypeHost=HOST, memoryTypeDevice=DEVICE,
        memoryTypeManaged=3,
    )
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(runtime=runtime)  # type: ignore[attr-defined]
    return cupy


class _Registrar:
    name = "test"

    def register(self, ptr: int, size: int) -> None:
        pass

    def unregister(self, ptr: int) -> None:
        pass


@pytest.fixture
def pinned_pool(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    pool = HostPool(2, 4096, pin=True, registrar=_Registrar())
    yield pool
    pool.close()


def _available(monkeypatch: pytest.MonkeyPatch, pool: HostPool, attrs) -> tuple[bool, str]:
    monkeypatch.setitem(sys.modules, "cupy", _stub_cupy(attrs))
    return CupyCopyBackend.available(torch.device("cuda", 0), pool)


def test_a_registered_pool_mapped_at_its_own_address_is_usable(monkeypatch, pinned_pool):
    asked: list[int] = []

    def attrs(ptr: int) -> _PointerAttributes:
        asked.append(ptr)
        return _PointerAttributes(0, ptr, ptr, HOST)

    assert _available(monkeypatch, pinned_pool, attrs) == (True, "")
    assert asked == [pinned_pool.buffer.data_ptr()]


@pytest.mark.parametrize(
    ("attrs", "why"),
    [
        (lambda ptr: _PointerAttributes(0, ptr + 4096, ptr, HOST), "device address differs"),
        (lambda ptr: _PointerAttributes(-2, 0, 0, UNREGISTERED), "not page-locked"),
        (lambda ptr: _PointerAttributes(0, ptr, 0, DEVICE), "not page-locked"),
    ],
    ids=["mapped-elsewhere", "unregistered", "device-memory"],
)
def test_a_pool_cuda_cannot_reach_at_its_own_address_is_refused(
    monkeypatch, pinned_pool, attrs, why
):
    usable, reason = _available(monkeypatch, pinned_pool, attrs)
    assert not usable and why in reason


def test_a_cuda_error_from_the_query_is_refused_with_its_reason(monkeypatch, pinned_pool):
    def attrs(ptr: int) -> _PointerAttributes:
        raise _CUDARuntimeError("cudaErrorInvalidValue: invalid argument")

    usable, reason = _available(monkeypatch, pinned_pool, attrs)
    assert not usable and "not mapped" in reason and "invalid argument" in reason


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize(
    "bad", ["device-block", "slot", "position"],
)
def test_an_out_of_range_pair_is_refused_before_any_address_is_computed(direction, bad):
    """The kernel copies raw addresses: a bad id would corrupt memory, so a direct caller of
    the backend (not only the transfer engine) gets a ValueError first."""
    kv = _views("LBHNC")
    host = HostPool(4, kv.slot_payload_bytes(C), pin=False)
    pair = {
        "device-block": (0, 0, (kv.num_blocks,)),
        "slot": (host.num_slots, 0, (1,)),
        "position": (0, C, (1,)),
    }[bad]
    backend = CupyCopyBackend.__new__(CupyCopyBackend)  # no cupy, no GPU: it must not get far
    with pytest.raises(ValueError, match="out of range|do not fit"):
        getattr(backend, direction)(kv, host, [pair])
    host.close()
