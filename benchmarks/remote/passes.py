"""remote_throughput's passes: tieredkv's threaded store, redis-py and redis-benchmark each
moving one case's bytes (SET, GET, EXISTS), timed round by round; GETs verified."""

from __future__ import annotations

import itertools
import math
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import redis
from redis.cluster import RedisCluster

from benchmarks import common
from benchmarks.remote.workload import (
    CALL_TIMEOUT_S,
    CLUSTER_MIN_RUN_S,
    FINGERPRINT,
    MB,
    OPS,
    RANK,
    SIDES,
    BenchError,
    Case,
)
from tieredkv.remote.codec import HEADER_BYTES, decode, encode
from tieredkv.remote.threaded import ThreadedRemoteStore


def _check_get(case: Case, indices: range, values: Sequence[bytes | None]) -> None:
    for i, value in zip(indices, values, strict=True):
        j = i % case.items
        checked = decode(value, fingerprint=FINGERPRINT, key=case.chunk_keys[j], rank=RANK,
                         expected_len=case.shard.payload_bytes)
        if not checked.ok:
            raise BenchError(f"tieredkv read {j} rejected: {checked}")


def tieredkv_pass(store: ThreadedRemoteStore, case: Case, op: str, clients: int) -> float:
    """Seconds to move ``case``'s items through the tier with ``clients`` batches in flight."""
    names, values, n = case.names, case.values, case.items

    def submit(indices: range) -> Future[Any]:
        if op == "set":
            return store.batch_set([(names[i], values[i]) for i in indices], timeout_s=CALL_TIMEOUT_S)
        if op == "get":
            return store.batch_get([names[i] for i in indices], timeout_s=CALL_TIMEOUT_S)
        return store.batch_exists([names[i % n] for i in indices], timeout_s=CALL_TIMEOUT_S)

    todo = iter(case.batches(op))
    inflight: dict[Future[Any], range] = {}
    start = time.perf_counter()
    for indices in itertools.islice(todo, clients):
        inflight[submit(indices)] = indices
    while inflight:
        done, _ = wait(inflight, return_when=FIRST_COMPLETED)
        for future in done:
            indices = inflight.pop(future)
            result = future.result()
            if result.failed:
                raise BenchError(f"tieredkv {op}: {result.failed} items failed ({result.cause})")
            if op == "get":
                _check_get(case, indices, result.values)
            elif not all(result.values):
                raise BenchError(f"tieredkv {op}: an item was not stored / not found")
            following = next(todo, None)
            if following is not None:
                inflight[submit(following)] = following
    return time.perf_counter() - start


