"""The shared remote tier (issue #14) on real vLLM engines and a real redis-server.

Every engine is its own process, so a hit in a second engine can only come from Redis: it
never shared host memory or a disk tier with the engine that wrote the chunks. Outputs are
compared token for token and logprob for logprob with an engine without tieredkv, and every
prompt's hit is checked against the exact number of tokens the remote tier can serve: as
many as vLLM's own prefix cache would (its whole chunks and its tail, a value of the tail's
own rows, issue #25).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import redis

from tests.e2e.conftest import (
    BLOCK_SIZE,
    CHUNK_BLOCKS,
    CHUNK_TOKENS,
    MAX_TOKENS,
    PROMPTS,
    assert_hits,
    assert_same_as_reference,
    counter_delta,
    expected_hit_tokens,
    generate,
    outputs_by_name,
    run_engine,
    run_engine_with_options,
    tieredkv_config,
)
from tieredkv.remote.codec import POINTER_BYTES, POINTER_MAGIC
from tieredkv.testing.redis_procs import RedisClusterProcs, RedisServer

pytestmark = pytest.mark.vllm

DRAIN = {"kind": "drain"}
RESET = {"kind": "reset_prefix"}
RESET_ALL = {"kind": "reset_all"}
# Not chunk multiples, but for on_boundary, whose last whole chunk vLLM cannot use in full.
NAMES = ["p1", "p2", "boundary_minus_1", "boundary_plus_1", "on_boundary"]
SALTED = "p3"  # written by the writer only under the salt "tenant-a"
PREFIX = "e2e"  # the writer's and the readers' key prefix on the module's Redis
TIMEOUT_S = 0.2  # remote_timeout_s: a dead Redis may cost a request at most this long
ROPE_5000 = {"rope_parameters": {"rope_theta": 5000.0, "rope_type": "default"}}  # as test_e2e_namespace


def whole_chunks(name: str) -> int:
    return len(PROMPTS[name]) // CHUNK_TOKENS


def has_tail(name: str) -> bool:
    """Whether the prompt has two or more full blocks past its last whole chunk (a tail the
    writer stores and writes to Redis as its own value; a one-block tail stays local)."""
    return len(PROMPTS[name]) // BLOCK_SIZE >= whole_chunks(name) * CHUNK_BLOCKS + 2


def written_values(name: str) -> int:
    """Values the writer puts in Redis for a prompt: its whole chunks and its tail."""
    return whole_chunks(name) + has_tail(name)


def remote_hit_tokens(name: str) -> int:
    """Tokens a fresh engine serves from the remote tier for a prompt another engine saw:
    what vLLM's own prefix cache would serve (every full block but the one holding the last
    token), whole chunks and tail alike."""
    return expected_hit_tokens(len(PROMPTS[name]))


def remote_reads(name: str) -> int:
    """Values a fresh engine reads for the prompt: the whole chunks, and the tail when the
    hit goes past them."""
    return whole_chunks(name) + (remote_hit_tokens(name) > whole_chunks(name) * CHUNK_TOKENS)


def spec(model: str, phases: list[dict], url: str, **kv) -> dict:
    # Sharing tests give a probe time: on a loaded CI machine a first probe that missed a
    # 0.5 s deadline would be a miss (counted), not what these tests check. Fault tests pass
    # their own short timeout.
    kv.setdefault("remote_timeout_s", 2.0)
    return {
        "model": model, "max_tokens": MAX_TOKENS, "phases": phases,
        "kv_transfer_config": tieredkv_config(host_bytes="256MiB", remote_url=url, **kv),
    }


def ok(result: dict) -> dict:
    assert "startup_error" not in result, result.get("startup_traceback")
    return result


delta = counter_delta


def redis_keys(server: RedisServer, prefix: str) -> list[str]:
    """The keys under ``prefix`` on one node (``{prefix}:{namespace}:r{rank}:{chunk key}``)."""
    return server.cli("--scan", "--pattern", f"{prefix}:*").split()


def assert_served_from_remote(phases: list[dict], index: int, names: list[str], reference: dict) -> None:
    """Phase ``index`` of a fresh engine: each prompt hit exactly its remote-servable tokens,
    all of them counted as remote hits (none from host or disk), with the reference's outputs."""
    phase = phases[index]
    assert_same_as_reference(phase, names, reference)
    expected = {name: remote_hit_tokens(name) for name in names}
    assert_hits(phases, index, expected, tiers={"remote": sum(expected.values())})
    assert delta(phases, index, "remote_read_chunks") == sum(remote_reads(n) for n in names)
    failed = {k: v for k, v in phase["counters"].items() if k.startswith("remote_read_failed_")}
    assert not failed, failed


