"""The throttling proxy the slow-Redis test and benchmark row put before a redis-server: a
value's bytes wait while the flag exists, short replies and requests never do, and close()
ends its connections. A plain TCP server stands in for Redis; the delay is counted, not
timed."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from tieredkv.testing import throttled_proxy
from tieredkv.testing.throttled_proxy import BLOCK_BYTES, ThrottledProxy

BIG = 1 << 20  # a value's worth of bytes: many full 16 KiB blocks


def serve(listener: socket.socket) -> None:
    """Answer each 1-byte request: ``b"b"`` with BIG bytes, anything else with 4 bytes."""
    conn, _ = listener.accept()
    with conn:
        while request := conn.recv(1):
            conn.sendall(b"x" * (BIG if request == b"b" else 4))


def receive(sock: socket.socket, n: int) -> int:
    got = 0
    while got < n and (data := sock.recv(1 << 16)):
        got += len(data)
    return got


@pytest.fixture
def proxied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    sleeps: list[float] = []
    monkeypatch.setattr(throttled_proxy, "sleep", sleeps.append)
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=serve, args=(listener,), daemon=True).start()
    flag = tmp_path / "slow"
    flag.touch()
    proxy = ThrottledProxy(listener.getsockname()[1], flag, 0.25)
    client = socket.create_connection(("127.0.0.1", proxy.port), timeout=30)
    yield proxy, client, flag, sleeps
    client.close()
    proxy.close()
    listener.close()


def test_only_a_values_blocks_wait_and_only_while_the_flag_exists(proxied):
    proxy, client, flag, sleeps = proxied
    client.sendall(b"s")
    assert receive(client, 4) == 4 and sleeps == []  # a short reply passes at once
    client.sendall(b"b")
    assert receive(client, BIG) == BIG
    assert sleeps and set(sleeps) == {0.25} and len(sleeps) <= BIG // BLOCK_BYTES
    flag.unlink()
    before = len(sleeps)
    client.sendall(b"b")
    assert receive(client, BIG) == BIG and len(sleeps) == before  # the throttle removed
    assert proxy.url == f"redis://127.0.0.1:{proxy.port}/0"


def test_close_ends_the_connections_and_stops_accepting(proxied):
    proxy, client, _, _ = proxied
    client.sendall(b"s")
    assert receive(client, 4) == 4
    proxy.close()
    assert client.recv(1) == b""  # the proxy closed its side
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", proxy.port), timeout=5).close()
