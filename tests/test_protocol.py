"""protocol.py: the named job constructors build the same jobs the dataclass does."""

from __future__ import annotations

import pickle

import pytest

from tieredkv.protocol import (
    DeviceBlocks,
    DiskSlot,
    HostChunks,
    HostSlot,
    Job,
    LoadChunk,
    Medium,
    Move,
    RemoteShard,
)

CHUNK = LoadChunk(b"k" * 16, 3, 0, (5, 6))
NAMED = [
    (Job.store(1, b"a", 3, [4, 5], "r"), Job(1, DeviceBlocks((4, 5)), HostSlot(3), b"a", "r")),
    (Job.spill(2, b"b", 3, 7, [b"x"]), Job(2, HostSlot(3), DiskSlot(7, (b"x",)), b"b")),
    (Job.promote(3, b"c", 7, 3, "r"), Job(3, DiskSlot(7), HostSlot(3), b"c", "r")),
    (Job.load(4, "r", (CHUNK,)), Job(4, HostChunks((CHUNK,), False), DeviceBlocks((5, 6)), b"", "r")),
    (Job.remote_read(5, b"d", 3, "r", 2), Job(5, RemoteShard(2), HostSlot(3), b"d", "r")),
    (Job.remote_write(6, b"e", 3, 0, [1]), Job(6, HostSlot(3), RemoteShard(0, (1,)), b"e")),
]


@pytest.mark.parametrize(("named", "built"), NAMED, ids=[m.value for m in Move])
def test_a_named_constructor_makes_the_job_the_dataclass_makes(named: Job, built: Job) -> None:
    assert named == built and hash(named) == hash(built) and repr(named) == repr(built)
    assert named.move is built.move is Move.between(named.src.medium, named.dst.medium)
    shipped = pickle.loads(pickle.dumps(named))  # jobs travel to the workers pickled
    assert shipped == named and shipped.move is named.move
    with pytest.raises(AttributeError):
        named.key = b"other"  # frozen, however it was built


def test_a_pair_nothing_carries_is_refused() -> None:
    with pytest.raises(ValueError, match="no transfer moves disk -> remote"):
        Job(9, DiskSlot(1), RemoteShard(0), b"k")
    assert Move.between(Medium.DEVICE, Medium.HOST) is Move.STORE
