"""Should the torch copier's mapped path stay the CUDA default? One GPU run answers three things.

``TorchCopyBackend()`` (``mapped=True``, the default since 1665926) moves whole slots with one
index kernel through the pinned pool's device mapping; ``mapped=False`` makes one DMA call per
slot. On an H100 (2026-11-26) a load through the mapped path once waited for a busy store
lane, which is why it was opt-in until this probe found no such wait on an H100 and an H200
(``benchmarks/results/gpu/``). This probe, on a GPU:

1. ordering: the busy-lane scenario of ``tests/transfer/test_cuda.py``, repeated with fresh
   lanes (new streams each time), for the DMA path and the mapped path: how long the load
   took while the store lane was held, and whether it had to wait for that lane;
2. hidden syncs: both directions of the mapped path under ``torch.cuda.set_sync_debug_mode``
   ("error"), which raises on any operation that synchronises with the device;
3. speed and host time: the transfer benchmark's quick shapes (``benchmarks.transfer_bench``'s
   own setup and timing) with ``torch`` (mapped), ``torch-dma`` and ``cupy`` side by side, and
   the host time each call takes to return (its launch cost), judged against the benchmark's
   targets.

    python -m benchmarks.mapped_probe --out DIR     # writes mapped_probe.json, prints a log
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.transfer_bench import QUICK_CHUNKS, Setup, run_config, target_for
from tieredkv.transfer.backends.cupy_backend import CupyCopyBackend
from tieredkv.transfer.backends.torch_backend import TorchCopyBackend
from tieredkv.transfer.host_pool import HostPool
from tieredkv.transfer.kv_views import KVViews
from tieredkv.transfer.lanes import CopyLane

KiB, MiB = 1024, 1024 * 1024
BATCHES = [1, 8, 64, 512]
HOLD_CYCLES = 2_000_000_000  # about a second of spinning at H100/H200 clocks
C = 4


def _caches(device: torch.device, num_blocks: int = 64) -> KVViews:
    raw = torch.randint(0, 255, (4 * num_blocks * 2048,), dtype=torch.uint8, device=device)
    layers = {
        f"l{i}": raw[i * num_blocks * 2048 : (i + 1) * num_blocks * 2048].view(num_blocks, 2, 16, 64)
        for i in range(4)
    }
    return KVViews.from_kv_caches(layers, num_blocks)


def busy_load(device: torch.device, mapped: bool, rep: int) -> dict:
    """One busy-lane scenario with fresh lanes and streams: a load while a store is held."""
    kv = _caches(device)
    host = HostPool(4, kv.slot_payload_bytes(C))
    backend = TorchCopyBackend(mapped=mapped)
    d2h, h2d = CopyLane("d2h", device, None), CopyLane("h2d", device, None)
    try:
        # once unheld, with the measured shapes: kernels loaded, staging and index buffers sized
        d2h.call(d2h.run, lambda: backend.d2h(kv, host, [(2, 0, (5, 6, 7, 8))])).result(60)
        h2d.call(h2d.run, lambda: backend.h2d(kv, host, [(3, 0, (44, 45, 46, 47))])).result(60)
        torch.cuda.synchronize(device)

        def held_store() -> None:
            torch.cuda._sleep(HOLD_CYCLES)
            backend.d2h(kv, host, [(0, 0, (1, 2, 3, 4))])

        held = d2h.call(d2h.run, held_store)
        start = time.perf_counter()
        loaded = h2d.call(h2d.run, lambda: backend.h2d(kv, host, [(1, 0, (40, 41, 42, 43))]))
        loaded.result(60)
        load_ms = (time.perf_counter() - start) * 1e3
        waited = held.done()
        held.result(60)
        store_ms = (time.perf_counter() - start) * 1e3
        return {"rep": rep, "load_ms": round(load_ms, 2), "store_ms": round(store_ms, 2),
                "load_waited_for_store": waited,
                "streams": [d2h.stream.stream_id, h2d.stream.stream_id]}
    finally:
        d2h.stop(1.0)
        h2d.stop(1.0)


def ordering(device: torch.device, mapped: bool, reps: int) -> list[dict]:
    """The busy-lane scenario ``reps`` times, each with fresh lanes and streams."""
    return [busy_load(device, mapped, rep) for rep in range(reps)]


def hidden_syncs(device: torch.device) -> dict:
    """Each mapped direction under sync-debug 'error': None, or what synchronised."""
    kv = _caches(device)
    host = HostPool(8, kv.slot_payload_bytes(C))
    backend = TorchCopyBackend(mapped=True)
    lane = CopyLane("probe", device, None)
    calls = {
        "d2h whole chunks": lambda: backend.d2h(kv, host, [(0, 0, (1, 2, 3, 4)), (1, 0, (9, 8, 7, 6))]),
        "d2h with a partial chunk": lambda: backend.d2h(kv, host, [(2, 0, (1, 2, 3, 4)), (3, 1, (5, 6))]),
        "h2d": lambda: backend.h2d(kv, host, [(0, 0, (20, 21, 22, 23)), (1, 0, (30, 31, 32, 33))]),
    }
    found = {}
    try:
        for name, fn in calls.items():
            lane.call(lane.run, fn).result(60)  # once unguarded: allocations, plans, kernels

            def guarded(fn=fn) -> None:
                torch.cuda.set_sync_debug_mode("error")
                try:
                    fn()
                finally:
                    torch.cuda.set_sync_debug_mode("default")

            try:
                lane.call(lane.run, guarded).result(60)
                found[name] = None
            except RuntimeError as exc:
                found[name] = str(exc).splitlines()[0][:300]
    finally:
        lane.stop(1.0)
    return found


def host_time(setup: Setup, backend, batch: int, rng: random.Random, rounds: int = 9) -> dict:
    """Median host time for a call to return (its launch cost), each direction."""
    ids = rng.sample(range(setup.num_blocks), batch * setup.chunk_blocks)
    k = setup.chunk_blocks
    pairs = [(s, 0, tuple(ids[i * k : (i + 1) * k])) for i, s in enumerate(range(batch))]
    stream = torch.cuda.Stream(setup.device)
    out = {}
    for direction in ("d2h", "h2d"):
        fn = getattr(backend, direction)
        samples = []
        for _ in range(rounds + 1):
            torch.cuda.synchronize(setup.device)
            with torch.cuda.stream(stream):
                start = time.perf_counter()
                fn(setup.kv, setup.host, pairs)
                samples.append(time.perf_counter() - start)
            stream.synchronize()
        out[direction] = statistics.median(samples[1:]) * 1e6
    return out


def speed(device: torch.device, rounds: int) -> list[dict]:
    backends: dict[str, object] = {"torch": TorchCopyBackend(),
                                   "torch-dma": TorchCopyBackend(mapped=False)}
    if CupyCopyBackend.available(device)[0]:
        backends["cupy"] = CupyCopyBackend(device)
    rng = random.Random(0)
    rows = []
    for chunk in QUICK_CHUNKS:
        batches = [b for b in BATCHES if b * chunk <= 256 * MiB]
        chunk_blocks = max(1, chunk // (4 * 16 * KiB))
        setup = Setup(device, chunk, 4, chunk_blocks, max(batches))
        for batch in batches:
            res = run_config(setup, batch, backends, rounds, rng)
            sec = res["seconds"]
            launch = {b: host_time(setup, backends[b], batch, rng) for b in backends}
            for d in ("d2h", "h2d"):
                contig = res["bytes"] / sec[f"contig {d}"] / 1e9
                gbps = {b: res["bytes"] / sec[f"{b} {d}"] / 1e9 for b in [*backends, "vllm"]}
                rows.append({
                    "dir": d, "chunk": chunk, "batch": batch, "contig_gbps": round(contig, 2),
                    "gbps": {b: round(v, 2) for b, v in gbps.items()},
                    "ratio": {b: round(v / contig, 3) for b, v in gbps.items()},
                    "host_us": {b: round(launch[b][d], 1) for b in backends},
                    "target": target_for(device, chunk),
                })
        del setup
        torch.cuda.empty_cache()
    return rows


def report(result: dict) -> str:
    lines = [f"# mapped path probe: {result['device']} (torch {result['torch']})", ""]
    lines.append("## 1. a load while the store lane is held (~1 s of queued work)")
    for variant, reps in result["ordering"].items():
        waited = sum(r["load_waited_for_store"] for r in reps)
        loads = [r["load_ms"] for r in reps]
        lines.append(f"- {variant}: waited {waited} of {len(reps)} times; load ms min "
                     f"{min(loads):.2f} median {statistics.median(loads):.2f} max {max(loads):.2f}; "
                     f"store ms median {statistics.median(r['store_ms'] for r in reps):.1f}")
    lines += ["", "## 2. hidden syncs in the mapped path (sync-debug 'error')"]
    for name, what in result["syncs"].items():
        lines.append(f"- {name}: {'none' if what is None else what}")
    lines += ["", "## 3. speed (ratio to one contiguous copy) and host time per call (us)", ""]
    names = list(result["speed"][0]["host_us"]) if result["speed"] else []
    lines.append("| dir | chunk | batch | contig GB/s | " + " | ".join(
        f"{n} ratio (host us)" for n in names) + " | vllm ratio | target |")
    lines.append("|---" * (5 + len(names)) + "|---|")
    for r in result["speed"]:
        cells = " | ".join(f"{r['ratio'][n]:.2f} ({r['host_us'][n]:.0f})" for n in names)
        target = "-" if r["target"] is None else f">= {r['target']}"
        lines.append(f"| {r['dir']} | {r['chunk'] // KiB} KiB | {r['batch']} | {r['contig_gbps']} | "
                     f"{cells} | {r['ratio']['vllm']:.2f} | {target}, > vllm |")
    met = {n: sum(1 for r in result["speed"]
                  if r["ratio"][n] > r["ratio"]["vllm"]
                  and (r["target"] is None or r["ratio"][n] >= r["target"])) for n in names}
    lines += ["", "Targets met (rows): " + ", ".join(f"{n} {m}/{len(result['speed'])}"
                                                    for n, m in met.items())]
    result["targets_met"] = met
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("mapped_probe: needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0)
    warm_until = time.perf_counter() + 1.0  # clocks up before anything is timed
    a = torch.randn(4096, 4096, device=device)
    while time.perf_counter() < warm_until:
        a = torch.tanh(a @ a)
        torch.cuda.synchronize(device)
    result: dict = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__}
    result["ordering"] = {"torch-dma": ordering(device, False, args.reps),
                          "torch (mapped)": ordering(device, True, args.reps)}
    result["syncs"] = hidden_syncs(device)
    result["speed"] = speed(device, args.rounds)
    text = report(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mapped_probe.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "mapped_probe.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
