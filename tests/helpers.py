"""Key makers and helpers the test packages share (import as ``from tests.helpers import ...``)."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from typing import TypeVar

_T = TypeVar("_T")

#: How long :func:`finishes` lets a call run: no healthy run comes near it on a loaded machine.
HANG_S = 30.0


def finishes(call: Callable[[], _T], within_s: float = HANG_S) -> _T:
    """``call()``'s result, run on a thread; fails the test if it has not returned within
    ``within_s``. The bound only turns a hang into a failure: tests assert what the call did
    and in what order, never how long it took."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name="tests-finishes", daemon=True)
    thread.start()
    thread.join(within_s)
    assert outcome, f"{getattr(call, '__name__', call)!s} did not return within {within_s:.0f} s"
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def short_key(i: int) -> bytes:
    """A 4-byte key: policies and tier indexes take any bytes."""
    return i.to_bytes(4, "big")


def wide_key(i: int) -> bytes:
    """A 32-byte key in counting order: journal records sort and read back as written."""
    return i.to_bytes(32, "big")


def make_key(i: int) -> bytes:
    """A chunk-key-shaped 32-byte key (a hash), distinct for every ``i``."""
    return hashlib.sha256(f"key-{i}".encode()).digest()


def full_attention_spec(block_size: int, num_kv_heads: int, head_size: int, page_size_bytes: int):
    """vLLM's ``FullAttentionSpec`` with a given page size (one block of one layer), for tests
    that describe a KV cache by hand (tieredkv refuses kinds of attention it does not know).
    Without vLLM (the GPU check's bare machine): a stand-in of the same class name."""
    try:
        import torch
        from vllm.v1.kv_cache_interface import FullAttentionSpec
    except ImportError:
        from types import SimpleNamespace

        stand_in = type("FullAttentionSpec", (SimpleNamespace,), {})
        return stand_in(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                        page_size_bytes=page_size_bytes)
    return FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                             dtype=torch.int8, page_size_padded=page_size_bytes)


def vma(addr: int) -> dict[str, str]:
    """The /proc/self/smaps entry of the mapping holding ``addr``: its fields, and VmFlags."""
    entry: dict[str, str] | None = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                entry = {} if lo <= addr < hi else None
            elif entry is not None:
                key, _, value = line.partition(":")
                entry[key] = value.strip()
                if key == "VmFlags":
                    return entry
    raise AssertionError(f"no mapping holds {addr:#x}")


def aligned_inside(ptr: int) -> int:
    """The first 2 MiB boundary at or after ``ptr`` (where huge-page advice starts)."""
    return -(-ptr // (2 * 1024 * 1024)) * (2 * 1024 * 1024)
