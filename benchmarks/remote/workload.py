"""remote_throughput's workload: the shard sizes of one prompt's KV, the profiles, and one
case's keys and self-verifying values."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from tieredkv.remote.codec import HEADER_BYTES, RemoteKeyNames, encode

NAME = "remote_throughput"


# tieredkv / raw redis-py, judged on the worse of one node and a Cluster (issue #25 point 3:
# GETs of chunk values >= 0.9, EXISTS probes >= 0.8; SET keeps issue #14's 0.8).
TARGETS = {"set": 0.8, "get": 0.9, "exists": 0.8}


TARGET_BASELINE = "redis-py"  # redis-benchmark (the C client) is shown as the reference


DEPLOYMENTS = ("single", "cluster")


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


@dataclass
class Case:
    """The keys and encoded values of one shard size; ``items`` of them are moved per op.

    GETs read the keys in one random order (``read_order``, the same for every side and
    round): a prompt's chunks are not the ones written next to each other."""

    shard: Shard
    items: int
    exists_items: int
    chunk_keys: list[bytes] = field(default_factory=list)
    names: list[bytes] = field(default_factory=list)
    values: list[bytes] = field(default_factory=list)
    read_order: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        namer = RemoteKeyNames(FINGERPRINT, RANK, PREFIX)
        payload = bytes(range(256)) * (self.shard.payload_bytes // 256 + 1)
        for i in range(self.items):
            key = hashlib.sha256(b"chunk %d" % i).digest()
            body = memoryview(payload)[i % 256 : i % 256 + self.shard.payload_bytes]
            self.chunk_keys.append(key)
            self.names.append(namer(key))
            self.values.append(encode(body, fingerprint=FINGERPRINT, key=key, rank=RANK))
        self.read_order = list(range(self.items))
        random.Random(self.items).shuffle(self.read_order)

    def batches(self, op: str) -> list[Sequence[int]]:
        """One op's batches of item indices (GET: in ``read_order``)."""
        count = self.exists_items if op == "exists" else self.items
        step = self.shard.batch
        if op == "get":
            return [self.read_order[i:i + step] for i in range(0, count, step)]
        return [range(i, min(i + step, count)) for i in range(0, count, step)]

    def count(self, op: str) -> int:
        return self.exists_items if op == "exists" else self.items
