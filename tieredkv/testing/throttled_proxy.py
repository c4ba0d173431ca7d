"""A Redis made slow on purpose: a loopback TCP proxy that delays what the server sends back.

The cost model must decline hits from a Redis that reads slower than the engine recomputes
(issue 25). A real slow Redis is hard to get on one machine, and a paused server stops
answering probes too, so tests and benchmarks put this proxy between tieredkv and a real
redis-server: a value's bytes come back slowly while probes and writes (short replies) pass
at full speed.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path
from time import sleep

from tieredkv.tools.ports import free_port

BLOCK_BYTES = 1 << 14  # what one receive takes; a block this long (a value's bytes) waits


class ThrottledProxy:
    """A loopback TCP proxy to a Redis: while ``flag`` exists, each block of 16 KiB or more
    the server sends back (a value, not a probe's or a write's short reply) waits
    ``delay_s`` first. Connections are accepted and pumped on daemon threads;
    :meth:`close` stops accepting and closes every connection."""

    def __init__(self, target_port: int, flag: Path, delay_s: float) -> None:
        self._target, self._flag, self._delay = target_port, flag, delay_s
        self._listener = socket.create_server(("127.0.0.1", free_port()))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="throttled-proxy").start()

    @property
    def url(self) -> str:
        """The ``remote_url`` that reaches the target through the proxy."""
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(("127.0.0.1", self._target))
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._closed:
                    client.close()
                    upstream.close()
                    return
                self._sockets |= {client, upstream}
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, throttled: bool) -> None:
        try:
            while data := src.recv(BLOCK_BYTES):
                if throttled and len(data) >= BLOCK_BYTES and self._flag.exists():
                    sleep(self._delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(sock)
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)  # wakes a pump blocked in recv on it
        sock.close()

    def close(self) -> None:
        """Stop accepting and close every connection (their pumps end)."""
        with self._lock:
            self._closed = True
            sockets, self._sockets = set(self._sockets), set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop
        self._listener.close()
        for sock in sockets:
            self._drop(sock)
