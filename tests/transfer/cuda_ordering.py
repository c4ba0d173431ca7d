"""A warm GPU, a calibrated delay and ordering probes for the CUDA ordering tests.

The ordering tests hold the compute stream with a spinning kernel and check that a copy
submitted meanwhile still lands after it. Two things can make such a test fail with nothing
wrong, and both are settled here once per session, before any ordering test:

- clocks: an idle GPU runs at a fraction of its boost clock, so a ``torch.cuda._sleep``
  calibrated cold spins for much less than asked once the clocks rise. The GPU is kept busy
  for a while first, then the spin is calibrated (the median of several samples);
- lazy kernel loading (``CUDA_MODULE_LOADING=LAZY``, the default) can synchronise the context
  the first time a kernel is launched: the kernels used here (the spin, the matmul, indexing
  and copies) are launched once now. Each ordering test also rehearses its own steps with
  nothing queued before it measures, which loads the rest (``rehearse``).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from functools import cache
from typing import Any

import torch

from tieredkv.transfer.backends.base import CopyBackend

WARM_MS = 400.0  # busy time before calibrating: enough for any H100/H200 to reach boost clocks
_SAMPLE_CYCLES = 20_000_000


def _cuda_index(device: torch.device | None = None) -> int:
    return (device.index if device is not None and device.index is not None
            else torch.cuda.current_device())


@cache
def warm_gpu(index: int = 0) -> float:
    """Warm ``cuda:index`` and return its calibrated ``_sleep`` cycles per millisecond."""
    device = torch.device("cuda", index)
    with torch.cuda.device(device):
        a = torch.randn(4096, 4096, device=device)
        b = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16)
        ids = torch.arange(0, 64, 2, device=device)
        rows = torch.zeros(64, 1024, dtype=torch.uint8, device=device)
        host = torch.empty(32, 1024, dtype=torch.uint8, pin_memory=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        while True:  # matmuls until WARM_MS of GPU time has passed: clocks up
            for _ in range(10):
                a = torch.tanh(a @ a)
                b = torch.tanh(b @ b)
            rows[ids] = rows.index_select(0, ids) + 1
            host.copy_(rows[ids], non_blocking=True)
            rows[ids] = host.to(device, non_blocking=True)
            end.record()
            end.synchronize()
            if start.elapsed_time(end) >= WARM_MS:
                break
        samples = []
        for _ in range(5):
            start.record()
            torch.cuda._sleep(_SAMPLE_CYCLES)
            end.record()
            end.synchronize()
            samples.append(_SAMPLE_CYCLES / max(start.elapsed_time(end), 1e-3))
        torch.cuda.synchronize(device)
    return statistics.median(samples)


def busy(device: torch.device, ms: float) -> None:
    """Queue about ``ms`` of spinning on the current stream (the GPU warmed first)."""
    torch.cuda._sleep(int(ms * warm_gpu(_cuda_index(device))))


def still_pending(event: torch.cuda.Event | None) -> bool:
    """True when ``event`` (recorded after queued work) has not completed yet; CPU: True."""
    return event is None or not event.query()


def assert_still_queued(event: Any, what: str) -> None:
    """CUDA: the forward had not run yet when the jobs were submitted (else the test proves
    nothing about ordering). Each ordering test rehearses first (``rehearse``), so no lazy
    kernel load or first allocation synchronises the device while the forward is queued."""
    assert still_pending(event), (
        f"the forward finished before {what} was submitted: something synchronised the device"
    )


class IssueProbe(CopyBackend):
    """Wraps the engine's backend; notes, as each copy is issued on its lane (after the lane's
    stream was told to wait for the compute mark), whether ``forward`` is still pending. A
    copy issued after the forward completed proves nothing about stream ordering."""

    name = "issue-probe"

    def __init__(self, inner: CopyBackend, forward: Any) -> None:
        self.inner = inner
        self.forward = forward
        self.pending_at_issue: list[tuple[str, bool]] = []
        # (direction, pending, ms since the probe was made at issue, ms the call took): says
        # whether a copy call itself synchronised the device (a long call, the next not
        # pending) or the lane was late (a late first issue).
        self.timeline: list[tuple[str, bool, float, float]] = []
        self._t0 = time.perf_counter()

    def _issue(self, direction: str, copy: Callable[..., None], args: tuple[Any, ...]) -> None:
        pending = still_pending(self.forward)
        self.pending_at_issue.append((direction, pending))
        start = time.perf_counter()
        copy(*args)
        end = time.perf_counter()
        self.timeline.append((direction, pending, round((start - self._t0) * 1e3, 2),
                              round((end - start) * 1e3, 2)))

    def d2h(self, *args: Any) -> None:
        self._issue("d2h", self.inner.d2h, args)

    def h2d(self, *args: Any) -> None:
        self._issue("h2d", self.inner.h2d, args)

    def assert_issued_while_pending(self, direction: str) -> None:
        issued = [pending for d, pending in self.pending_at_issue if d == direction]
        assert issued, f"no {direction} copy was issued"
        assert all(issued), (
            f"a {direction} copy was issued after the forward had finished: the bytes prove "
            "nothing about stream ordering (something synchronised the device first); "
            f"(direction, pending, issued at ms, call ms): {self.timeline}"
        )


def rehearse(device: torch.device, run: Callable[[], object]) -> None:
    """Run ``run`` (the test's own steps, no delay) once and wait for the device: every kernel,
    lane thread, staging buffer and allocation the measured run uses then exists already.
    Lazy kernel loading can synchronise the whole context on a first launch, which would let
    the queued forward finish before a copy is issued and fail the test with nothing wrong."""
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    # Garbage from earlier tests (a pinned pool's unregistering, a freed stream) must not be
    # collected while the measured forward is queued: both synchronise the device.
    gc.collect()
