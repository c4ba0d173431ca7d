"""The soak's run: the servers started, every prompt's float32 reference taken from the
server without a connector, then the load (clients choosing prompts by Zipf weights, a sampler
reading the server and its disk tier, an injector corrupting journaled slots) until the
duration ends or the engine stops answering.

With a *control* server (vLLM without a connector, its own prefix cache on: how users run it
without tieredkv) every prompt a tieredkv client sends is sent to the control too, by a paired
client, as it is sent (the same requests in the same order, never more: the control, whose
hits stay in device memory, would otherwise serve several times as many), and the sampler
reads its memory in the same tick: the server's growth that is vLLM's own, under
the same load on the same machine, is then told apart from tieredkv's."""

from __future__ import annotations

import itertools
import queue
import random
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.endurance.probes import (
    disk_usage,
    flip_payload_bytes,
    health,
    idle_state,
    journaled_slots,
    read_manifest,
    scrape,
    tree_usage,
)
from benchmarks.endurance.workload import ZipfChooser, first_difference
from benchmarks.serve.client import stream_completion
from benchmarks.serve.judging import metric_sum
from benchmarks.serve.servers import start_servers
from tieredkv.disk.format import journal_path, slab_path
from tieredkv.tools.vllm_server import Server


@dataclass
class Run:
    """What the run saw: the sampled series, every request, the slots corrupted, the failures
    (each a sentence), when the load started and ended, the idle state and the last /metrics,
    the disk tier's manifest."""

    samples: list[dict[str, Any]] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    control_records: list[dict[str, Any]] = field(default_factory=list)
    #: A control server was started (its RSS is the RSS rule's baseline) / it stopped answering.
    with_control: bool = False
    control_lost: bool = False
    faults: list[dict[str, Any]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    load_start: float = 0.0
    load_end: float = 0.0
    idle: dict[str, Any] = field(default_factory=dict)
    final_metrics: str = ""
    manifest: dict[str, Any] = field(default_factory=dict)


def run_soak(reference: Server, server: Server, prompts: Sequence[list[int]], p: Mapping[str, Any], *,
             seed: int, faults_on: bool, disk_path: Path, chunk_bytes: int, progress: Any,
             control: Server | None = None, cpu_envs: Mapping[str, Mapping[str, str]] | None = None) -> Run:
    """Start the servers, take the references, run the load; every server stopped at the end.
    Any failure to set up is a failure of the run (``soak aborted: ...``), not an exception.
    ``cpu_envs``: extra environment per server name (``reference``, ``tieredkv``, ``control``),
    to bind each server's worker to its own cores."""
    run = Run()
    samples, records, faults, failures = run.samples, run.records, run.faults, run.failures
    control_records = run.control_records
    run.with_control = control is not None
    refs: list[list[int]] = []
    stop = threading.Event()
    lock = threading.Lock()
    run.load_start = run.load_end = time.monotonic()
    # (prompt, when the tieredkv client sent it): the control's lag is measured from then. One
    # slot per client: a tieredkv client waits before its next request until the control has
    # taken the last one, so neither server runs ahead of the other by more than a request.
    pairs: list[queue.Queue[tuple[int, float]]] = (
        [queue.Queue(maxsize=1) for _ in range(p["clients"])] if control else [])
    try:
        started = [("reference", reference), ("tieredkv", server)] + ([("control", control)] if control else [])
        envs = [(cpu_envs or {}).get(name) for name, _ in started]
        errs = start_servers([srv for _, srv in started], True, progress, envs=envs)
        for (name, srv), err in zip(started, errs, strict=True):
            if err:
                raise RuntimeError(f"{name} server did not start: {err}; log {srv.log_path}")
        progress.advance(1, "reference outputs")
        for i, prompt in enumerate(prompts):
            _, out = stream_completion(reference.url, prompt, p["max_tokens"], p["request_timeout_s"])
            refs.append(out)
            progress.advance(1, f"reference {i + 1}/{len(prompts)}")
        reference.stop()
        manifest = run.manifest = read_manifest(disk_path)

        load_start = run.load_start = time.monotonic()
        deadline = load_start + p["duration_s"]

        def hand_over(slot: queue.Queue[tuple[int, float]], k: int) -> bool:
            """Put prompt ``k`` in a control client's one slot, waiting while the control still
            has the last one; False once the run is stopping. The time stamped is when the slot
            took it (to within the 5 ms poll), so the control's lag excludes this wait."""
            while not stop.is_set() and time.monotonic() < deadline:
                try:
                    slot.put_nowait((k, time.monotonic()))
                    return True
                except queue.Full:
                    time.sleep(0.005)
            return False

        def client(idx: int) -> None:
            choose = ZipfChooser(len(prompts), p["zipf_s"], f"{seed}:client{idx}")
            for n in itertools.count():
                if stop.is_set() or time.monotonic() >= deadline or n > 100_000:
                    return
                k = choose()
                if pairs and not hand_over(pairs[idx], k):
                    return
                rec: dict[str, Any] = {"t": time.monotonic() - load_start, "prompt": k, "client": idx}
                try:
                    ttft, out = stream_completion(server.url, prompts[k], p["max_tokens"], p["request_timeout_s"])
                except (OSError, RuntimeError, ValueError, urllib.error.URLError) as exc:
                    rec.update(ok=False, error=f"{type(exc).__name__}: {exc}")
                    with lock:
                        records.append(rec)
                        failures.append(f"engine stopped answering: request for prompt {k} at "
                                        f"t={rec['t']:.0f}s failed: {rec['error']}")
                    stop.set()
                    return
                diff = first_difference(refs[k], out)
                rec.update(ok=True, ttft_s=ttft, mismatch=diff is not None)
                if diff is not None:
                    rec.update(first_diff=diff, want=refs[k], got=out)
                with lock:
                    records.append(rec)
                    if diff is not None:
                        failures.append(f"wrong output for prompt {k} at t={rec['t']:.0f}s: first "
                                        f"difference at token {diff} (want {refs[k][diff:diff + 4]}, "
                                        f"got {out[diff:diff + 4]})")
                        if sum(r.get("mismatch", False) for r in records) >= 20:
                            stop.set()

        def control_client(idx: int) -> None:
            """Tieredkv client ``idx``'s prompts, each as it is sent, against the control; its
            outputs are compared too (information: a difference there is vLLM's, not tieredkv's)."""
            assert control is not None
            while not stop.is_set() and time.monotonic() < deadline:
                try:
                    k, sent = pairs[idx].get(timeout=0.5)
                except queue.Empty:
                    continue
                now = time.monotonic()
                rec: dict[str, Any] = {"t": now - load_start, "prompt": k, "client": idx, "lag_s": now - sent}
                try:
                    ttft, out = stream_completion(control.url, prompts[k], p["max_tokens"], p["request_timeout_s"])
                    rec.update(ok=True, ttft_s=ttft, mismatch=first_difference(refs[k], out) is not None)
                except Exception as exc:  # noqa: BLE001 - any failure ends the run, never a silent thread death
                    # (a dead pair would leave its tieredkv client waiting, and the share check
                    # would then compare two idle servers)
                    rec.update(ok=False, error=f"{type(exc).__name__}: {exc}")
                with lock:
                    control_records.append(rec)
                if not rec["ok"]:
                    # The RSS baseline is gone: the run ends here rather than judge a control
                    # that carries less load than the server it is the baseline of.
                    with lock:
                        run.control_lost = True
                        failures.append(f"control server stopped answering: request for prompt {k} at "
                                        f"t={rec['t']:.0f}s failed: {rec['error']}")
                    stop.set()
                    return

        control_procs: dict[str, int] = {}

        def sampler() -> None:
            bad_health = 0
            while not stop.is_set():
                now = time.monotonic()
                if now >= deadline:
                    return
                sample: dict[str, Any] = {"t": now - load_start, **tree_usage(server.proc.pid)}
                if control is not None and control.proc is not None and control.proc.poll() is None:
                    ctl = tree_usage(control.proc.pid)
                    control_procs.setdefault("n", ctl["processes"])
                    # A process that vanished mid-read would show as a step in the excess: skip.
                    if ctl["processes"] == control_procs["n"]:
                        sample.update(control_rss_bytes=ctl["rss_bytes"],
                                      control_rss_by_process=ctl["rss_by_process"])
                        sample["rss_excess_bytes"] = sample["rss_bytes"] - ctl["rss_bytes"]
                text = scrape(server.url)
                if text is not None:
                    sample["host_slots_used"] = metric_sum(text, "vllm:tieredkv_used_bytes", {"tier": "host"}) / chunk_bytes
                    sample["disk_slots_used"] = metric_sum(text, "vllm:tieredkv_used_bytes", {"tier": "disk"}) / chunk_bytes
                    sample["pinned_host_slots"] = metric_sum(text, "vllm:tieredkv_pinned_host_slots")
                    sample["requests_waiting_on_load"] = metric_sum(text, "vllm:tieredkv_requests_waiting_on_load")
                    sample["checksum_failures"] = metric_sum(text, "vllm:tieredkv_load_failures_total", {"cause": "checksum"})
                    sample["hit_tokens_disk"] = metric_sum(text, "vllm:tieredkv_hit_tokens_total", {"tier": "disk"})
                try:
                    sample["journal_entries"] = len(journaled_slots(disk_path))
                    sample["journal_bytes"] = journal_path(disk_path).stat().st_size
                except OSError:
                    pass
                sample["disk_usage_bytes"] = disk_usage(disk_path)
                sample["healthy"] = health(server.url)
                bad_health = 0 if sample["healthy"] else bad_health + 1
                with lock:
                    samples.append(sample)
                    if bad_health >= 2:
                        failures.append(f"engine stopped answering: /health failed twice in a row at t={sample['t']:.0f}s")
                        stop.set()
                        return
                    if server.proc.poll() is not None:
                        failures.append(f"server process exited with {server.proc.returncode} at t={sample['t']:.0f}s")
                        stop.set()
                        return
                stop.wait(max(0.0, p["sample_every_s"] - (time.monotonic() - now)))

        def injector() -> None:
            rnd = random.Random(f"{seed}:faults")
            slab = slab_path(disk_path, 0)
            stride_m, payload_m = manifest["slot_stride"], manifest["payload_bytes"]
            while not stop.wait(p["fault_every_s"]):
                if time.monotonic() >= deadline:
                    return
                slots = sorted(set(journaled_slots(disk_path).values()))
                for slot in rnd.sample(slots, min(p["fault_slots"], len(slots))):
                    offsets = flip_payload_bytes(slab, slot, stride_m, payload_m, p["fault_bytes"], rnd)
                    with lock:
                        faults.append({"t": time.monotonic() - load_start, "slot": slot, "bytes": len(offsets)})

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(p["clients"])]
        if control is not None:
            threads += [threading.Thread(target=control_client, args=(i,), daemon=True) for i in range(p["clients"])]
        threads.append(threading.Thread(target=sampler, daemon=True))
        if faults_on:
            threads.append(threading.Thread(target=injector, daemon=True))
        for thread in threads:
            thread.start()
        ticked = 0
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline + p["request_timeout_s"] + 30:
            elapsed = int(min(p["duration_s"], time.monotonic() - load_start))
            with lock:
                n_req, n_bad = len(records), sum(1 for r in records if r.get("mismatch") or not r.get("ok"))
            progress.advance(elapsed - ticked, f"load: {n_req} requests, {n_bad} bad, {len(faults)} faults")
            ticked = elapsed
            if stop.is_set():
                break
            time.sleep(1.0)
        stop.set()
        for thread in threads:
            thread.join(p["request_timeout_s"] + 5)
        run.load_end = time.monotonic()
        if server.proc.poll() is None and not any(f.startswith(("engine", "server")) for f in failures):
            run.idle = idle_state(server.url, chunk_bytes, p["request_timeout_s"])
        run.final_metrics = scrape(server.url) or ""
    except Exception as exc:  # noqa: BLE001 - any set-up failure is a FAIL with its message
        failures.append(f"soak aborted: {type(exc).__name__}: {exc}")
    finally:
        stop.set()
        reference.stop()
        server.stop()
        if control is not None:
            control.stop()
        progress.close()

    return run
