"""Loopback ports for servers we start (vLLM, redis-server) that no other process can take first."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_LINUX_EPHEMERAL = (32768, 60999)
_handed_out: set[int] = set()
_SERVER_PORTS = (10000, 19999)


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return _LINUX_EPHEMERAL


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(also_free_at: int = 0) -> int:
    """A free loopback port below the ephemeral range (``port + also_free_at`` free and below too).

    A port from ``bind(0)`` or one inside the ephemeral range can be taken by any outgoing
    connection between our check and the server's own bind; below the range only a server
    that binds it explicitly can. ``also_free_at`` is Redis Cluster's bus offset (10000).
    Every server's port comes from 10000-19999, so no server's port can be a cluster node's
    bus port (20000 and up); a port handed out is never handed out again in this process.
    """
    low, high = _SERVER_PORTS
    if high + also_free_at >= ephemeral_range()[0]:  # an unusual kernel setting
        low, high = 1024, 65535 - also_free_at
    for _ in range(500):
        port = random.randint(low, high)
        if port in _handed_out or not _bindable(port):
            continue
        if also_free_at and (port + also_free_at in _handed_out or not _bindable(port + also_free_at)):
            continue
        _handed_out.add(port)
        if also_free_at:
            _handed_out.add(port + also_free_at)
        return port
    raise RuntimeError(f"no free loopback port in {low}-{high}")