def redispy_pass(client: redis.Redis | RedisCluster, case: Case, op: str, clients: int) -> float:
    """Seconds to move the same items with plain redis-py pipelines from ``clients`` threads."""
    names, values, n, size = case.names, case.values, case.items, case.shard.value_bytes
    todo = iter(case.batches(op))
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            while True:
                with lock:
                    indices = next(todo, None)
                if indices is None:
                    return
                pipe = client.pipeline(transaction=False)
                for i in indices:
                    if op == "set":
                        pipe.set(names[i], values[i])
                    elif op == "get":
                        pipe.get(names[i])
                    else:
                        pipe.exists(names[i % n])
                replies = pipe.execute()
                if op == "get" and any(r is None or len(r) != size for r in replies):
                    raise BenchError("redis-py get: a value is missing or has the wrong size")
                if op != "get" and not all(replies):
                    raise BenchError(f"redis-py {op}: an item was not stored / not found")
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors.append(exc)

    start = time.perf_counter()
    if clients == 1:
        worker()
    else:
        threads = [threading.Thread(target=worker) for _ in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise BenchError(f"redis-py {op} failed: {errors[0]!r}") from errors[0]
    return elapsed


class RedisBenchmark:
    """The redis-benchmark binary pointed at one node (``cluster``: it discovers the rest).

    In cluster mode redis-benchmark runs one thread per master, and a thread notices that
    its run is over only on its 250 ms throughput timer, so every run's time is rounded up
    to a tick (4,096 and 40,960 EXISTS both "took" 258 ms on this machine). There each run is
    lengthened, from the rate of the previous one, to at least ``CLUSTER_MIN_RUN_S`` (the
    tick then adds at most ~10 %, against redis-benchmark); a single node has no such tick.
    """

    def __init__(self, binary: str, port: int, cluster: bool) -> None:
        self.binary = binary
        self.port = port
        self.cluster = cluster
        self.key = "key:{tag}:__rand_int__" if cluster else "key:__rand_int__"
        self.items: dict[str, int] = {}  # cluster mode: requests per run, by case and test

    def clients_for(self, clients: int) -> int:
        # In cluster mode redis-benchmark needs a connection per master; tieredkv's and
        # redis-py's cluster pipelines also talk to every master at once.
        return max(clients, 3) if self.cluster else clients

    def rps(self, args: Sequence[str], clients: int) -> dict[str, float]:
        """Requests per second by test name (``SET``, ``GET``, ``EXISTS``), as printed."""
        cmd = [self.binary, "-h", "127.0.0.1", "-p", str(self.port), "-c",
               str(self.clients_for(clients)), "-q", "--csv",
               *(["--cluster"] if self.cluster else []), *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            raise BenchError(f"{' '.join(cmd[:12])}... exited {done.returncode}: {done.stderr[-500:]}")
        out: dict[str, float] = {}
        for line in done.stdout.splitlines():
            cells = [c.strip('"') for c in line.split('","')]
            if len(cells) >= 2 and cells[0] != "test":
                try:
                    rate = float(cells[1])
                except ValueError:
                    continue
                if not math.isfinite(rate) or rate <= 0:  # a run shorter than its 1 ms clock
                    raise BenchError(f"redis-benchmark reported {cells[1]} rps for {cells[0]}: "
                                     "the run was too short to time, use more items")
                out[cells[0].split()[0].upper()] = rate
        return out

    def run(self, case: Case, clients: int) -> dict[str, float]:
        """ops/s of SET and GET (one run) and of EXISTS (a second run) on ``case``'s sizes."""
        batch = str(case.shard.batch)
        tag = f"{case.shard.name} c={clients}"
        n_setget = self.items.get(f"{tag} set,get", case.items)
        n_exists = self.items.get(f"{tag} exists", case.exists_items)
        rps = self.rps(["-t", "set,get", "-d", str(case.shard.value_bytes), "-P", batch,
                        "-n", str(n_setget)], clients)
        rps.update(self.rps(["-P", batch, "-n", str(n_exists), "exists", self.key], clients))
        missing = {"SET", "GET", "EXISTS"} - set(rps)
        if missing:
            raise BenchError(f"redis-benchmark printed no figure for {sorted(missing)}")
        if self.cluster:  # the next run of this case lasts at least CLUSTER_MIN_RUN_S
            def enough(n: int, *tests: str) -> int:
                need = max(math.ceil(CLUSTER_MIN_RUN_S * rps[t]) for t in tests)
                step = case.shard.batch * self.clients_for(clients)
                return max(n, math.ceil(need / step) * step)

            self.items[f"{tag} set,get"] = enough(n_setget, "SET", "GET")
            self.items[f"{tag} exists"] = enough(n_exists, "EXISTS")
        return {op: rps[op.upper()] for op in OPS}


Samples = dict[str, dict[str, list[float]]]  # side -> op -> ops/s per round


def codec_rates(case: Case) -> dict[str, float]:
    """Single-thread MB/s of encode and decode+verify on one batch (information only)."""
    count = min(case.shard.batch, case.items)
    payload = memoryview(case.values[0])[HEADER_BYTES:]
    start = time.perf_counter()
    for _ in range(count):
        encode(payload, fingerprint=FINGERPRINT, key=case.chunk_keys[0], rank=RANK)
    encode_s = time.perf_counter() - start
    start = time.perf_counter()
    _check_get(case, range(count), case.values[:count])
    decode_s = time.perf_counter() - start
    moved = count * case.shard.value_bytes / MB
    return {"encode_mb_s": moved / encode_s, "decode_verify_mb_s": moved / decode_s}


def measure(case: Case, clients: int, rounds: int, store: ThreadedRemoteStore,
            client: redis.Redis | RedisCluster, bench: RedisBenchmark,
            progress: common.Progress) -> Samples:
    """``rounds`` rounds; in each, every side runs SET, GET, EXISTS; the order flips per round."""
    def run_tieredkv() -> dict[str, float]:
        return {op: case.count(op) / tieredkv_pass(store, case, op, clients) for op in OPS}

    def run_redispy() -> dict[str, float]:
        return {op: case.count(op) / redispy_pass(client, case, op, clients) for op in OPS}

    def run_benchmark() -> dict[str, float]:
        return bench.run(case, clients)

    runners: dict[str, Callable[[], dict[str, float]]] = {
        "tieredkv": run_tieredkv, "redis-py": run_redispy, "redis-benchmark": run_benchmark,
    }
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
