"""Bounded reads take turns per node (issue #25, point 3): at most ``READ_BYTES_PER_NODE`` of
values and ``READS_PER_NODE`` reads asked of one node at once, the rest waiting in the order
they came, so a prompt's batches arrive one after another (each lands while the next is read)
instead of all at the end of a round robin over as many connections."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from redis import exceptions as rex

from tests.remote.remote_helpers import RedisServer, chunk_items
from tieredkv.remote import bounded_read as br
from tieredkv.remote.read_turns import READ_BYTES_PER_NODE, ReadTurns
from tieredkv.remote.store import Head

OpenStore = Callable[..., Awaitable[Any]]


class _Reads:
    """Reads that hold a turn until told to finish; records who held one, and when."""

    def __init__(self, turns: ReadTurns) -> None:
        self.turns = turns
        self.inside: list[str] = []
        self.entered: list[str] = []
        self.finish: dict[str, asyncio.Event] = {}

    def start(self, name: str, node: str, size: int) -> asyncio.Task[None]:
        self.finish[name] = asyncio.Event()

        async def read() -> None:
            async with self.turns.of(node, size):
                self.inside.append(name)
                self.entered.append(name)
                try:
                    await self.finish[name].wait()
                finally:
                    self.inside.remove(name)

        return asyncio.create_task(read())


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_reads_past_a_nodes_bytes_wait_their_turn_in_order() -> None:
    reads = _Reads(ReadTurns(10))
    tasks = [reads.start(f"a{i}", "a", 4) for i in range(4)] + [reads.start("b0", "b", 4)]
    await _settle()
    assert sorted(reads.inside) == ["a0", "a1", "b0"]  # 8 of a's 10 bytes; b has its own
    assert reads.turns.asked("a") == 8
    reads.finish["a1"].set()  # the second one ends first: the next in line goes, not a3
    await _settle()
    assert sorted(reads.inside) == ["a0", "a2", "b0"]
    for name in ("a0", "a2", "a3", "b0"):
        reads.finish[name].set()
    await asyncio.gather(*tasks)
    assert reads.entered == ["a0", "a1", "b0", "a2", "a3"]
    assert reads.turns.asked("a") == reads.turns.asked("b") == 0


async def test_small_reads_of_one_node_go_two_at_a_time_whatever_their_bytes() -> None:
    """A Cluster cuts a batch into a part per node: small parts must not go all at once on
    as many connections (each node would answer them round robin, all at the end)."""
    reads = _Reads(ReadTurns(10, reads_per_node=2))
    tasks = [reads.start(f"a{i}", "a", 1) for i in range(4)] + [
        reads.start(f"b{i}", "b", 1) for i in range(3)]
    await _settle()
    assert sorted(reads.inside) == ["a0", "a1", "b0", "b1"]  # 2 of 10 bytes, yet no third
    reads.finish["a0"].set()
    await _settle()
    assert sorted(reads.inside) == ["a1", "a2", "b0", "b1"]
    for name in reads.finish:
        reads.finish[name].set()
    await asyncio.gather(*tasks)
    assert reads.entered.index("a3") > reads.entered.index("a2") and reads.turns.asked("a") == 0


async def test_a_read_bigger_than_the_bound_goes_alone() -> None:
    reads = _Reads(ReadTurns(10))
    big = reads.start("big", "a", 25)
    small = reads.start("small", "a", 1)
    await _settle()
    assert reads.inside == ["big"]  # alone, never refused: the bound is a pace, not a cap
    reads.finish["big"].set()
    await _settle()
    assert reads.inside == ["small"]
    reads.finish["small"].set()
    await asyncio.gather(big, small)


async def test_a_read_cancelled_while_waiting_holds_no_turn() -> None:
    """A read whose deadline passes while it waits (asyncio.wait_for cancels it) takes no
    turn and holds none back: the reads behind it go when theirs comes."""
    reads = _Reads(ReadTurns(10))
    first = reads.start("first", "a", 8)
    waiting = reads.start("waiting", "a", 8)
    behind = reads.start("behind", "a", 2)
    await _settle()
    assert reads.inside == ["first"]
    waiting.cancel()
    await _settle()
    assert sorted(reads.inside) == ["behind", "first"]  # 8 + 2 fit once "waiting" is gone
    reads.finish["first"].set()
    reads.finish["behind"].set()
    await asyncio.gather(first, behind)
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert reads.entered == ["first", "behind"] and reads.turns.asked("a") == 0


async def test_a_read_cancelled_as_its_turn_came_gives_the_turn_back() -> None:
    reads = _Reads(ReadTurns(10))
    first = reads.start("first", "a", 8)
    second = reads.start("second", "a", 8)
    await _settle()
    reads.finish["first"].set()
    await asyncio.sleep(0)  # "first" leaves and hands its turn to "second" ...
    assert "second" not in reads.entered
    second.cancel()  # ... which is cancelled before it ran again
    await asyncio.gather(first, second, return_exceptions=True)
    assert reads.turns.asked("a") == 0
    third = reads.start("third", "a", 4)
    fourth = reads.start("fourth", "a", 4)
    await _settle()
    assert reads.inside == ["third", "fourth"]  # no turn (bytes or a read's count) still held
    reads.finish["third"].set()
    reads.finish["fourth"].set()
    await asyncio.gather(third, fourth)


def _clients(server: RedisServer) -> int:
    info = server.cli("info", "clients")
    return int(info.split("connected_clients:")[1].split()[0])


@pytest.mark.parametrize("size", [64 << 10, READ_BYTES_PER_NODE // 2 - (64 << 10)],
                         ids=["64KiB", "4.5MiB"])
async def test_a_stores_reads_of_one_node_go_two_at_a_time(
    redis_server: RedisServer, open_store: OpenStore, prefix: str, size: int,
) -> None:
    """Six reads asked at once: they all answer, but the node is read on two connections,
    not six (each read on a connection of its own, all finishing together). 4.5 MiB: two fit
    the node's bytes; 64 KiB: far below them, the count bounds them (five before it)."""
    [(_, name, value)] = chunk_items(prefix, 1, size=size)
    store = await open_store(redis_server.url, timeout_s=60.0)
    assert (await store.batch_set([(name, value)])).ok
    before = _clients(redis_server)
    got = await asyncio.wait_for(asyncio.gather(
        *(store.batch_get_bounded([name], len(value)) for _ in range(6))), 60.0)
    assert all(result.ok and result.values == [Head(value, len(value))] for result in got)
    assert _clients(redis_server) - before <= 2


