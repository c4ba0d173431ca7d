"""One e2e_ttft configuration's engine, in its own process (``python -m benchmarks.e2e_ttft
--child SPEC``): vLLM's offline ``LLM`` with the spec's settings, driven by the parent one JSON
line of phases at a time, each ``generate`` timed and split into forward compute and the rest.

vLLM's worker-side connector is a process global, hence one process per configuration.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.ttft.workload import BLOCK_SIZE


def flat_counts(snapshot: dict[str, Any]) -> dict[str, int]:
    """tieredkv's counters under one flat name each (``hit_tokens_host``,
    ``hits_declined_slower_than_recompute_disk``): the stats snapshot nests a counter kept by
    tier or cause as ``{count: {label: n}}``, and a run's records are per-run differences."""
    out: dict[str, int] = {}
    for count, value in snapshot.items():
        if isinstance(value, dict):
            out.update({f"{count}_{label}": n for label, n in value.items()})
        else:
            out[count] = value
    return out


def _scheduler_half(llm) -> Any:
    core = llm.llm_engine.engine_core
    core = getattr(core, "engine_core", core)
    connector = getattr(core.scheduler, "connector", None)
    return getattr(connector, "_scheduler", None)


def _engine_core(llm) -> Any:
    core = llm.llm_engine.engine_core
    return getattr(core, "engine_core", core)


def _step_until_idle(llm, timeout_s: float = 60.0) -> bool:
    """Step the engine until tieredkv has no job in flight (stores done, spills journaled, its
    writes to Redis sent) and vLLM holds no finished request's blocks any more (a request
    whose stores were still running when it finished keeps its blocks until the connector
    reports it sent).

    ``LLM.generate`` returns as soon as every output is final; in-process, nothing steps the
    engine after that, so this does what the engine core's busy loop does between requests.
    """
    half = _scheduler_half(llm)
    core = _engine_core(llm)
    deadline = time.monotonic() + timeout_s
    while (half is not None and half.has_pending_work()) or core.scheduler.has_requests():
        if time.monotonic() > deadline:
            return False
        core.step_fn() if hasattr(core, "step_fn") else core.step()
        time.sleep(0.002)
    remote = _remote_jobs()
    return remote is None or remote.flush_writes(max(0.1, deadline - time.monotonic()))


