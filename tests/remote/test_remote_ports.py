"""Ports for the servers we start stay out of the kernel's ephemeral range (a CI run lost one)."""

from __future__ import annotations

import socket
from collections.abc import Callable

from tests.remote.remote_helpers import RedisServer
from tieredkv.tools.ports import ephemeral_range, free_port


def test_ports_are_free_distinct_and_below_the_ephemeral_range() -> None:
    low = ephemeral_range()[0]
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == 20
    for port in ports:
        assert 10000 <= port < 20000 <= low  # never a cluster bus port (20000 and up)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_cluster_bus_port_is_free_and_below_the_range_too() -> None:
    port = free_port(also_free_at=10000)
    assert port + 10000 < ephemeral_range()[0]
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", port))
        b.bind(("127.0.0.1", port + 10000))


def test_redis_server_moves_to_another_port_when_its_port_is_taken(
    fresh_server: Callable[..., RedisServer],
) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        server = fresh_server(start=False)  # stopped after the test
        server.port = taken  # as if someone bound it after free_port() checked
        server.start()
        assert server.port != taken
        assert server.cli("ping") == "PONG"
