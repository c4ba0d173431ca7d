"""KV events on real vLLM: a ZMQ subscriber sees tieredkv's tiers beside vLLM's device cache.

vLLM publishes ``KVEventBatch``es (``--kv-events-config``, publisher ``zmq``) of its own
device-cache events and whatever the connector's ``take_events()`` returns. The subscriber
here binds a loopback port (vLLM's publisher connects to a non-wildcard endpoint) and decodes
with msgspec as vLLM documents."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import (
    BLOCK_SIZE,
    RUNNER,
    _run_engine_process,
    generate,
    tieredkv_config,
)

# Converts the spec's kv_events dict into vLLM's config (LLM() does not) and runs the runner.
BOOTSTRAP = (
    "import sys, json; sys.path.insert(0, {runner_dir!r}); import vllm; "
    "from vllm.config import KVEventsConfig; base = vllm.LLM; "
    "spec = json.load(open(sys.argv[1])); events = KVEventsConfig(**spec['kv_events']); "
    "vllm.LLM = lambda **kw: base(**kw, kv_events_config=events); "
    "from engine_runner import main; main()"
)


class Subscriber:
    """A SUB socket bound on loopback, decoding every batch on a thread of its own."""

    def __init__(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._zmq = zmq
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self._sock.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.events: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(100):
                _topic, _seq, payload = self._sock.recv_multipart()
                self.events.extend(self._decoder.decode(payload).events)

    def settle(self, quiet_s: float = 2.0, timeout_s: float = 60.0) -> None:
        """Wait until nothing new arrived for ``quiet_s`` (the engine process has exited)."""
        deadline = time.monotonic() + timeout_s
        seen = -1
        while len(self.events) != seen and time.monotonic() < deadline:
            seen = len(self.events)
            time.sleep(quiet_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._sock.close(0)
        self._ctx.term()


def run_with_events(tiny_model: str, endpoint: str, phases: list[dict], **kv) -> dict:
    spec = {
        "model": tiny_model, "max_tokens": 8, "phases": phases,
        "kv_transfer_config": tieredkv_config(**kv),
        "kv_events": {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": endpoint, "topic": "kv"},
    }
    bootstrap = BOOTSTRAP.format(runner_dir=str(RUNNER.parent))
    return _run_engine_process(["-c", bootstrap], spec, None, 600)


def of(events: list, kind: str, medium: str | None = None, locality: str | None = "LOCAL") -> list:
    return [e for e in events if type(e).__name__ == kind
            and (medium is None or e.medium == medium)
            and (medium == "GPU" or locality is None or e.locality == locality)]


def block_tokens(events: list) -> dict:
    """hash -> the block's tokens, from BlockStored events."""
    out = {}
    for e in events:
        for i, h in enumerate(e.block_hashes):
            out[h] = tuple(e.token_ids[i * e.block_size:(i + 1) * e.block_size])
    return out


@pytest.fixture
def subscriber():
    sub = Subscriber()
    yield sub
    sub.close()


def test_tiers_are_announced_with_vllms_hashes_evictions_removed_and_disk_after_restart(
        tiny_model, subscriber, tmp_path: Path):
    disk = tmp_path / "disk"
    kv = dict(host_bytes="8MiB", disk_path=str(disk), disk_bytes="128MiB")
    drain = {"kind": "drain", "timeout_s": 60.0}
    run_with_events(tiny_model, subscriber.endpoint,
                    [generate("p1"), drain, generate("p2", "p3"), drain], **kv)
    subscriber.settle()
    first = list(subscriber.events)

    gpu = block_tokens(of(first, "BlockStored", "GPU"))
    cpu_stored = of(first, "BlockStored", "CPU")
    cpu = block_tokens(cpu_stored)
    # p1 ran alone on an empty host tier: every full block of its prompt was stored.
    assert len(cpu) >= 1500 // BLOCK_SIZE
    # The same blocks vLLM's own device cache announced: same hashes, same tokens.
    assert set(cpu) <= set(gpu)
    assert all(cpu[h] == gpu[h] for h in cpu)
    assert all(e.block_size == BLOCK_SIZE and e.group_idx == 0 for e in cpu_stored)
    # No block announced twice on the host tier while it is held there.
    held: set = set()
    for e in first:
        if getattr(e, "medium", None) != "CPU":
            continue
        for h in e.block_hashes:
            if type(e).__name__ == "BlockStored":
                assert h not in held, "a block announced twice on the host tier"
                held.add(h)
            else:
                assert h in held, "a block removed that was not announced"
                held.discard(h)
    # A small host tier evicted: removals of blocks it had announced.
    assert of(first, "BlockRemoved", "CPU")
    # Spilled to disk: announced as STORAGE, local.
    storage = block_tokens(of(first, "BlockStored", "STORAGE"))
    assert storage and set(storage) <= set(cpu)
    on_disk = set(storage) - {h for e in of(first, "BlockRemoved", "STORAGE") for h in e.block_hashes}

    # A restart on the same disk tier: its recovered contents are announced again.
    mark = len(subscriber.events)
    run_with_events(tiny_model, subscriber.endpoint, [generate("shared0")], **kv)
    subscriber.settle()
    second = subscriber.events[mark:]
    again = block_tokens(of(second, "BlockStored", "STORAGE"))
    assert on_disk <= set(again)
    assert all(again[h] == storage[h] for h in on_disk)


