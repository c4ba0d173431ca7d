"""What every copy backend is: the :class:`CopyBackend` interface, its :data:`Pair`, and the
bounds check that runs before any of them touches memory.

Every backend has the same shape: ``d2h(dev, host, pairs)`` / ``h2d(dev, host, pairs)``, where
each pair ``(host_slot, first_block, block_ids)`` means "device block ``block_ids[j]`` <->
position ``first_block + j`` of ``host_slot``, for every layer", and many chunks move per
call. Copies are issued on the current CUDA stream (the caller's lane stream) and are not
waited for; on CPU they are done when the call returns.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from tieredkv.protocol import NO_BLOCK
from tieredkv.transfer.host_pool import HostPool
from tieredkv.transfer.kv_views import KVViews

Pair = tuple[int, int, Sequence[int]]  # (host_slot, first_block, device block_ids)


def real_blocks(ids: Sequence[int]) -> list[int]:
    """The device blocks among ``ids`` (holes, :data:`NO_BLOCK`, left out)."""
    return [b for b in ids if b != NO_BLOCK]


def split_holes(host_slot: int, first: int, ids: Sequence[int]) -> list[Pair]:
    """``(host_slot, first, ids)`` as pairs of contiguous real blocks: rows holding
    :data:`NO_BLOCK` (a hybrid model's rows no block fills) are skipped, never copied."""
    if NO_BLOCK not in ids:
        return [(host_slot, first, ids)]
    pairs: list[Pair] = []
    start = None
    for j, block in enumerate([*ids, NO_BLOCK]):
        if block != NO_BLOCK and start is None:
            start = j
        elif block == NO_BLOCK and start is not None:
            pairs.append((host_slot, first + start, tuple(ids[start:j])))
            start = None
    return pairs


def check_pairs(dev: KVViews, host: HostPool, chunk_blocks: int, pairs: Sequence[Pair]) -> None:
    """Raise ValueError for anything that would copy out of bounds.

    A bad id must never reach an index kernel: on CUDA it is a device-side assert that kills
    the process, and for the raw-pointer kernel it is memory corruption.
    """
    for slot, first, ids in pairs:
        if not 0 <= slot < host.num_slots:
            raise ValueError(f"host slot {slot} out of range 0..{host.num_slots - 1}")
        if first < 0 or first + len(ids) > chunk_blocks:
            raise ValueError(
                f"positions {first}..{first + len(ids) - 1} do not fit a chunk of {chunk_blocks}"
            )
        if ids and (min(ids) < 0 or max(ids) >= dev.num_blocks):
            raise ValueError(f"device block ids {list(ids)} out of range 0..{dev.num_blocks - 1}")


class CopyBackend(ABC):
    """A way to move block-granular KV bytes between device caches and host slots."""

    name = "abstract"

    @abstractmethod
    def d2h(self, dev: KVViews, host: HostPool, pairs: Sequence[Pair]) -> None:
        """Device blocks -> host slot positions, all layers."""

    @abstractmethod
    def h2d(self, dev: KVViews, host: HostPool, pairs: Sequence[Pair]) -> None:
        """Host slot positions -> device blocks, all layers."""

    def describe(self) -> str:
        return str(self.name)