# -- a Cluster read whose node fails ----------------------------------------------------------


class _Node:
    def __init__(self, name):
        self.name = name

    def acquire_connection(self):
        return self

    def release(self, conn):
        pass


class _Manager:
    nodes = {b"a": _Node("a:1"), b"b": _Node("b:1")}

    def get_node_from_slot(self, slot):
        return self.nodes[slot]


class _Cluster:
    nodes_manager = _Manager()

    def keyslot(self, key):
        return key[:1]


@pytest.mark.asyncio
async def test_a_node_failing_ends_the_other_nodes_parts_and_their_turns(monkeypatch) -> None:
    """On a Cluster one node's part failing fails the read; the other nodes' parts must end
    with it: left running they would hold their node's turn past every deadline."""
    hang = asyncio.Event()

    async def fake_read_on(conn, keys, op):
        if conn.name == "a:1":
            raise rex.ConnectionError("node a reset")
        await hang.wait()  # node b: a server that does not answer (no deadline in here)
        return [b""] * len(keys)

    monkeypatch.setattr(br, "_read_on", fake_read_on)
    turns = ReadTurns(10_000)
    op = br._Getrange(999, br.ReadBuffers(0), turns)  # 1,000 bytes a value
    with pytest.raises(rex.ConnectionError):
        await asyncio.wait_for(br._run_cluster(_Cluster(), [b"a1", b"b1", b"b2", b"b3"], op), 5.0)
    assert turns.asked("b:1") == 0, f"node b still has {turns.asked('b:1')} bytes asked by an abandoned read"
