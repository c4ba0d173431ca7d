"""Stops tieredkv's device copies before vLLM's sleep mode frees the device memory.

vLLM 0.32 tells no connector about sleep: ``Worker.sleep`` unmaps the KV cache (and the
weights) while a store may still be reading blocks or a load writing them, a fault on CUDA.
So, in each worker process that runs a tieredkv worker half, the GPU worker class's
``sleep`` and ``wake_up`` are wrapped (once): before the real ``sleep``, every live worker
half pauses its device copies (queued stores cancelled, running copies waited for, new
stores and loads refused); after the real ``wake_up``, they resume. Host and disk tiers are
untouched: what they hold is still valid after waking. The CPU build has no sleep mode (its
worker overrides ``sleep`` with a warning), so there nothing changes.
"""

from __future__ import annotations

import functools
import logging
import sys
import weakref
from typing import Any, Protocol

logger = logging.getLogger(__name__)

_WORKER_MODULE = "vllm.v1.worker.gpu_worker"
_MARK = "_tieredkv_sleep_hook"


class SleepAware(Protocol):
    def before_sleep(self) -> None: ...

    def after_wake_up(self) -> None: ...


_halves: weakref.WeakSet[Any] = weakref.WeakSet()


def install(half: SleepAware, worker_class: type | None = None) -> None:
    """Register ``half`` and wrap the worker class's sleep/wake_up if not done yet.

    ``worker_class`` defaults to vLLM's GPU ``Worker`` when its module is already loaded in
    this process (a worker process always has it; nothing is imported here).
    """
    _halves.add(half)
    if worker_class is None:
        module = sys.modules.get(_WORKER_MODULE)
        worker_class = getattr(module, "Worker", None) if module is not None else None
    if worker_class is None:
        return
    patch_worker_class(worker_class)


def patch_worker_class(worker_class: type) -> None:
    """Wrap ``worker_class.sleep`` and ``wake_up`` (idempotent)."""
    sleep = getattr(worker_class, "sleep", None)
    wake_up = getattr(worker_class, "wake_up", None)
    if sleep is None or wake_up is None or getattr(sleep, _MARK, False):
        return

    @functools.wraps(sleep)
    def sleep_after_pausing_tieredkv(self: Any, *args: Any, **kwargs: Any) -> Any:
        for half in list(_halves):
            try:
                half.before_sleep()
            except Exception:  # noqa: BLE001 - never stop vLLM from sleeping
                logger.exception("tieredkv: pausing device copies before sleep failed")
        return sleep(self, *args, **kwargs)

    @functools.wraps(wake_up)
    def wake_up_then_resume_tieredkv(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = wake_up(self, *args, **kwargs)
        for half in list(_halves):
            try:
                half.after_wake_up()
            except Exception:  # noqa: BLE001 - a failed resume must not break vLLM's wake-up
                logger.exception("tieredkv: resuming device copies after wake-up failed")
        return result

    setattr(sleep_after_pausing_tieredkv, _MARK, True)
    setattr(wake_up_then_resume_tieredkv, _MARK, True)
    worker_class.sleep = sleep_after_pausing_tieredkv  # type: ignore[attr-defined]
    worker_class.wake_up = wake_up_then_resume_tieredkv  # type: ignore[attr-defined]
    logger.debug("tieredkv: wrapped %s.sleep/wake_up", worker_class.__qualname__)
