"""remote_throughput's redis-benchmark side: the C client on random keys (``-r``), over the
same key count, value size and pipeline depth as tieredkv's batches.

Without ``-r`` every command names one key (cache-hot, and a GET of one value is not what a
tier does). With ``-r <keyspace>`` each command picks a random key ``key:<12 digits>`` below
the keyspace; in cluster mode each master's client has its own hash tag
(``key:{tag}:<12 digits>``) and its own ``-r`` range, so the keyspace per tag is the key
count divided by the masters. Before a case is run every one of those keys is written (the
same value size as tieredkv's), so every GET and EXISTS hits, as tieredkv's and redis-py's do.
"""

from __future__ import annotations

import math
import subprocess
from collections.abc import Sequence

import redis
from redis.cluster import RedisCluster

from benchmarks.remote.workload import CLUSTER_MIN_RUN_S, OPS, BenchError, Case

KEY = "key:__rand_int__"
CLUSTER_KEY = "key:{tag}:__rand_int__"


class RedisBenchmark:
    """The redis-benchmark binary pointed at one node (``cluster``: it discovers the rest).

    In cluster mode redis-benchmark runs one thread per master, and a thread notices that
    its run is over only on its 250 ms throughput timer, so every run's time is rounded up
    to a tick (4,096 and 40,960 EXISTS both "took" 258 ms on this machine). There each run is
    lengthened, from the rate of the previous one, to at least ``CLUSTER_MIN_RUN_S`` (the
    tick then adds at most ~10 %, against redis-benchmark); a single node has no such tick.
    """

    def __init__(self, binary: str, port: int, client: redis.Redis | RedisCluster) -> None:
        self.binary = binary
        self.port = port
        self.client = client
        self.cluster = isinstance(client, RedisCluster)
        self.key = CLUSTER_KEY if self.cluster else KEY
        self.items: dict[str, int] = {}  # cluster mode: requests per run, by case and test
        self.prefixes = self._prefixes()

    def clients_for(self, clients: int) -> int:
        # In cluster mode redis-benchmark needs a connection per master; tieredkv's and
        # redis-py's cluster pipelines also talk to every master at once.
        return max(clients, 3) if self.cluster else clients

    def _prefixes(self) -> list[str]:
        """The key prefixes redis-benchmark's clients use: ``key:``, or one per master's tag
        (found by letting it write key 0 under each, then reading the names back)."""
        if not self.cluster:
            return ["key:"]
        self.rps(["-n", "300", "-r", "1", "set", self.key, "x"], 3)
        names = [bytes(k).decode() for k in self.client.keys("key:*", target_nodes=RedisCluster.ALL_NODES)]
        prefixes = sorted({name.rsplit(":", 1)[0] + ":" for name in names})
        if len(prefixes) < 2:
            raise BenchError(f"redis-benchmark --cluster wrote under {prefixes}: expected a tag per master")
        for name in names:  # one DEL per key: the tags' keys live on different masters
            self.client.delete(name)
        return prefixes

    def keyspace(self, items: int) -> int:
        """``-r``: keys per prefix, so that all prefixes together hold ``items`` keys."""
        return max(1, math.ceil(items / len(self.prefixes)))

    def names(self, items: int) -> list[str]:
        """Every key redis-benchmark can pick for a case of ``items`` keys."""
        return [f"{p}{i:012d}" for p in self.prefixes for i in range(self.keyspace(items))]

    def preload(self, case: Case) -> None:
        """Write every key of the case's keyspace (value size as tieredkv's), a batch at a time."""
        names = self.names(case.items)
        step = case.shard.batch
        for at in range(0, len(names), step):
            pipe = self.client.pipeline(transaction=False)
            for n, name in enumerate(names[at:at + step], start=at):
                pipe.set(name, case.values[n % case.items])
            if not all(pipe.execute()):
                raise BenchError("redis-benchmark's keys could not be preloaded")

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
        """ops/s of SET and GET (one run) and of EXISTS (a second run) on ``case``'s sizes,
        random keys over the case's key count (:meth:`preload` wrote them all)."""
        misses = self.misses()
        rates = self._run(case, clients)
        if self.misses() != misses:
            raise BenchError(f"redis-benchmark missed {self.misses() - misses} keys: its keyspace "
                             f"({self.prefixes}, -r {self.keyspace(case.items)}) was not all written")
        return rates

    def misses(self) -> int:
        """GETs and EXISTS of absent keys so far, by the servers' own count (every node)."""
        if self.cluster:
            infos = self.client.info("stats", target_nodes=RedisCluster.ALL_NODES)
            return sum(int(info["keyspace_misses"]) for info in infos.values())
        return int(self.client.info("stats")["keyspace_misses"])

    def _run(self, case: Case, clients: int) -> dict[str, float]:
        batch = str(case.shard.batch)
        tag = f"{case.shard.name} c={clients}"
        n_setget = self.items.get(f"{tag} set,get", case.items)
        n_exists = self.items.get(f"{tag} exists", case.exists_items)
        keyspace = ["-r", str(self.keyspace(case.items))]
        rps = self.rps(["-t", "set,get", "-d", str(case.shard.value_bytes), "-P", batch,
                        "-n", str(n_setget), *keyspace], clients)
        rps.update(self.rps(["-P", batch, "-n", str(n_exists), *keyspace, "exists", self.key], clients))
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