# ---------------------------------------------------------------- one writer, one reader


@pytest.fixture(scope="module")
def writer(tiny_model, redis_server) -> dict:
    """Engine A: computes NAMES and the salted prompt, writes them to the module's Redis,
    then resets with reset_connector and exits. Also the keys Redis holds right after."""
    result = ok(run_engine(spec(
        tiny_model,
        [generate(*NAMES), generate(SALTED, salt="tenant-a"), DRAIN, RESET_ALL],
        redis_server.url, remote_key_prefix=PREFIX,
    )))
    return {"phases": result["phases"], "keys": redis_keys(redis_server, PREFIX)}


@pytest.fixture(scope="module")
def reader(tiny_model, redis_server, writer) -> list[dict]:
    """Engine B, a fresh process on the same Redis after A exited: NAMES, then the salted
    prompt under another tenant's salt and under the writer's."""
    return ok(run_engine(spec(
        tiny_model,
        [generate(*NAMES), generate(SALTED, salt="tenant-b"), RESET, generate(SALTED, salt="tenant-a")],
        redis_server.url, remote_key_prefix=PREFIX,
    )))["phases"]


def test_second_engine_serves_what_only_the_first_saw(writer, reader, reference):
    written = writer["phases"]
    assert_same_as_reference(written[0], NAMES, reference)
    assert [out["num_cached_tokens"] for out in written[0]["outputs"]] == [0] * len(NAMES)
    # Every whole chunk and tail the writer computed went to Redis, and nothing else.
    expected_chunks = sum(written_values(n) for n in NAMES) + written_values(SALTED)
    assert written[2]["counters"].get("remote_written_chunks", 0) == expected_chunks, written[2]["counters"]
    assert_served_from_remote(reader, 0, NAMES, reference)
    # Chunks read from Redis are not written back.
    assert reader[0]["counters"].get("remote_written_chunks", 0) == 0, reader[0]["counters"]


def test_cache_salt_separates_tenants_across_replicas(reader, reference):
    _, other_tenant, _, same_tenant = reader
    assert_hits(reader, 1, {SALTED: 0})
    assert_same_as_reference(other_tenant, [SALTED], reference)
    # Positive control: the writer's own salt hits in the same engine, all its whole chunks,
    # from Redis, so the miss above is the salt's doing.
    hit = remote_hit_tokens(SALTED)
    assert_hits(reader, 3, {SALTED: hit}, tiers={"remote": hit})
    assert_same_as_reference(same_tenant, [SALTED], reference)


def test_reset_with_connector_does_not_flush_the_shared_tier(writer, reader, reference):
    assert writer["phases"][3]["ok"] is True
    # After the writer's reset_all and exit: one shard (rank 0) of every chunk it wrote, in
    # one namespace...
    keys = writer["keys"]
    assert len(keys) == sum(written_values(n) for n in NAMES) + written_values(SALTED), keys
    assert len({key.split(":")[1] for key in keys}) == 1, keys
    assert {key.split(":")[2] for key in keys} == {"r0"}
    # ... which the next engine hits.
    assert reader[0]["outputs"][0]["num_cached_tokens"] == remote_hit_tokens(NAMES[0])


def test_a_chats_next_turn_on_a_fresh_engine_hits_the_previous_turns_tail(
        tiny_model, redis_server, writer, reference):
    """p1_next is p1 and 300 more tokens (the next turn of p1's chat), served by a fresh
    engine: its hit from Redis ends where p1's full blocks end (p1's whole chunks and the
    tail the writer stored), as vLLM's own prefix cache would on the writer."""
    phases = ok(run_engine(spec(tiny_model, [generate("p1_next")], redis_server.url,
                                remote_key_prefix=PREFIX)))["phases"]
    hit = len(PROMPTS["p1"]) // BLOCK_SIZE * BLOCK_SIZE
    assert_hits(phases, 0, {"p1_next": hit}, tiers={"remote": hit})
    assert delta(phases, 0, "remote_read_chunks") == written_values("p1")
    assert_same_as_reference(phases[0], ["p1_next"], reference)


