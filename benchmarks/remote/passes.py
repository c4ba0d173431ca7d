"""remote_throughput's passes: tieredkv, raw redis-py (asyncio) and redis-benchmark each
moving one case's bytes (SET, GET, EXISTS), timed round by round.

tieredkv's GET is the worker's real read path (:mod:`benchmarks.remote.worker_read`:
RemoteDriver -> RemoteJobs -> the store, values verified in HostPool slots); its SET
and EXISTS are the store's calls (``batch_set``, ``batch_exists``, the one the scheduler's
probe sends). :func:`land` is only the codec's single-thread information line."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from benchmarks import common
from benchmarks.remote.raw_async import AsyncRedisPy
from benchmarks.remote.rbench import RedisBenchmark
from benchmarks.remote.worker_read import WorkerReads
from benchmarks.remote.workload import (
    CALL_TIMEOUT_S,
    FINGERPRINT,
    MB,
    OPS,
    RANK,
    SIDES,
    BenchError,
    Case,
)
from tieredkv.remote.codec import HEADER_BYTES, decode, encode
from tieredkv.remote.store import Head
from tieredkv.remote.threaded import ThreadedRemoteStore


def land(case: Case, indices: Sequence[int], heads: Sequence[Head | None],
         slots: Sequence[bytearray]) -> None:
    """Verify each value and copy its payload into a slot: the codec's cost alone, on one
    thread (information; the GET pass runs RemoteJobs' own landing)."""
    size = case.shard.payload_bytes
    for slot, i, head in zip(slots, indices, heads, strict=False):
        j = i % case.items
        if head is None:
            raise BenchError(f"tieredkv read {j}: no value")
        checked = decode(head.data, fingerprint=FINGERPRINT, key=case.chunk_keys[j], rank=RANK,
                         expected_len=size, value_len=head.length)
        if not checked.ok:
            raise BenchError(f"tieredkv read {j} rejected: {checked}")
        slot[:size] = checked.payload


def tieredkv_pass(store: ThreadedRemoteStore, case: Case, op: str, clients: int) -> float:
    """Seconds to SET or EXISTS ``case``'s items through the store with ``clients`` batches
    in flight (GETs: :class:`~benchmarks.remote.worker_read.WorkerReads`)."""
    if op not in ("set", "exists"):
        raise ValueError(f"tieredkv_pass moves SET and EXISTS, not {op!r}")
    names, values, n = case.names, case.values, case.items

    def submit(indices: Sequence[int]) -> Future[Any]:
        if op == "set":
            return store.batch_set([(names[i], values[i]) for i in indices], timeout_s=CALL_TIMEOUT_S)
        return store.batch_exists([names[i % n] for i in indices], timeout_s=CALL_TIMEOUT_S)

    todo = iter(case.batches(op))
    inflight: dict[Future[Any], Sequence[int]] = {}
    start = time.perf_counter()
    for indices in itertools.islice(todo, clients):
        inflight[submit(indices)] = indices
    while inflight:
        done, _ = wait(inflight, return_when=FIRST_COMPLETED)
        for future in done:
            inflight.pop(future)
            result = future.result()
            if result.failed:
                raise BenchError(f"tieredkv {op}: {result.failed} items failed ({result.cause})")
            if not all(result.values):
                raise BenchError(f"tieredkv {op}: an item was not stored / not found")
            following = next(todo, None)
            if following is not None:
                inflight[submit(following)] = following
    return time.perf_counter() - start


Samples = dict[str, dict[str, list[float]]]  # side -> op -> ops/s per round


def codec_rates(case: Case) -> dict[str, float]:
    """Single-thread MB/s of encode and decode+verify+copy on one batch (information only)."""
    count = min(case.shard.batch, case.items)
    payload = memoryview(case.values[0])[HEADER_BYTES:]
    start = time.perf_counter()
    for _ in range(count):
        encode(payload, fingerprint=FINGERPRINT, key=case.chunk_keys[0], rank=RANK)
    encode_s = time.perf_counter() - start
    slots = [bytearray(case.shard.payload_bytes) for _ in range(count)]
    heads = [Head(v, len(v)) for v in case.values[:count]]
    start = time.perf_counter()
    land(case, range(count), heads, slots)
    decode_s = time.perf_counter() - start
    moved = count * case.shard.value_bytes / MB
    return {"encode_mb_s": moved / encode_s, "decode_verify_mb_s": moved / decode_s}


def measure(case: Case, clients: int, rounds: int, store: ThreadedRemoteStore,
            reader: WorkerReads, raw: AsyncRedisPy, bench: RedisBenchmark,
            progress: common.Progress) -> Samples:
    """``rounds`` rounds; in each, every side runs SET, GET, EXISTS; the order flips per round.
    tieredkv's GETs go through ``reader`` (the worker's read path), its others through ``store``."""

    def run_tieredkv() -> dict[str, float]:
        return {op: reader.rate() if op == "get"
                else case.count(op) / tieredkv_pass(store, case, op, clients) for op in OPS}

    def run_redispy() -> dict[str, float]:
        return {op: case.count(op) / raw.run_pass(case, op, clients) for op in OPS}

    def run_benchmark() -> dict[str, float]:
        return bench.run(case, clients)

    runners: dict[str, Callable[[], dict[str, float]]] = {
        "tieredkv": run_tieredkv, "redis-py": run_redispy, "redis-benchmark": run_benchmark,
    }
    bench.preload(case)
    for run in runners.values():  # warm-up: keys written once, connections open
        run()
    if bench.cluster:  # a second calibration of redis-benchmark's run length (see its class)
        run_benchmark()
    samples: Samples = {side: {op: [] for op in OPS} for side in SIDES}
    for r in range(rounds):
        order = SIDES if r % 2 == 0 else SIDES[::-1]
        for side in order:
            progress.set_label(f"{case.shard.label[:24]} c={clients} round {r + 1}: {side}")
            for op, rate in runners[side]().items():
                samples[side][op].append(rate)
        progress.advance()
    return samples
