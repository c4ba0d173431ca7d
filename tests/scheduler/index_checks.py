"""The bookkeeping a :class:`TierIndex` must keep consistent, checked from outside, and the
eviction policies' lists as the tests read them.

A test helper, not production code: nothing in the scheduler calls it, and it reads the
index's private tables on purpose (the point is to catch them disagreeing).
"""

from __future__ import annotations

from tieredkv.scheduler.policies import ARCPolicy, EvictionPolicy
from tieredkv.scheduler.tier_index import SlotState, TierIndex


def lru_order(policy: EvictionPolicy) -> list[bytes]:
    """An LRU policy's resident keys from coldest to hottest."""
    return list(policy._order)  # type: ignore[attr-defined]


def arc_lists(policy: ARCPolicy) -> dict[str, list[bytes]]:
    """Each of ARC's lists (T1, T2 resident; B1, B2 ghosts) from coldest to hottest."""
    return {"t1": list(policy._t1), "t2": list(policy._t2), "b1": list(policy._b1), "b2": list(policy._b2)}


def _require(condition: bool, message: str) -> None:
    # Raised explicitly so the checks still run under ``python -O``.
    if not condition:
        raise AssertionError(message)


def check_invariants(index: TierIndex) -> None:
    """Raise AssertionError if ``index``'s bookkeeping is inconsistent: every held slot in
    range, held once and not free; pins and counts matching the entries; the policy and the
    alias index holding exactly the live keys."""
    name = index.name
    _require(not (index._entries.keys() & index._doomed.keys()), f"{name}: a key is both live and doomed")
    holders: dict[int, bytes] = {}
    ready = pinned = 0
    for doomed, table in ((False, index._entries), (True, index._doomed)):
        for key, entry in table.items():
            _require(0 <= entry.slot < index.num_slots,
                     f"{name}: {key.hex()} holds out-of-range slot {entry.slot}")
            _require(entry.slot not in holders,
                     f"{name}: slot {entry.slot} held by {key.hex()} and "
                     f"{holders.get(entry.slot, b'').hex()}")
            _require(entry.slot not in index._free, f"{name}: held slot {entry.slot} is free")
            holders[entry.slot] = key
            _require(entry.pins >= 0, f"{name}: {key.hex()} has {entry.pins} pins")
            if entry.state is SlotState.WRITING:
                _require(entry.pins == 1, f"{name}: writing {key.hex()} has {entry.pins} pins")
            if doomed:
                _require(entry.pins > 0, f"{name}: doomed {key.hex()} has no pins")
            elif entry.state is SlotState.READY:
                ready += 1
            pinned += entry.pins > 0
    _require(all(0 <= slot < index.num_slots for slot in index._free),
             f"{name}: an out-of-range slot is free")
    _require(len(index._free) + len(holders) == index.num_slots,
             f"{name}: {len(index._free)} free + {len(holders)} held != {index.num_slots} slots")
    _require(ready == index._ready, f"{name}: ready count {index._ready}, actual {ready}")
    _require(pinned == index._pinned, f"{name}: pinned count {index._pinned}, actual {pinned}")
    _require(
        len(index.policy) == len(index._entries) and all(k in index.policy for k in index._entries),
        f"{name}: policy keys differ from live keys",
    )
    expected: dict[bytes, list[bytes]] = {}
    for key, entry in index._entries.items():
        for alias in entry.aliases:
            expected.setdefault(alias, []).append(key)
    actual = {
        alias: sorted(held if isinstance(held, list) else [held])
        for alias, held in index._alias.items()
    }
    _require(actual == {alias: sorted(keys) for alias, keys in expected.items()},
             f"{name}: alias index differs from the live entries' aliases")
