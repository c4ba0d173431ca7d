"""Fixtures for transfer tests: views of vLLM-shaped caches, host pools, real slab files."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from transfer_helpers import CHUNK_BLOCKS, FINGERPRINT, layout_caches, recording_io

from tieredkv.disk.format import slab_path
from tieredkv.transfer.backends.base import CopyBackend
from tieredkv.transfer.backends.torch_backend import TorchCopyBackend
from tieredkv.transfer.engine import TransferEngine
from tieredkv.transfer.host_pool import HostPool
from tieredkv.transfer.kv_views import KVViews


@pytest.fixture(scope="session")
def cuda_warm() -> float:
    """Once per session, before any CUDA ordering test: the GPU's clocks up and its spin delay
    calibrated warm (``cuda_warmup``); the calibrated ``_sleep`` cycles per millisecond."""
    import torch
    from cuda_ordering import warm_gpu

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return warm_gpu(torch.cuda.current_device())


@pytest.fixture
def kv() -> KVViews:
    return KVViews.from_kv_caches(layout_caches(), 40)


@pytest.fixture
def host(kv: KVViews) -> Iterator[HostPool]:
    pool = HostPool(12, kv.slot_payload_bytes(CHUNK_BLOCKS), pin=False)
    yield pool


@pytest.fixture
def fio() -> Iterator[object]:
    io = recording_io()
    yield io
    io.clear()


@pytest.fixture
def slab(tmp_path: Path, host: HostPool, fio: object) -> Iterator[object]:
    from tieredkv.disk.slab import SlabFile  # disk-tier imports stay out of GPU-only runs

    slab = SlabFile.open(slab_path(tmp_path, 0), 16, host.payload_bytes, FINGERPRINT, io=fio)
    yield slab
    slab.close()


@pytest.fixture
def make_engine(kv: KVViews, host: HostPool, slab: object) -> Iterator[Callable[..., TransferEngine]]:
    engines: list[TransferEngine] = []

    def make(backend: CopyBackend | None = None, *, with_slab: bool = True, **kw: object) -> TransferEngine:
        engine = TransferEngine(kv, host, slab if with_slab else None,
                                backend=backend or TorchCopyBackend(), **kw)  # type: ignore[arg-type]
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown(timeout_s=2.0)