def _remote_jobs() -> Any:
    """This process's worker's RemoteJobs (the engine runs in-process here), or None.

    A store job ends once its values are queued for Redis; the writes go on in the
    background. ``drain`` waits for them too, so a measured run never computes beside the
    previous run's writes (an 8B-class prompt's 184 MiB through the slow row's proxy slowed
    the next run's forward, while the filler before it ran beside no such writes)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    worker = getattr(get_kv_transfer_group(), "_worker", None)
    driver = getattr(getattr(worker, "engine", None), "_remote", None)
    return getattr(driver, "jobs", None)


class _Trace:
    """Timestamps of tieredkv's scheduler/worker calls, by wrapping the connector's methods.

    Instrumentation of this benchmark's own process only (tieredkv is not modified).
    """

    def __init__(self) -> None:
        self.events: list[tuple[float, str, str]] = []
        self.t0 = 0.0

    def mark(self, what: str, detail: str = "") -> None:
        self.events.append((time.perf_counter(), what, detail))

    def install(self) -> None:
        # Imported here: the LMCache rows' children run where nothing of tieredkv is installed.
        from tieredkv.connector import TieredKVConnector
        from tieredkv.protocol import Move
        from tieredkv.transfer.disk_jobs import DiskJobs

        trace = self

        def wrap(cls, name: str, describe=None):
            original = getattr(cls, name)

            def wrapper(self, *args, **kwargs):
                start = time.perf_counter()
                result = original(self, *args, **kwargs)
                detail = describe(args, result) if describe else ""
                trace.events.append((start, name, f"{detail} [{(time.perf_counter() - start) * 1e3:.2f} ms]"))
                return result

            setattr(cls, name, wrapper)

        wrap(TieredKVConnector, "get_num_new_matched_tokens",
             lambda a, r: f"computed={a[1]} -> {r}")
        wrap(TieredKVConnector, "update_state_after_alloc", lambda a, r: f"external={a[2]}")
        wrap(TieredKVConnector, "build_connector_meta", lambda a, r: (
            f"loads={len(r.plan.of(Move.LOAD))} promotes={len(r.plan.of(Move.PROMOTE))} "
            f"stores={len(r.plan.of(Move.STORE))} spills={len(r.plan.of(Move.SPILL))}"))
        wrap(TieredKVConnector, "update_connector_output", lambda a, r: (
            f"recving={sorted(a[0].finished_recving or ())}"
            if getattr(a[0], "finished_recving", None) else ""))
        wrap(TieredKVConnector, "start_load_kv")
        wrap(TieredKVConnector, "get_transfer_results", lambda a, r: (
            f"recving={sorted(r.finished_recving)}" if r.finished_recving else ""))

        original_promote = DiskJobs._promote

        async def promote(self, entry):
            trace.mark("engine_promote:start", f"job={entry.job.job_id}")
            try:
                return await original_promote(self, entry)
            finally:
                trace.mark("engine_promote:end", f"job={entry.job.job_id}")

        DiskJobs._promote = promote

        from tieredkv.transfer.device_jobs import DeviceJobs

        original_run_load = DeviceJobs._run_load

        def run_load(self, entry, on_lane):
            start = time.perf_counter()
            original_run_load(self, entry, on_lane)
            trace.events.append((start, "load", f"job={entry.job.job_id} lane={on_lane} "
                                 f"{self.load_bytes(entry.job) >> 20} MiB "
                                 f"[{(time.perf_counter() - start) * 1e3:.2f} ms]"))

        DeviceJobs._run_load = run_load

        from tieredkv.remote.threaded import ThreadedRemoteStore
        from tieredkv.transfer.remote_jobs import RemoteJobs

        def timed_future(cls, name: str):
            original = getattr(cls, name)

            def call(self, keys, *args, **kwargs):
                start = time.perf_counter()
                future = original(self, keys, *args, **kwargs)
                future.add_done_callback(lambda _f: trace.events.append(
                    (start, name, f"{len(keys)} keys, answered "
                     f"[{(time.perf_counter() - start) * 1e3:.2f} ms]")))
                return future

            setattr(cls, name, call)

        timed_future(ThreadedRemoteStore, "batch_exists")
        timed_future(ThreadedRemoteStore, "batch_get_bounded")
        wrap(RemoteJobs, "start_reads", lambda a, r: f"{len(a[0])} reads")
        wrap(RemoteJobs, "_finish", lambda a, r: f"landed {len(r)} [verify + copy]")

        from tieredkv.transfer.lanes import CopyLane

        original_run_batch = CopyLane._run_batch

        def run_batch(self, requests):
            start = time.perf_counter()
            original_run_batch(self, requests)
            n = sum(len(r.pairs) for r in requests)
            trace.events.append((start, f"lane_{self.name}", f"{n} pairs [{(time.perf_counter() - start) * 1e3:.2f} ms]"))

        CopyLane._run_batch = run_batch

        try:
            from tieredkv.disk.slab import SlabFile

            original_read = SlabFile.read_slot_into

            def read_slot_into(self, *args, **kwargs):
                start = time.perf_counter()
                result = original_read(self, *args, **kwargs)
                trace.events.append((start, "slab_read", f"[{(time.perf_counter() - start) * 1e3:.2f} ms]"))
                return result

            SlabFile.read_slot_into = read_slot_into
        except (ImportError, AttributeError):
            pass

    @staticmethod
    def _idle(what: str, detail: str) -> bool:
        """A polling call that changed nothing (the engine steps while a load/promotion runs)."""
        text = detail.split(" [")[0]
        return (
            (what == "get_num_new_matched_tokens" and "-> (None" in text)
            or (what == "build_connector_meta" and text == "loads=0 promotes=0 stores=0 spills=0")
            or (what in ("start_load_kv", "get_transfer_results", "update_connector_output") and not text)
        )

    def take(self, t0: float) -> list[str]:
        """The timeline since ``t0``, runs of idle polling calls folded into one line."""
        events, self.events = self.events, []
        events.sort()
        lines: list[str] = []
        idle: list[tuple[float, str, str]] = []

        def flush() -> None:
            if len(idle) > 3:
                lines.append(f"{(idle[0][0] - t0) * 1e3:9.2f} ms  .. {len(idle)} idle connector calls "
                             f"(engine steps polling) until {(idle[-1][0] - t0) * 1e3:.2f} ms")
            else:
                lines.extend(f"{(t - t0) * 1e3:9.2f} ms  {w} {d}".rstrip() for t, w, d in idle)
            idle.clear()

        for t, what, detail in events:
            if self._idle(what, detail):
                idle.append((t, what, detail))
                continue
            flush()
            lines.append(f"{(t - t0) * 1e3:9.2f} ms  {what} {detail}".rstrip())
        flush()
        return lines


def _drop_page_cache(directory: Path) -> None:
    """fsync + POSIX_FADV_DONTNEED every file under ``directory``: the next read hits the disk."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class _StepClock:
    """Where a request's TTFT went: model forward passes (the same compute in every
    configuration) against everything else (connector loads, polling steps, scheduling).

    Wraps the in-process executor's ``execute_model``/``sample_tokens`` and, for a connector
    that loads synchronously inside the forward (ExampleConnector; LMCacheMPConnector, whose
    engine-driven transfer on CPU fetches from the server and scatters into the paged KV
    inside ``start_load_kv``; tieredkv's synchronous loads on CPU, ``sync_loads``), its
    ``start_load_kv``, so that load is not counted as compute. Only a ``start_load_kv`` inside
    a step with tokens is taken out of compute (one in an empty step never counted there).
    """

    def __init__(self, llm, connector: str | None) -> None:
        self.forwards: list[tuple[float, float]] = []
        self.sync_loads: list[tuple[float, float]] = []
        self._last_had_tokens = False
        executor = _engine_core(llm).model_executor
        execute, sample = executor.execute_model, executor.sample_tokens

        def execute_model(scheduler_output, *args, **kwargs):
            start = time.perf_counter()
            out = execute(scheduler_output, *args, **kwargs)
            self._last_had_tokens = scheduler_output.total_num_scheduled_tokens > 0
            if self._last_had_tokens:
                self.forwards.append((start, time.perf_counter()))
            return out

        def sample_tokens(*args, **kwargs):
            start = time.perf_counter()
            out = sample(*args, **kwargs)
            if self._last_had_tokens:
                self.forwards.append((start, time.perf_counter()))
            return out

        executor.execute_model = execute_model
        executor.sample_tokens = sample_tokens
        cls: Any = None
        if connector == "ExampleConnector":
            from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
                ExampleConnector as cls,
            )
        elif connector == "TieredKVConnector":
            from tieredkv.connector import TieredKVConnector as cls
        elif connector == "LMCacheMPConnector":  # only in the peer venv's child
            from lmcache.integration.vllm.lmcache_mp_connector import (  # type: ignore[import-not-found]
                LMCacheMPConnector as cls,
            )
        if cls is not None:
            load = cls.start_load_kv

            def start_load_kv(conn, *args, **kwargs):
                start = time.perf_counter()
                try:
                    return load(conn, *args, **kwargs)
                finally:
                    self.sync_loads.append((start, time.perf_counter()))

            cls.start_load_kv = start_load_kv

    def clear(self) -> None:
        self.forwards.clear()
        self.sync_loads.clear()

    def breakdown(self, t0: float) -> dict[str, float | None]:
        sync = sum(end - start for start, end in self.sync_loads
                   if any(f0 <= start and end <= f1 for f0, f1 in self.forwards))
        forward = sum(end - start for start, end in self.forwards) - sync
        first = min((start for start, _ in self.forwards), default=None)
        return {
            "forward_s": forward,  # model compute of this request's steps
            "connector_sync_load_s": sync,  # a synchronous load inside the forward
            "until_first_forward_s": None if first is None else first - t0,
        }