class Router:
    """The tiny cache-aware router of the demonstration: per replica, the block hashes its
    events say it holds (any medium); a prompt goes to the replica holding its longest prefix.

    Block hashes of a prompt are learned from the events themselves (``parent_block_hash`` and
    each block's ``token_ids``), as a router that does not compute vLLM's hashes does."""

    def __init__(self, subscribers: list[Subscriber]) -> None:
        self.subscribers = subscribers
        self.seen = [0] * len(subscribers)
        self.held: list[dict[str, set]] = [{} for _ in subscribers]
        self.learned: dict[tuple, int] = {}
        self.load = [0] * len(subscribers)

    def _catch_up(self) -> None:
        for r, sub in enumerate(self.subscribers):
            new = sub.events[self.seen[r]:]
            self.seen[r] += len(new)
            for e in new:
                name = type(e).__name__
                if name == "BlockStored":
                    for i, h in enumerate(e.block_hashes):
                        parent = e.parent_block_hash if i == 0 else e.block_hashes[i - 1]
                        tokens = tuple(e.token_ids[i * e.block_size:(i + 1) * e.block_size])
                        self.learned[parent, tokens] = h
                    self.held[r].setdefault(e.medium, set()).update(e.block_hashes)
                elif name == "BlockRemoved":
                    self.held[r].get(e.medium, set()).difference_update(e.block_hashes)
                elif name == "AllBlocksCleared":
                    self.held[r].clear()

    def score(self, r: int, tokens: list[int], media: tuple[str, ...] | None = None) -> int:
        """Blocks of ``tokens``' prefix replica ``r`` holds (in ``media``; None: any)."""
        self._catch_up()
        sets = [s for m, s in self.held[r].items() if media is None or m in media]
        parent, n = None, 0
        for b in range(len(tokens) // BLOCK_SIZE):
            h = self.learned.get((parent, tuple(tokens[b * BLOCK_SIZE:(b + 1) * BLOCK_SIZE])))
            if h is None or not any(h in s for s in sets):
                break
            parent, n = h, n + 1
        return n

    def route(self, tokens: list[int]) -> int:
        scores = [self.score(r, tokens) for r in range(len(self.subscribers))]
        best = max(range(len(scores)), key=lambda r: (scores[r], -self.load[r]))
        self.load[best] += 1
        return best

    def wait_for(self, r: int, tokens: list[int], blocks: int, timeout_s: float = 120.0) -> None:
        """Until replica ``r``'s events cover ``blocks`` blocks of ``tokens`` (fails after
        ``timeout_s``, never passes for it)."""
        deadline = time.monotonic() + timeout_s
        while self.score(r, tokens) < blocks:
            assert time.monotonic() < deadline, "the replica's events never covered the prompt"
            time.sleep(0.05)


def test_a_router_fed_by_the_events_beats_round_robin(tiny_model, tmp_path: Path):
    """Two replicas with small device caches; three documents asked four times each,
    interleaved. Round-robin computes every document on both replicas; the router sends each to
    the replica whose events (device and tieredkv's host tier) cover it."""
    import json

    from tests.e2e.conftest import make_prompt
    from tieredkv.tools.vllm_server import Server

    subs = [Subscriber(), Subscriber()]
    servers = []
    try:
        for i, sub in enumerate(subs):
            events = {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": sub.endpoint, "topic": "kv"}
            servers.append(Server(
                Path(tiny_model), tieredkv_config(host_bytes="64MiB"), tmp_path / f"replica{i}.log",
                extra_args=["--enable-prefix-caching", "--num-gpu-blocks-override", "48",
                            "--max-model-len", "1280", "--kv-events-config", json.dumps(events)],
            ).start())
        router = Router(subs)
        doc_blocks = 1024 // BLOCK_SIZE

        def workload(seed: int) -> list[list[int]]:
            docs = [make_prompt(seed + d, 1024) for d in range(3)]
            return [make_prompt(seed * 100 + k, 1024 + 64, prefix=docs[k % 3]) for k in range(12)]

        def run(prompts: list[list[int]], choose) -> int:
            hits = 0
            for k, prompt in enumerate(prompts):
                r = choose(k, prompt)
                _, _, cached = servers[r].complete_with_usage(prompt, max_tokens=4)
                hits += cached
                router.wait_for(r, prompt, doc_blocks)
            return hits

        cpu_only = []

        def routed(k: int, prompt: list[int]) -> int:
            r = router.route(prompt)
            if router.score(r, prompt) > router.score(r, prompt, media=("GPU",)):
                cpu_only.append(k)  # routed by blocks the device had evicted
            return r

        routed_hits = run(workload(10), routed)
        round_robin_hits = run(workload(20), lambda k, prompt: k % 2)
        print(f"cached prompt tokens: routed {routed_hits}, round-robin {round_robin_hits} "
              f"(of {12 * 1088}); routed by host-tier events only: requests {cpu_only}")
        # Round-robin: each document misses once per replica (6 misses); routed: once (3).
        assert routed_hits > round_robin_hits, (routed_hits, round_robin_hits)
        assert routed_hits >= 9 * (1024 - BLOCK_SIZE), routed_hits
        assert cpu_only, "no request was routed by tieredkv's host-tier events"
    finally:
        for server in servers:
            server.stop()
        for sub in subs:
            sub.close()


def test_a_hybrid_model_announces_what_each_group_serves(subscriber, tmp_path: Path):
    """Gemma-2-like tiny model (a 64-token sliding window between full-attention layers: two
    KV-cache groups): the full-attention group's blocks are announced with vLLM's hashes and its
    group index; the sliding group's only where a hit needs them: the last two blocks of each
    4-block chunk, and of the prompt's 2-block tail (a hit may end where the prompt ended)."""
    from tests.e2e.conftest import CHUNK_BLOCKS
    from tieredkv.tools.tiny_model import make_tiny_llama

    model = str(make_tiny_llama(tmp_path / "alternating", sliding_window=64,
                                layer_types=["sliding_attention", "full_attention"] * 2))
    run_with_events(model, subscriber.endpoint, [generate("p1"), {"kind": "drain"}],
                    host_bytes="256MiB")
    subscriber.settle()
    events = list(subscriber.events)
    cpu = of(events, "BlockStored", "CPU")
    kinds = {e.group_idx: e.kv_cache_spec_kind for e in cpu}
    assert sorted(kinds.values()) == ["full_attention", "sliding_window"]
    full_idx = next(g for g, k in kinds.items() if k == "full_attention")
    sliding_idx = next(g for g, k in kinds.items() if k == "sliding_window")
    full = [h for e in cpu if e.group_idx == full_idx for h in e.block_hashes]
    sliding = [h for e in cpu if e.group_idx == sliding_idx for h in e.block_hashes]
    chunks = (1500 - 1) // (BLOCK_SIZE * CHUNK_BLOCKS)
    whole = chunks * CHUNK_BLOCKS
    assert len(full) == whole + 2  # the whole chunks and the tail (1500 tokens: 46 blocks)
    gpu_full = block_tokens([e for e in of(events, "BlockStored", "GPU") if e.group_idx == full_idx])
    full_tokens = block_tokens([e for e in cpu if e.group_idx == full_idx])
    assert set(full) <= set(gpu_full) and all(full_tokens[h] == gpu_full[h] for h in full)
    assert sliding == [h for j, h in enumerate(full)
                       if j % CHUNK_BLOCKS >= CHUNK_BLOCKS - 2 or j >= whole]
    assert all(e.kv_cache_spec_sliding_window == 64 for e in cpu if e.group_idx == sliding_idx)
