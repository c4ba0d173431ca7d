"""scheduler_bench's measurements: each call timed with the garbage collector paused, the
two sides alternating call by call (lookups, decode and prefill steps, keying alone), and a
cProfile of the hot paths."""

from __future__ import annotations

import gc
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks import common
from benchmarks.scheduler.sides import (
    Engine,
    Side,
    TieredSide,
    no_blocks,
    prompt,
    step,
    store_prompts,
)
from benchmarks.scheduler.workload import (
    BLOCK_SIZE,
    CHUNK_BLOCKS,
    CHUNK_TOKENS,
    DECODE_PROMPT_TOKENS,
    KEYING_TOKENS,
    PREFILL_PROMPT_TOKENS,
    Profile,
    fmt_size,
)


class Samples:
    def __init__(self) -> None:
        self.by_key: dict[tuple[str, ...], list[float]] = {}

    def add(self, key: tuple[str, ...], micros: float) -> None:
        self.by_key.setdefault(key, []).append(micros)

    def get(self, key: tuple[str, ...]) -> list[float]:
        return self.by_key.get(key, [])


def timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """Call once with the collector paused; returns (result, microseconds)."""
    gc.disable()
    try:
        start = time.perf_counter_ns()
        out = fn(*args)
        end = time.perf_counter_ns()
    finally:
        gc.enable()
    return out, (end - start) / 1000.0


def ordered(sides: Sequence[Side], iteration: int) -> list[Side]:
    """Alternate which connector goes first, so drift and cache effects hit both alike."""
    return list(sides) if iteration % 2 == 0 else list(reversed(sides))


def bench_lookups(
    engine: Engine, profile: Profile, samples: Samples, progress: common.Progress
) -> dict[str, Any]:
    """get_num_new_matched_tokens: hit and miss, cold keys and repeated, per prompt size."""
    from vllm.v1.request import RequestStatus

    filled = engine.pair()
    empty = engine.pair()
    templates = {n: engine.request(f"template-{n}", prompt(n, n)) for n in profile.sizes}
    for n, template in templates.items():
        for side in filled:
            store_prompts(side, engine, [engine.clone(f"fill-{side.name}-{n}", template)])
    hits: dict[str, dict[int, int]] = {side.name: {} for side in filled}
    serial = itertools.count()
    for n in profile.sizes:
        template = templates[n]
        for state, sides in (("hit", filled), ("miss", empty)):
            progress.set_label(f"lookup {fmt_size(n)} {state}")
            for i in range(profile.lookup_iters):
                for side in ordered(sides, i):
                    request = engine.clone(f"{side.name}-{state}-{n}-{next(serial)}", template)
                    side.connector.on_new_request(request)
                    call = side.connector.get_num_new_matched_tokens
                    (tokens, is_async), micros = timed(call, request, 0)
                    samples.add((side.name, "lookup", state, "cold", str(n)), micros)
                    pinned = side.pinned() if isinstance(side, TieredSide) else None
                    for _ in range(profile.lookup_repeats):
                        (again, _), micros = timed(call, request, 0)
                        samples.add((side.name, "lookup", state, "repeat", str(n)), micros)
                        assert again == tokens, f"{side.name}: repeated lookup changed the hit"
                        if pinned is not None:
                            assert side.pinned() == pinned, "tieredkv: repeated lookup re-pinned"
                    _check_hit(side.name, state, n, tokens, is_async)
                    if state == "hit":
                        hits[side.name][n] = tokens
                    # vLLM's path for a request that is then not admitted: no allocation.
                    side.connector.update_state_after_alloc(request, no_blocks(), 0)
                    side.finish([request], RequestStatus.FINISHED_ABORTED)
                    side.check_idle()
                if i % 20 == 19:
                    gc.collect()
                progress.advance()
    return {"hit_tokens": hits}


def _check_hit(name: str, state: str, n: int, tokens: int | None, is_async: bool) -> None:
    if state == "miss":
        assert tokens == 0 and not is_async, f"{name}: miss row returned {tokens}"
        return
    # tieredkv on vLLM's CPU build answers a host hit of at most 32 MiB per step synchronous
    # (``sync_loads``); vLLM's OffloadingConnector loads asynchronously.
    assert tokens is not None and (is_async or name.startswith("tieredkv")), (
        f"{name}: hit row returned {tokens}")
    if name.startswith("tieredkv"):
        # Everything but the block holding the last prompt token (vLLM recomputes it).
        expected = (n - 1) // BLOCK_SIZE * BLOCK_SIZE
        assert tokens == expected, f"tieredkv: hit {tokens} tokens of {n}, expected {expected}"
    else:
        assert n - CHUNK_TOKENS <= tokens <= n, f"vllm: hit {tokens} tokens of {n}"


