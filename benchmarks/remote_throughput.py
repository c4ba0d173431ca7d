"""Remote-tier throughput: tieredkv's Redis path against redis-benchmark and a raw redis-py client.

Issue #14's target: the remote tier moves chunk shards at >= 0.8x the rate a plain client
moves the same value sizes on the same server. The benchmark starts its own redis-server
(``tieredkv.testing.redis_procs``; ``--cluster``: a 3-master Redis Cluster) and, for three
value sizes users get (one TP rank's shard of one chunk, see ``SHARDS``), measures:

* **tieredkv**: ``ThreadedRemoteStore.batch_set`` / ``batch_get`` / ``batch_exists``, one
  batch = the shards of one 4,096-token prompt for one rank, ``clients`` batches in flight.
  Values are ``codec.encode`` output (the 100-byte header included, built before timing);
  every value read is verified with ``codec.decode`` (key, rank, namespace, length,
  checksum) inside the timed loop, as the tier does before a value may reach a host slot.
* **redis-benchmark**: ``-t set,get -d <value bytes> -P <batch> -n <items> -c <clients>``
  and ``EXISTS`` the same way (the C client; one key, as redis-benchmark does without ``-r``).
* **redis-py**: ``redis.Redis`` pipelines of ``batch`` commands, ``clients`` threads, the
  same keys and values as tieredkv (replies only length-checked, not decoded).

The three sides take turns within every round (the order flips each round) on one shared
server, so load from other tenants lands on all of them alike; each figure is the median
of the rounds, with the min-max spread. Ratio = tieredkv median / baseline median (MB/s for
SET and GET, ops/s for EXISTS), judged against ``TARGET``. MB = 10^6 bytes of values.

    python -m benchmarks.remote_throughput            # quick profile (2-3 minutes)
    python -m benchmarks.remote_throughput --full     # more bytes and rounds, 1 and 4 clients
    python -m benchmarks.remote_throughput --cluster  # against a 3-master Redis Cluster
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis
from redis.cluster import ClusterNode, RedisCluster

from benchmarks import common
from tieredkv.remote.codec import HEADER_BYTES, RemoteKeyNames, decode, encode
from tieredkv.remote.threaded import ThreadedRemoteStore
from tieredkv.remote_url import parse_remote_url
from tieredkv.testing.redis_procs import RedisClusterProcs, RedisServer

NAME = "remote_throughput"
TARGET = 0.8
PROMPT_TOKENS = 4096  # one batch = the shards of one 4k-token prompt, for one TP rank
OPS = ("set", "get", "exists")
BASELINES = ("redis-benchmark", "redis-py")
SIDES = ("tieredkv", *BASELINES)
FINGERPRINT = hashlib.sha256(b"tieredkv benchmarks/remote_throughput").digest()
RANK = 0
PREFIX = "tkvbench"
CALL_TIMEOUT_S = 120.0  # a 128 MiB batch on a loaded 2-core machine: no deadline under test
MB = 1e6
CLUSTER_MIN_RUN_S = 2.5  # redis-benchmark --cluster's runs: see RedisBenchmark


@dataclass(frozen=True)
class Shard:
    """One TP rank's shard of one chunk: tokens x 2 (K, V) x layers x KV heads x head dim x bytes / TP."""

    name: str
    model: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    tp: int
    tokens: int

    @property
    def payload_bytes(self) -> int:
        per_token = 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes
        return self.tokens * per_token // self.tp

    @property
    def value_bytes(self) -> int:
        return self.payload_bytes + HEADER_BYTES

    @property
    def batch(self) -> int:
        return max(1, PROMPT_TOKENS // self.tokens)

    @property
    def label(self) -> str:
        size = self.payload_bytes
        human = f"{size / 2**20:g} MiB" if size >= 2**20 else f"{size / 2**10:g} KiB"
        return f"{human} ({self.name})"


SHARDS = (
    # The smallest chunk tieredkv stores (chunk_blocks=1 at block size 16) of a 0.5B model at TP 2.
    Shard("Qwen2.5-0.5B-class, TP 2, 16-token chunk", "24 layers, 2 KV heads, head dim 64, bf16",
          24, 2, 64, 2, 2, 16),
    # The default ~256-token chunk of the same small model, one GPU.
    Shard("Qwen2.5-0.5B-class, TP 1, 256-token chunk", "24 layers, 2 KV heads, head dim 64, bf16",
          24, 2, 64, 2, 1, 256),
    # A Llama-3.1-8B-class chunk per TP rank at TP 4.
    Shard("Llama-3.1-8B-class, TP 4, 256-token chunk", "32 layers, 8 KV heads, head dim 128, bf16",
          32, 8, 128, 2, 4, 256),
)


@dataclass(frozen=True)
class Profile:
    name: str
    bytes_per_op: int  # value bytes each side moves per op and round (at least one batch)
    exists_items: int  # keys each side probes per round
    rounds: int
    clients: tuple[int, ...]
    shards: tuple[Shard, ...] = SHARDS


PROFILES = {
    # redis-benchmark times a run in whole milliseconds: EXISTS runs need thousands of keys.
    "smoke": Profile("smoke", 0, 4096, 2, (1,), SHARDS[:1]),
    "quick": Profile("quick", 256 << 20, 32768, 5, (1,)),
    "full": Profile("full", 1 << 30, 131072, 9, (1, 4)),
}


class BenchError(RuntimeError):
    """A side failed to move the bytes (a failed item, a rejected value, a crashed tool)."""


# ---------------------------------------------------------------------------- one value size


@dataclass
class Case:
    """The keys and encoded values of one shard size; ``items`` of them are moved per op."""

    shard: Shard
    items: int
    exists_items: int
    chunk_keys: list[bytes] = field(default_factory=list)
    names: list[bytes] = field(default_factory=list)
    values: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        namer = RemoteKeyNames(FINGERPRINT, RANK, PREFIX)
        payload = bytes(range(256)) * (self.shard.payload_bytes // 256 + 1)
        for i in range(self.items):
            key = hashlib.sha256(b"chunk %d" % i).digest()
            body = memoryview(payload)[i % 256 : i % 256 + self.shard.payload_bytes]
            self.chunk_keys.append(key)
            self.names.append(namer(key))
            self.values.append(encode(body, fingerprint=FINGERPRINT, key=key, rank=RANK))

    def batches(self, op: str) -> list[range]:
        count = self.exists_items if op == "exists" else self.items
        step = self.shard.batch
        return [range(i, min(i + step, count)) for i in range(0, count, step)]

    def count(self, op: str) -> int:
        return self.exists_items if op == "exists" else self.items


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


# ---------------------------------------------------------------------------- measurement


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


def verdict(ratio: float) -> str:
    if not math.isfinite(ratio) or ratio <= 0:
        return "n/a"
    return "PASS" if ratio >= TARGET else "MISS"


def build_rows(case: Case, clients: int, samples: Samples) -> list[dict[str, Any]]:
    rows = []
    value = case.shard.value_bytes
    for op in OPS:
        tkv = samples["tieredkv"][op]
        for baseline in BASELINES:
            base = samples[baseline][op]
            ratio = statistics.median(tkv) / statistics.median(base)
            per_round = [a / b for a, b in zip(tkv, base, strict=True)]
            scale = value / MB if op != "exists" else None
            rows.append({
                "shard": case.shard.name,
                "size_label": case.shard.label,
                "payload_bytes": case.shard.payload_bytes,
                "value_bytes": value,
                "op": op.upper(),
                "batch": case.shard.batch,
                "clients": clients,
                "items_per_round": case.count(op),
                "baseline": baseline,
                "tieredkv_ops_s": statistics.median(tkv),
                "baseline_ops_s": statistics.median(base),
                "tieredkv_mb_s": statistics.median(tkv) * scale if scale else None,
                "baseline_mb_s": statistics.median(base) * scale if scale else None,
                "tieredkv_spread": _spread(tkv, scale),
                "baseline_spread": _spread(base, scale),
                "ratio": ratio,
                "ratio_rounds": [round(x, 3) for x in per_round],
                "target": TARGET,
                "verdict": verdict(ratio),
                "samples_tieredkv_ops_s": [round(x, 1) for x in tkv],
                "samples_baseline_ops_s": [round(x, 1) for x in base],
            })
    return rows


def _spread(samples: Sequence[float], scale: float | None) -> list[float]:
    """[min, max] of the rounds, in MB/s (SET, GET) or ops/s (EXISTS)."""
    k = scale or 1.0
    return [min(samples) * k, max(samples) * k]


# ---------------------------------------------------------------------------- report


def _fig(median: float | None, spread: Sequence[float]) -> str:
    if median is None:
        return ""
    return f"{_num(median)} ({_num(spread[0])}–{_num(spread[1])})"


def _num(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def table(rows: Sequence[dict[str, Any]]) -> str:
    view = []
    for r in rows:
        moved = r["op"] != "EXISTS"
        view.append({
            "size": r["size_label"], "op": r["op"], "batch": r["batch"], "clients": r["clients"],
            "baseline": r["baseline"],
            "tkv": _fig(r["tieredkv_mb_s"], r["tieredkv_spread"]) if moved else "",
            "base": _fig(r["baseline_mb_s"], r["baseline_spread"]) if moved else "",
            "tkv_ops": _fig(r["tieredkv_ops_s"], [x / (r["value_bytes"] / MB) for x in r["tieredkv_spread"]]
                            if moved else r["tieredkv_spread"]),
            "base_ops": _fig(r["baseline_ops_s"], [x / (r["value_bytes"] / MB) for x in r["baseline_spread"]]
                             if moved else r["baseline_spread"]),
            "ratio": f"{r['ratio']:.2f} ({min(r['ratio_rounds']):.2f}–{max(r['ratio_rounds']):.2f})",
            "target": f">= {r['target']}",
            "verdict": r["verdict"],
        })
    return common.markdown_table(view, [
        ("size", "value size (shard)"), ("op", "op"), ("batch", "batch / -P"),
        ("clients", "clients"), ("baseline", "baseline"),
        ("tkv", "tieredkv MB/s median (min–max)"), ("base", "baseline MB/s median (min–max)"),
        ("tkv_ops", "tieredkv ops/s"), ("base_ops", "baseline ops/s"),
        ("ratio", "ratio tieredkv/baseline (per-round range)"), ("target", "target"),
        ("verdict", "verdict"),
    ])


def headline(rows: Sequence[dict[str, Any]]) -> str:
    misses = [r for r in rows if r["verdict"] != "PASS"]
    if not misses:
        return f"**Target tieredkv / baseline >= {TARGET}: PASS on all {len(rows)} ratios.**"
    listed = "; ".join(
        f"{r['op']} {r['size_label'].split(' (')[0]} c={r['clients']} vs {r['baseline']}: {r['ratio']:.2f}"
        for r in misses)
    return (f"**Target tieredkv / baseline >= {TARGET}: MISS on {len(misses)} of {len(rows)} ratios** "
            f"({listed}); the other {len(rows) - len(misses)} PASS.")


@dataclass
class Result:
    rows: list[dict[str, Any]]
    payload: dict[str, Any]
    markdown: str
    paths: dict[str, str] = field(default_factory=dict)


def _redis_benchmark_version(binary: str) -> str:
    try:
        return subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10,
                              check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run(profile_name: str = "quick", *, cluster: bool = False, out_dir: Path | str | None = None,
        write: bool = True, show_progress: bool = True) -> Result:
    """Start a server, run one profile, stop the server; returns (and writes) the results."""
    profile = PROFILES[profile_name]
    binary = shutil.which("redis-benchmark")
    if binary is None:
        raise BenchError("redis-benchmark is not installed (Debian's redis-tools package)")
    started = time.time()
    load_before = common.machine_info().get("load_average")
    tmp = Path(tempfile.mkdtemp(prefix="tkv-remote-bench-"))
    deployment: RedisServer | RedisClusterProcs = (
        RedisClusterProcs(tmp) if cluster else RedisServer(tmp))
    rows: list[dict[str, Any]] = []
    codec: dict[str, dict[str, float]] = {}
    progress = common.Progress(len(profile.shards) * len(profile.clients) * profile.rounds,
                               "starting redis-server", enabled=show_progress)
    try:
        deployment.start()
        first = deployment.servers[0] if isinstance(deployment, RedisClusterProcs) else deployment
        server_version = first.cli("info", "server").split("redis_version:")[1].split()[0]
        bench = RedisBenchmark(binary, first.port, cluster)
        store = ThreadedRemoteStore(parse_remote_url(deployment.url), timeout_s=CALL_TIMEOUT_S,
                                    connect_timeout_s=10.0, socket_timeout_s=CALL_TIMEOUT_S,
                                    write_timeout_s=CALL_TIMEOUT_S)
        client: redis.Redis | RedisCluster = (
            RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", s.port) for s in deployment.servers])
            if isinstance(deployment, RedisClusterProcs) else redis.Redis(port=first.port))
        try:
            if not store.wait_up(30):
                raise BenchError(f"the tieredkv store did not connect: {store.stats()}")
            for shard in profile.shards:
                for clients in profile.clients:
                    batches = max(clients, round(profile.bytes_per_op / (shard.value_bytes * shard.batch)))
                    exists = max(profile.exists_items, clients * shard.batch)
                    case = Case(shard, batches * shard.batch, exists)
                    codec[shard.name] = codec_rates(case)
                    samples = measure(case, clients, profile.rounds, store, client, bench, progress)
                    rows += build_rows(case, clients, samples)
                    del case
                    client.flushall()
        finally:
            store.close(5.0)
            client.close()
    finally:
        progress.close()
        deployment.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    clients_note = ", ".join(map(str, profile.clients))
    payload: dict[str, Any] = {
        "benchmark": NAME,
        "profile": profile.name,
        "deployment": "3-master Redis Cluster" if cluster else "single redis-server",
        "machine": {**common.machine_info(), "load_average_at_start": load_before},
        "tieredkv_revision": common.git_revision(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "wall_seconds": round(time.time() - started, 1),
        "target": TARGET,
        "verdict": "PASS" if all(r["verdict"] == "PASS" for r in rows) else "MISS",
        "headline": headline(rows),
        "versions": {
            "redis_server": server_version,
            "redis_benchmark": _redis_benchmark_version(binary),
            "redis_py": redis.__version__,
            "hiredis_parser": _hiredis(),
        },
        "settings": {
            "rounds": profile.rounds, "bytes_per_op_per_round": profile.bytes_per_op,
            "exists_items_per_round": profile.exists_items, "clients": list(profile.clients),
            "prompt_tokens_per_batch": PROMPT_TOKENS, "header_bytes": HEADER_BYTES,
            "tieredkv_call_timeout_s": CALL_TIMEOUT_S,
            "shards": [{**asdict(s), "payload_bytes": s.payload_bytes, "value_bytes": s.value_bytes,
                        "batch": s.batch} for s in profile.shards],
        },
        "sides": {
            "tieredkv": "ThreadedRemoteStore (redis.asyncio client on the store's own event-loop "
                        "thread): batch_set/batch_get/batch_exists, one pipeline per batch, "
                        "`clients` batches in flight; codec.decode verifies every value read",
            "redis-benchmark": "-t set,get -d <value bytes> -P <batch> -n <items> -c <clients>"
                               + (" (at least 3: one per master) --cluster" if cluster else "")
                               + ", then EXISTS the same way; one key (no -r)"
                               + ("; in cluster mode it times a run in 250 ms ticks, so its runs "
                                  f"are lengthened to >= {CLUSTER_MIN_RUN_S} s each (more requests "
                                  "than the other sides; rates compare)" if cluster else ""),
            "redis-py": f"redis.{'RedisCluster' if cluster else 'Redis'} pipelines "
                        "(transaction=False) of <batch> commands from <clients> threads, same keys "
                        "and values as tieredkv; replies length-checked, not decoded",
        },
        "redis_benchmark_cluster_items": bench.items,
        "codec_single_thread_mb_s": codec,
        "rows": rows,
    }
    machine = payload["machine"]
    load = machine.get("load_average")
    notes = (
        f"Machine: {machine['name']}"
        + (f" (1-min load average {load_before[0]:.1f} at start, {load[0]:.1f} at end)"
           if load and load_before else "")
        + f". tieredkv {payload['tieredkv_revision']}, profile `{profile.name}`, {payload['date']}, "
        f"{payload['wall_seconds']} s. Server: {payload['deployment']}, redis-server "
        f"{server_version} on loopback, no persistence; redis-py {redis.__version__} "
        f"({'hiredis' if _hiredis() else 'pure-Python'} parser).\n\n"
        f"Target (issue #14): tieredkv's remote-tier throughput >= {TARGET} x a plain client "
        "moving the same value sizes on the same server. Ratio = tieredkv median / baseline "
        "median (MB/s for SET and GET, ops/s for EXISTS); per-round range = the ratio within "
        f"each round. {profile.rounds} rounds; in each, tieredkv, redis-benchmark and redis-py "
        "take turns (the order flips every round), each running SET, GET and EXISTS. MB = 10^6 "
        "bytes of values (header included). Clients: "
        f"{clients_note}.\n\n"
        "What each side used: "
        + "; ".join(f"**{side}**: {text}" for side, text in payload["sides"].items()) + ".\n\n"
        "Value sizes: one TP rank's shard of one chunk, tokens x 2 (K, V) x layers x KV heads x "
        "head dim x 2 bytes / TP, plus the 100-byte tieredkv header; one batch = the chunks of one "
        f"{PROMPT_TOKENS}-token prompt: "
        + "; ".join(f"{s.label}: {s.model}, value {s.value_bytes:,} B, batch {s.batch}"
                    for s in profile.shards) + "."
    )
    codec_line = "Codec alone, one thread, one batch (information): " + "; ".join(
        f"{name}: encode {rates['encode_mb_s']:,.0f} MB/s, decode+verify "
        f"{rates['decode_verify_mb_s']:,.0f} MB/s" for name, rates in codec.items()) + "."
    markdown = "\n\n".join([payload["headline"], notes, table(rows), codec_line])
    result = Result(rows, payload, markdown)
    if write:
        out = common.results_dir(out_dir)
        name = f"{NAME}_cluster" if cluster else NAME
        result.paths["json"] = str(common.write_json(out / f"{name}.json", payload))
        result.paths["md"] = str(common.write_markdown(
            out / f"{name}.md",
            "Remote-tier throughput: tieredkv vs redis-benchmark and raw redis-py", [markdown]))
    return result


def _hiredis() -> bool:
    try:
        from redis.utils import HIREDIS_AVAILABLE
    except ImportError:
        return False
    return bool(HIREDIS_AVAILABLE)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--full", action="store_true", help="more bytes and rounds, 1 and 4 clients")
    group.add_argument("--profile", choices=sorted(PROFILES), help="quick (default), full, smoke")
    parser.add_argument("--cluster", action="store_true", help="a 3-master Redis Cluster")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help=f"results directory (default {common.RESULTS_DIR})")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    profile = "full" if args.full else (args.profile or "quick")
    result = run(profile, cluster=args.cluster, out_dir=args.out_dir, write=not args.no_write,
                 show_progress=not args.quiet)
    print(result.markdown)
    for kind, path in result.paths.items():
        print(f"wrote {kind}: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
