"""Key makers the test packages share (import as ``from tests.helpers import ...``)."""

from __future__ import annotations

import hashlib


def short_key(i: int) -> bytes:
    """A 4-byte key: policies and tier indexes take any bytes."""
    return i.to_bytes(4, "big")


def wide_key(i: int) -> bytes:
    """A 32-byte key in counting order: journal records sort and read back as written."""
    return i.to_bytes(32, "big")


def make_key(i: int) -> bytes:
    """A chunk-key-shaped 32-byte key (a hash), distinct for every ``i``."""
    return hashlib.sha256(f"key-{i}".encode()).digest()