def _running_requests(engine: Engine, count: int, length: int, tag: str, seed: int) -> list[Any]:
    return [engine.request(f"{tag}-{i}", prompt(seed + i, length)) for i in range(count)]


def bench_decode(
    engine: Engine, profile: Profile, samples: Samples, progress: common.Progress
) -> None:
    """build_connector_meta with N running requests, each scheduled one decode token."""
    from vllm.v1.request import RequestStatus

    for count in profile.running:
        progress.set_label(f"build_connector_meta decode x{count}")
        sides = engine.pair()
        requests = _running_requests(engine, count, DECODE_PROMPT_TOKENS, f"dec{count}", 10_000)
        for side in sides:
            side.admit(requests)
        # Prefill in one step; the workers report every store done.
        prefill = [(r, engine.new_blocks(DECODE_PROMPT_TOKENS // BLOCK_SIZE), r.num_tokens)
                   for r in requests]
        metas = {side.name: side.connector.build_connector_meta(step(new=prefill)) for side in sides}
        for side in sides:
            side.complete(side.store_job_ids(metas[side.name]))
        for request in requests:
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = request.num_tokens
            request.append_output_token_ids(7)
        # First decode step: one new block per request (a new block starts at token 2048).
        first = [(r, engine.new_blocks(1), 1) for r in requests]
        for side in sides:
            assert not side.store_job_ids(side.connector.build_connector_meta(step(cached=first)))
        for request in requests:
            request.num_computed_tokens += 1
            request.append_output_token_ids(7)
        # Steady decode steps: one token each, no new block, nothing to store.
        for i in range(profile.decode_iters):
            for side in ordered(sides, i):
                output = step(cached=[(r, None, 1) for r in requests])
                meta, micros = timed(side.connector.build_connector_meta, output)
                assert not side.store_job_ids(meta), f"{side.name}: decode step planned stores"
                samples.add((side.name, "meta", "decode", "", str(count)), micros)
            if i % 50 == 49:
                gc.collect()
            progress.advance()
        for side in sides:
            side.finish(requests)
            side.check_idle()


def bench_prefill(
    engine: Engine, profile: Profile, samples: Samples, progress: common.Progress
) -> None:
    """build_connector_meta with N requests in their second 512-token prefill chunk."""
    for count in profile.running:
        progress.set_label(f"build_connector_meta prefill x{count}")
        templates = _running_requests(engine, count, PREFILL_PROMPT_TOKENS, "tpl", 20_000)
        for i in range(profile.prefill_iters):
            sides = engine.pair()  # fresh tiers: the chunks are new to both every time
            requests = [engine.clone(f"pre{count}-{i}-{j}", t) for j, t in enumerate(templates)]
            for side in sides:
                side.admit(requests)
            first = [(r, engine.new_blocks(CHUNK_BLOCKS), CHUNK_TOKENS) for r in requests]
            for side in sides:
                # Chunk 0 is planned now and stays in flight, as it would on a busy engine.
                meta = side.connector.build_connector_meta(step(new=first))
                assert len(side.store_job_ids(meta)) == count, f"{side.name}: chunk 0 stores"
            for request in requests:
                request.num_computed_tokens = CHUNK_TOKENS
            second = [(r, engine.new_blocks(CHUNK_BLOCKS), CHUNK_TOKENS) for r in requests]
            for side in ordered(sides, i):
                meta, micros = timed(side.connector.build_connector_meta, step(cached=second))
                planned = len(side.store_job_ids(meta))
                assert planned == count, f"{side.name}: planned {planned} stores for {count}"
                samples.add((side.name, "meta", "prefill", "", str(count)), micros)
            for side in sides:
                side.connector.shutdown()
            del sides
            gc.collect()
            progress.advance()


def bench_keying(
    engine: Engine, profile: Profile, samples: Samples, progress: common.Progress
) -> dict[str, Any]:
    """Keying and index lookups of a 128k-token prompt, without the connector around them."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

    from tieredkv.keys import chunk_keys

    progress.set_label("keying 128k")
    template = engine.request("keying", prompt(KEYING_TOKENS, KEYING_TOKENS))
    tiered, offloading = engine.pair()[:2]  # keying alone does not touch KV events
    for side in (tiered, offloading):
        store_prompts(side, engine, [engine.clone(f"keying-fill-{side.name}", template)])
    fingerprint = tiered.half.geometry.fingerprint
    host = tiered.half.planner.host
    manager = offloading.scheduler.manager
    context = ReqContext(req_id="keying")
    hashes = template.block_hashes
    last = CHUNK_BLOCKS - 1

    def tiered_keys() -> list[bytes]:
        return chunk_keys(fingerprint, hashes, CHUNK_BLOCKS)

    def vllm_keys() -> list[bytes]:
        return [make_offload_key(h, 0) for h in itertools.islice(hashes, last, None, CHUNK_BLOCKS)]

    tk, vk = tiered_keys(), vllm_keys()

    def tiered_lookup() -> int:
        return sum(1 for key in tk if host.is_ready(key))

    def vllm_lookup() -> int:
        return sum(1 for key in vk if manager.lookup(key, context) is LookupResult.HIT)

    def plain_dict() -> int:
        return sum(1 for key in tk if key in entries)

    entries = dict.fromkeys(tk)
    assert tiered_lookup() == vllm_lookup() == len(tk) == KEYING_TOKENS // CHUNK_TOKENS
    pairs = [
        ("keying", tiered_keys, vllm_keys),
        ("index", tiered_lookup, vllm_lookup),
    ]
    for i in range(profile.keying_iters):
        for what, tfn, vfn in pairs:
            order = [("tieredkv", tfn), ("vllm", vfn)]
            for name, fn in order if i % 2 == 0 else reversed(order):
                _, micros = timed(fn)
                samples.add((name, what, "", "", str(KEYING_TOKENS)), micros)
        _, micros = timed(plain_dict)
        samples.add(("dict", "index", "", "", str(KEYING_TOKENS)), micros)
        if i % 100 == 99:
            gc.collect()
        progress.advance()
    return {"keys": len(tk), "block_hashes": len(hashes)}


def cprofile_hot_paths(engine: Engine, tokens: int = KEYING_TOKENS, iters: int = 100,
                       top: int = 12) -> str:
    """cProfile of both connectors' lookup (hit; cold + 3 repeats) and of a 256-request
    prefill step, sorted by own time: where the time goes."""
    import cProfile
    import io
    import pstats

    from vllm.v1.request import RequestStatus

    template = engine.request("profile", prompt(tokens, tokens))
    sides = engine.pair()
    for side in sides:
        store_prompts(side, engine, [engine.clone(f"profile-fill-{side.name}", template)])
    report = []

    def lookups(side: Side) -> None:
        for i in range(iters):
            request = engine.clone(f"profile-{side.name}-{i}", template)
            side.connector.on_new_request(request)
            for _ in range(4):
                side.connector.get_num_new_matched_tokens(request, 0)
            side.connector.update_state_after_alloc(request, no_blocks(), 0)
            side.finish([request], RequestStatus.FINISHED_ABORTED)

    def prefill_step(side_index: int) -> Callable[[], None]:
        def run_steps() -> None:
            for i in range(max(1, iters // 20)):
                side = engine.pair()[side_index]
                requests = [engine.clone(f"pp-{i}-{j}", t) for j, t in enumerate(templates)]
                side.admit(requests)
                side.connector.build_connector_meta(step(new=[
                    (r, engine.new_blocks(CHUNK_BLOCKS), CHUNK_TOKENS) for r in requests]))
                for request in requests:
                    request.num_computed_tokens = CHUNK_TOKENS
                profiler.enable()
                side.connector.build_connector_meta(step(cached=[
                    (r, engine.new_blocks(CHUNK_BLOCKS), CHUNK_TOKENS) for r in requests]))
                profiler.disable()
        return run_steps

    templates = _running_requests(engine, 256, PREFILL_PROMPT_TOKENS, "ptpl", 30_000)
    for index, side in enumerate(sides):
        for what, body in (
            (f"get_num_new_matched_tokens {fmt_size(tokens)} hit, cold + 3 repeats", None),
            ("build_connector_meta prefill x256", prefill_step(index)),
        ):
            profiler = cProfile.Profile()
            if body is None:
                profiler.enable()
                lookups(side)
                profiler.disable()
            else:
                body()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
            report.append(f"### {side.label}: {what}\n{text.getvalue().strip()}")
    return "\n\n".join(report)
