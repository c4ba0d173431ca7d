"""Daemon threads that run queued calls: the one loop the I/O pool and copy lanes share.

Not ``ThreadPoolExecutor``: that one joins its threads at interpreter exit, so one call stuck
on a wedged disk or device would hang the engine's shutdown.
"""

from __future__ import annotations

import queue
from typing import Any

STOP = object()
"""Put on the queue to end one thread (after the calls queued before it)."""


def serve_calls(calls: queue.SimpleQueue[Any]) -> None:
    """Run ``(future, fn, args)`` items until :data:`STOP`; every outcome lands in its future."""
    while True:
        item = calls.get()
        if item is STOP:
            return
        future, fn, args = item
        if not future.set_running_or_notify_cancel():
            continue
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the waiter, never lost in the thread
            future.set_exception(exc)
        else:
            future.set_result(result)