def test_a_tail_superseded_in_redis_becomes_a_pointer_a_fresh_engine_hits_through(
        tiny_model, redis_server, reference):
    """Engine A serves p1 (its tail, two blocks past its last whole chunk, goes to Redis),
    then p1_next, the next turn of p1's chat, whose whole chunk holds that tail's blocks: the
    tail's value in Redis is replaced by a 120-byte pointer to that chunk (one copy of those
    blocks, not two). A fresh engine B asking for p1 still hits as far as vLLM's prefix cache
    would, the tail's blocks read through the pointer, with the reference's outputs."""
    prefix = "sup"
    assert has_tail("p1")
    written = ok(run_engine(spec(tiny_model, [generate("p1"), generate("p1_next"), DRAIN],
                                 redis_server.url, remote_key_prefix=prefix)))["phases"]
    assert_same_as_reference(written[0], ["p1"], reference)
    assert_same_as_reference(written[1], ["p1_next"], reference)
    client = redis.Redis.from_url(redis_server.url)
    try:
        values = {key: client.get(key) for key in client.scan_iter(match=f"{prefix}:*")}
    finally:
        client.close()
    pointers = [v for v in values.values() if v is not None and v[:8] == POINTER_MAGIC]
    new_chunks = whole_chunks("p1_next") - whole_chunks("p1")
    assert len(values) == written_values("p1") + new_chunks, sorted(values)
    assert [len(v) for v in pointers] == [POINTER_BYTES], [len(v) for v in pointers]
    read = ok(run_engine(spec(tiny_model, [generate("p1")], redis_server.url,
                              remote_key_prefix=prefix)))["phases"]
    assert_served_from_remote(read, 0, ["p1"], reference)


# ---------------------------------------------------------------- Redis Cluster


def test_two_engines_on_a_three_master_cluster(tiny_model, reference, redis_cluster: RedisClusterProcs):
    names = ["p1", "boundary_plus_1"]
    url = redis_cluster.url  # redis+cluster://127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3
    written = ok(run_engine(spec(tiny_model, [generate(*names), DRAIN], url)))["phases"]
    assert_same_as_reference(written[0], names, reference)
    read = ok(run_engine(spec(tiny_model, [generate(*names)], url)))["phases"]
    assert_served_from_remote(read, 0, names, reference)
    # The shards really are spread over the masters (each chunk key is its own hash tag).
    per_node = [len(redis_keys(node, "tkv")) for node in redis_cluster.servers]
    assert sum(per_node) == sum(written_values(n) for n in names), per_node
    assert sum(1 for count in per_node if count) >= 2, per_node


# ---------------------------------------------------------------- a KV-affecting change


def test_changed_rope_base_misses_what_the_writer_stored(tiny_model, redis_server, writer, reference):
    names = ["p1", "p2"]
    options = {"engine_kwargs": {"hf_overrides": ROPE_5000}}
    changed = ok(run_engine_with_options({
        **spec(tiny_model, [generate(*names)], redis_server.url, remote_key_prefix=PREFIX), **options,
    }))["phases"][0]
    own = ok(run_engine_with_options({
        "model": tiny_model, "max_tokens": MAX_TOKENS, "prefix_caching": False,
        "phases": [generate(*names)], **options,
    }))["phases"][0]
    own_reference = outputs_by_name({**own, "names": names})
    # The change alters the outputs, so chunks stored before it would show if served.
    assert any(own_reference[n]["token_ids"] != reference[n]["token_ids"] for n in names)
    assert_hits([changed], 0, dict.fromkeys(names, 0))
    counters = changed["counters"]
    assert counters.get("remote_read_chunks", 0) == 0, counters
    # Redis was up and asked: the other namespace's key names simply are not there.
    assert counters.get("remote_probes", 0) > 0, counters
    assert changed["gauges"]["remote_up"] == 1
    assert_same_as_reference(changed, names, own_reference)


# ---------------------------------------------------------------- Redis failing