def child_main(spec_path: str) -> None:
    """One engine, driven by the parent: one JSON line of phases in on stdin, one ``DONE=``
    line of records out, until ``{"exit": true}``. vLLM's own stdout goes to the log."""
    with open(spec_path) as handle:
        spec = json.load(handle)
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM logs to stdout: into the log file with stderr

    def send(kind: str, payload: dict[str, Any]) -> None:
        proto.write(f"{kind}={json.dumps(payload)}\n")
        proto.flush()

    trace = _Trace() if spec.get("trace") and spec.get("kv_transfer_config", {}).get(
        "kv_connector") == "TieredKVConnector" else None
    if trace is not None:
        trace.install()
    if spec.get("switch_interval"):
        sys.setswitchinterval(spec["switch_interval"])  # diagnostic only (--switch-interval)
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    kwargs: dict[str, Any] = dict(
        model=spec["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=spec["max_model_len"],
        block_size=BLOCK_SIZE,
        enable_prefix_caching=spec["prefix_caching"],
        kv_cache_memory_bytes=spec["kv_cache_memory_bytes"],
        seed=0,
    )
    if spec.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    kwargs.update(spec.get("llm_kwargs") or {})  # the LMCache row: disable_hybrid_kv_cache_manager
    llm = LLM(**kwargs)
    import torch

    send("READY", {
        "startup_s": time.perf_counter() - started,
        "threads": {"torch_threads": torch.get_num_threads(),
                    "affinity": sorted(os.sched_getaffinity(0)),
                    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")},
    })
    steps = _StepClock(llm, spec.get("kv_transfer_config", {}).get("kv_connector"))
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompts: dict[str, list[int]] = spec["prompts"]

    def counters() -> dict[str, Any]:
        half = _scheduler_half(llm)
        return flat_counts(half.planner.counters.snapshot()) if half is not None else {}

    def run(phase: dict[str, Any]) -> dict[str, Any] | None:
        kind = phase["kind"]
        if kind == "reset_prefix":
            _step_until_idle(llm)
            if not llm.reset_prefix_cache():
                raise RuntimeError("reset_prefix_cache() returned False (blocks still held)")
            return None
        if kind == "drop_page_cache":
            _drop_page_cache(Path(phase["path"]))
            return None
        if kind == "drain":
            if not _step_until_idle(llm, phase.get("timeout_s", 60.0)):
                raise RuntimeError("tieredkv did not finish its pending jobs (or its writes to "
                                   "Redis) in time")
            return None
        if kind == "counters":  # tieredkv's counters since start (e.g. remote_written_chunks)
            return {"label": phase["label"], "counters": counters()}
        assert kind == "generate", kind
        name = phase["prompt"]
        before = counters()
        steps.clear()
        t0 = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": prompts[name]}], sampling, use_tqdm=False)
        seconds = time.perf_counter() - t0
        clock = steps.breakdown(t0)
        after = counters()
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        record = {
            "label": phase["label"],
            "prompt": name,
            "seconds": seconds,
            "at": time.time(),
            "num_cached_tokens": outputs[0].num_cached_tokens,
            "first_token": list(outputs[0].outputs[0].token_ids)[:1],
            "tieredkv": {k: v for k, v in delta.items() if v},
            **clock,
        }
        if trace is not None:
            record["trace"] = trace.take(t0)
        send("PROGRESS", {"label": phase["label"], "seconds": seconds})
        return record

    for line in sys.stdin:
        message = json.loads(line)
        if message.get("exit"):
            break
        records = [r for r in (run(phase) for phase in message["phases"]) if r is not None]
        send("DONE", {"records": records})
    _step_until_idle(llm)
    _engine_core(llm).shutdown()  # flushes tieredkv's journal and closes its files (restart row needs it)
    send("BYE", {})
    os._exit(0)  # skip the slow interpreter teardown of the engine
