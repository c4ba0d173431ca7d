"""Run one vLLM engine (one configuration) in its own process and print results as JSON.

The worker-side connector is a process global in vLLM, so every configuration gets a fresh
process. Input: the path of a JSON spec in argv[1]; output: one JSON line prefixed with RESULT= on stdout.
Phases run in order on the same engine: ``generate`` (a batch of prompts), ``reset_prefix``
(vLLM's own prefix cache, so the next phase can only hit tieredkv), ``reset_all`` (tieredkv
too), ``drain`` (wait until tieredkv has no job in flight), ``wait_for_file`` (create the file
``touch``, then wait for the file ``path``: the test acts on the world between two phases).

Each output carries ``num_cached_tokens`` (vLLM's count: its own prefix cache and the
connector's tokens together) and ``tieredkv``: the tokens vLLM took from tieredkv for that
request (``num_external_tokens`` of every allocation: ``allocs``, and their sum; ``sync``: for
each allocation, whether its load job was synchronous, copied before that step's forward), tieredkv's own
account of them by tier (``planner.hit_tokens``), and every store of the request's chunks as it
completed (``stores``: ``[job id, chunk key, failure cause or None]``), so a test can tell
tieredkv's hit from vLLM's and attribute each counter, and each lost store, to a request.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

from tieredkv.protocol import Move

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def find_scheduler_half(llm):
    core = llm.llm_engine.engine_core
    core = getattr(core, "engine_core", core)
    connector = core.scheduler.connector
    return getattr(connector, "_scheduler", None)


def flat_counters(counts) -> dict[str, int]:
    """The planner's counts under one flat name each (``hit_tokens_host``,
    ``load_failed_copy_error``): what the e2e tests assert on, JSON-safe."""
    return {str(k) if not isinstance(k, tuple) else f"{k[0]}_{k[1]}": n for k, n in counts.items()}


def engine_info(llm) -> dict:
    """What vLLM made of the engine: the hybrid KV-cache manager's switch, the KV-cache groups
    (spec class names), the device blocks, and the capacity vLLM logs at start-up ("KV cache
    size: N tokens, Maximum concurrency ...": ``kv_cache_utils.update_kv_cache_capacity``)."""
    core = llm.llm_engine.engine_core
    core = getattr(core, "engine_core", core)
    config = getattr(core, "vllm_config", None) or llm.llm_engine.vllm_config
    kv_cache_config = core.scheduler.kv_cache_config
    return {
        "disable_hybrid_kv_cache_manager": config.scheduler_config.disable_hybrid_kv_cache_manager,
        "kv_cache_groups": [type(g.kv_cache_spec).__name__ for g in kv_cache_config.kv_cache_groups],
        "num_blocks": kv_cache_config.num_blocks,
        "kv_cache_size_tokens": getattr(config.cache_config, "kv_cache_size_tokens", None),
        "kv_cache_max_concurrency": getattr(config.cache_config, "kv_cache_max_concurrency", None),
    }


def drain(llm, timeout_s: float = 30.0) -> bool:
    """Step the engine until tieredkv has no pending job (spills journaled, stores done);
    whether it got there (``timeout_s`` only keeps a stuck job from hanging the test)."""
    half = find_scheduler_half(llm)
    deadline = time.monotonic() + timeout_s
    core = llm.llm_engine.engine_core
    core = getattr(core, "engine_core", core)
    while half is not None and half.has_pending_work() and time.monotonic() < deadline:
        core.step_fn() if hasattr(core, "step_fn") else core.step()
        time.sleep(0.01)
    return half is None or not half.has_pending_work()


def record_external_hits(llm) -> dict[str, dict]:
    """Wrap the connector's ``update_state_after_alloc``: per request (vLLM's internal id),
    the tokens vLLM took from tieredkv and tieredkv's split of them by tier."""
    core = llm.llm_engine.engine_core
    core = getattr(core, "engine_core", core)
    connector = core.scheduler.connector
    half = find_scheduler_half(llm)
    seen: dict[str, dict] = {}
    if connector is None or half is None:
        return seen
    plain = connector.update_state_after_alloc

    def update_state_after_alloc(request, blocks, num_external_tokens):
        plain(request, blocks, num_external_tokens)
        if num_external_tokens > 0:
            entry = seen.setdefault(request.request_id, new_entry())
            entry["tokens"] += num_external_tokens
            entry["allocs"].append(num_external_tokens)
            loads = [job for job in half.planner._ledger.plan.jobs
                     if job.move is Move.LOAD and job.req_id == request.request_id]
            entry["sync"].append(bool(loads) and loads[-1].src.sync)
            for tier, count in half.planner.hit_tokens(request.request_id).items():
                entry["by_tier"][tier] = entry["by_tier"].get(tier, 0) + count

    connector.update_state_after_alloc = update_state_after_alloc
    record_stores(half.planner, seen)
    return seen


def new_entry() -> dict:
    return {"tokens": 0, "allocs": [], "sync": [], "by_tier": {}, "stores": []}


def record_stores(planner, seen: dict[str, dict]) -> None:
    """Wrap the planner's store completion: each store, once every rank reported it, goes to
    its request's ``stores`` (job id, chunk key, the failure cause or None)."""

    ledger = planner._ledger
    handlers = dict(ledger._handlers)
    plain = handlers[Move.STORE]

    def complete_store(job, outcome):
        plain(job, outcome)
        if job.req_id is not None:
            failure = str(outcome.failure or "unknown") if outcome.failed else None
            seen.setdefault(job.req_id, new_entry())["stores"].append(
                [job.job_id, job.keys[0].hex(), failure])

    handlers[Move.STORE] = complete_store
    ledger.set_handlers(handlers)


def external_hits_of(seen: dict[str, dict], request_id: str) -> dict:
    """The entry of the request whose output id is ``request_id`` (vLLM's internal id is the
    output's id and a random suffix: ``{id}-{8 hex}``)."""
    for internal, entry in seen.items():
        if internal == request_id or internal.rsplit("-", 1)[0] == request_id:
            return entry
    return new_entry()


def main() -> None:
    with open(sys.argv[1]) as handle:
        spec = json.load(handle)
    from vllm import LLM, SamplingParams

    kwargs = dict(
        model=spec["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=spec.get("max_model_len", 8192),
        block_size=spec.get("block_size", 32),
        enable_prefix_caching=spec.get("prefix_caching", True),
        kv_cache_memory_bytes=spec.get("kv_cache_memory_bytes", 256 << 20),
        seed=0,
        dtype=spec.get("dtype", "float32"),
    )
    for key in ("num_gpu_blocks_override", "max_num_seqs", "max_num_batched_tokens",
                "tensor_parallel_size", "enable_chunked_prefill", "speculative_config"):
        if key in spec:
            kwargs[key] = spec[key]
    if spec.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    if spec.get("speculative_config"):
        kwargs["disable_log_stats"] = False  # the test reads the spec-decode counters
    result: dict = {"phases": []}
    try:
        llm = LLM(**kwargs)
    except Exception as exc:  # noqa: BLE001 - the test inspects the start-up error
        result["startup_error"] = f"{type(exc).__name__}: {exc}"
        result["startup_traceback"] = traceback.format_exc()
        print("RESULT=" + json.dumps(result), flush=True)
        return
    result["engine"] = engine_info(llm)
    external = record_external_hits(llm)
    for phase in spec["phases"]:
        kind = phase["kind"]
        record: dict = {"kind": kind, "names": phase.get("names")}
        sampling = SamplingParams(
            max_tokens=phase.get("max_tokens", spec.get("max_tokens", 8)), temperature=0.0,
            logprobs=1, ignore_eos=True,
        )
        if kind == "generate":
            prompts = []
            for item in phase["prompts"]:
                prompt = {"prompt_token_ids": item["tokens"]}
                if item.get("cache_salt"):
                    prompt["cache_salt"] = item["cache_salt"]
                prompts.append(prompt)
            started = time.perf_counter()
            outputs = llm.generate(prompts, sampling, use_tqdm=False)
            record["seconds"] = time.perf_counter() - started
            record["outputs"] = [
                {
                    "token_ids": list(out.outputs[0].token_ids),
                    "logprobs": [
                        float(lp[tok].logprob)
                        for lp, tok in zip(out.outputs[0].logprobs or [], out.outputs[0].token_ids, strict=False)
                    ],
                    "num_cached_tokens": out.num_cached_tokens,
                    "tieredkv": external_hits_of(external, out.request_id),
                    "finish_reason": out.outputs[0].finish_reason,
                }
                for out in outputs
            ]
        elif kind == "reset_prefix":
            # Stores still in flight hold device blocks (delayed frees) and make vLLM refuse
            # the reset; the next phase would then hit vLLM's own cache, not tieredkv.
            record["drained"] = drain(llm, phase.get("timeout_s", 30.0))
            record["ok"] = llm.reset_prefix_cache()
        elif kind == "reset_all":
            record["drained"] = drain(llm, phase.get("timeout_s", 30.0))
            record["ok"] = llm.reset_prefix_cache(reset_connector=True)
        elif kind == "drain":
            record["drained"] = drain(llm, phase.get("timeout_s", 30.0))
        elif kind == "remove_file":  # e.g. a fault's flag file: the fault is removed
            os.remove(phase["path"])
        elif kind == "sleep":  # let the engine's clock pass (the cost model's exploration)
            time.sleep(phase["seconds"])
        elif kind == "wait_for_file":
            open(phase["touch"], "w").close()
            deadline = time.monotonic() + phase.get("timeout_s", 120.0)
            while not os.path.exists(phase["path"]):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"wait_for_file: {phase['path']} never appeared")
                time.sleep(0.02)
        half = find_scheduler_half(llm)
        if half is not None:
            record["counters"] = flat_counters(half.planner.counters)
            record["host_ready"] = half.planner.host.ready_count
            record["disk_ready"] = half.planner.disk.ready_count if half.planner.disk else 0
            record["gauges"] = half.planner.gauges()
        result["phases"].append(record)
    if spec.get("speculative_config"):
        result["spec_decode"] = {
            metric.name: getattr(metric, "value", None)
            for metric in llm.get_metrics()
            if metric.name.startswith("vllm:spec_decode_num_")
        }
    if spec.get("shutdown", True):
        core = llm.llm_engine.engine_core
        core = getattr(core, "engine_core", core)
        core.shutdown()  # flushes tieredkv's journal and closes its files
    print("RESULT=" + json.dumps(result), flush=True)
    os._exit(0)  # skip the slow interpreter teardown of the engine


def main_with_engine_options() -> None:
    """:func:`main` with two more spec keys, for settings it does not forward itself.

    ``engine_kwargs`` go to ``vllm.LLM`` as they are and win over main's own (``hf_overrides``,
    ``kv_cache_dtype``, ``enable_lora``...); ``lora`` (``{"name", "id", "path"}``) sends every
    prompt with that LoRA adapter. Started by ``conftest.run_engine_with_options``.
    """
    import vllm

    with open(sys.argv[1]) as handle:
        spec = json.load(handle)
    extra = dict(spec.get("engine_kwargs") or {})
    lora = spec.get("lora")
    base = vllm.LLM

    def make_llm(**kwargs):
        llm = base(**{**kwargs, **extra})
        if lora:
            from vllm.lora.request import LoRARequest

            request = LoRARequest(lora["name"], int(lora["id"]), lora["path"])
            plain_generate = llm.generate
            llm.generate = lambda *args, **kw: plain_generate(*args, lora_request=request, **kw)
        return llm

    vllm.LLM = make_llm
    main()


if __name__ == "__main__":
    main()