def test_redis_killed_mid_run_never_hangs_or_corrupts(tiny_model, reference, fresh_server, tmp_path: Path):
    server = fresh_server()
    waiting, go = tmp_path / "waiting", tmp_path / "go"
    phases = [
        generate("p1"), DRAIN,
        {"kind": "wait_for_file", "touch": str(waiting), "path": str(go)},
        RESET_ALL, generate("p1", "p2"), generate("p3"), DRAIN,
    ]
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = run_engine(spec(tiny_model, phases, server.url, remote_timeout_s=TIMEOUT_S))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    # The engine touches ``waiting`` once p1 is in Redis; the engine run's own timeout (and
    # wait_for_file's) ends a run that never gets there, so this cannot hang either.
    while not waiting.exists() and thread.is_alive():
        thread.join(0.05)
    if waiting.exists():
        server.kill()
    go.touch()
    thread.join(900)
    assert not thread.is_alive(), "the engine run did not finish"
    if "error" in outcome:
        raise outcome["error"]
    result = ok(outcome["result"])
    phases = result["phases"]
    before, _, _, reset, both, fresh, end = phases
    assert reset["ok"] is True
    assert result["phases"][1]["counters"].get("remote_written_chunks", 0) == written_values("p1")
    # p1 was in Redis before the kill, p2 and p3 never were: all recomputed, all correct.
    assert_same_as_reference(before, ["p1"], reference)
    assert_same_as_reference(both, ["p1", "p2"], reference)
    assert_same_as_reference(fresh, ["p3"], reference)
    assert_hits(phases, 4, {"p1": 0, "p2": 0})
    assert_hits(phases, 5, {"p3": 0})
    for phase in (both, fresh):
        assert all(out["finish_reason"] == "length" for out in phase["outputs"])
    assert end["counters"].get("hit_tokens_remote", 0) == 0, end["counters"]
    # No stall (every request finished, above): the probes after the kill failed, and once the
    # tier was known down p3's lookup made no call at all (counted as "unavailable").
    failed = {k: v for k, v in end["counters"].items() if k.startswith("remote_probe_failed_")}
    assert failed, end["counters"]
    assert delta(phases, 5, "remote_probe_failed_unavailable") >= 1, (fresh["counters"], both["counters"])
    assert delta(phases, 5, "remote_probes") == 0, (fresh["counters"], both["counters"])
    assert end["gauges"]["remote_up"] == 0
    # p3 came after the engine knew: its chunks were never queued for the dead server.
    assert end["counters"].get("remote_writes_dropped", 0) >= written_values("p3"), end["counters"]


def test_redis_down_at_startup_engine_serves_without_it(tiny_model, reference, fresh_server):
    server = fresh_server(start=False)  # a free port nothing listens on
    phases = [generate("p1", "p2"), RESET, generate("p1", "p2"), DRAIN]
    result = ok(run_engine(spec(tiny_model, phases, server.url, remote_timeout_s=TIMEOUT_S)))
    cold, _, warm, end = result["phases"]
    assert_same_as_reference(cold, ["p1", "p2"], reference)
    assert_same_as_reference(warm, ["p1", "p2"], reference)
    # The host tier works as without a remote tier; Redis serves and takes nothing.
    names = ["p1", "p2"]
    expected = {n: expected_hit_tokens(len(PROMPTS[n])) for n in names}
    assert_hits(result["phases"], 2, expected, tiers={"host": sum(expected.values())})
    assert end["counters"].get("hit_tokens_remote", 0) == 0, end["counters"]
    assert end["counters"].get("remote_written_chunks", 0) == 0, end["counters"]
    assert end["gauges"]["remote_up"] == 0


# ---------------------------------------------------------------- tensor parallel


def test_tensor_parallel_two_ranks_share_the_tier(tiny_model, reference, redis_server):
    names = ["p1", "boundary_plus_1"]
    tp = {"tensor_parallel_size": 2}
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    kv = dict(remote_key_prefix="tp2")
    written = ok(run_engine({**spec(tiny_model, [generate(*names), DRAIN], redis_server.url, **kv), **tp},
                            env=env))["phases"]
    assert_same_as_reference(written[0], names, reference)
    keys = redis_keys(redis_server, "tp2")
    per_rank = {rank: sum(1 for k in keys if k.split(":")[2] == rank) for rank in ("r0", "r1")}
    chunks = sum(written_values(n) for n in names)
    assert per_rank == {"r0": chunks, "r1": chunks}, per_rank  # each rank wrote its shard
    read = ok(run_engine({**spec(tiny_model, [generate(*names)], redis_server.url, **kv), **tp},
                         env=env))["phases"]
    assert_served_from_remote(read, 0, names, reference)
