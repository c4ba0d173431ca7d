"""Where a CUDA copy's time goes: the torch backend's phases beside alternatives (diagnostic).

``transfer_bench`` says how far each backend is from one contiguous copy; this says why. For a
few (chunk, batch) shapes of the same LBHNC cache ``transfer_bench`` uses, it times, on one
stream with CUDA events, interleaved round by round (medians):

- ``contig``: one contiguous pinned copy of the batch's bytes (the ceiling);
- ``torch``: the torch backend's whole call with ``mapped=True`` (the default: slots through the
  pool's device mapping), and its ``issue``: the host time until the call returns (Python and
  launch overhead, before the GPU is waited for); ``torch/dma``: ``mapped=False``, one DMA call
  per slot;
- ``gather``: the torch backend's device-side gather into a slot-shaped staging buffer alone;
- ``dma/slot``: one async copy per slot, staging to pinned slots, alone;
- ``uva put``: staging to the slots by one index kernel writing the pinned pool through its
  device mapping (no DMA call per slot); ``uva gather``: the reverse, reading it;
- ``cupy``: the cupy backend's whole call (one UVA kernel, no staging).

It judges nothing: it is the evidence for choosing how the backends should move bytes.

    python -m benchmarks.copy_breakdown --json out.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.transfer_bench import Setup, device_name
from tieredkv.transfer.backends.cupy_backend import CupyCopyBackend
from tieredkv.transfer.backends.torch_backend import TorchCopyBackend

KiB, MiB = 1024, 1024 * 1024
SHAPES = [(64 * KiB, 1), (64 * KiB, 64), (64 * KiB, 512), (1 * MiB, 8), (1 * MiB, 64),
          (4 * MiB, 8), (4 * MiB, 64)]


def uva_view(buffer: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A CUDA tensor over the pinned pool's memory (its device mapping), or None."""
    try:
        import cupy
    except ImportError:
        return None
    ptr, n = buffer.data_ptr(), buffer.numel()
    mem = cupy.cuda.UnownedMemory(ptr, n, buffer, device.index or 0)
    arr = cupy.ndarray((n,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
    return torch.as_tensor(arr, device=device)


def shape_methods(setup: Setup, batch: int, rng: random.Random) -> dict[str, Callable[[], None]]:
    device, kv, host = setup.device, setup.kv, setup.host
    C = setup.chunk_blocks
    payload = kv.slot_payload_bytes(C)
    ids = rng.sample(range(setup.num_blocks), batch * C)
    slots = rng.sample(range(host.num_slots), batch)
    pairs = [(s, 0, tuple(ids[i * C : (i + 1) * C])) for i, s in enumerate(slots)]
    torch_backend = TorchCopyBackend(staging_bytes=max(64 * MiB, batch * payload), mapped=True)
    dma_backend = TorchCopyBackend(staging_bytes=max(64 * MiB, batch * payload), mapped=False)
    reg = torch_backend.registered(kv, host)
    L, w = kv.num_layers, reg.width
    staging = torch.empty(batch * payload, dtype=torch.uint8, device=device)
    st = staging.view(reg.dtype).view(batch, L, C, -1)
    blocks = torch.tensor(ids, device=device).view(batch, 1, C)
    layers = torch.arange(L, device=device).view(1, L, 1)
    slots_dev = torch.tensor(slots, device=device)
    nbytes = batch * payload
    contig_src, contig_dst = setup.contig_src[:nbytes], setup.contig_dst[:nbytes]

    def gather() -> None:
        st.copy_(reg.stacked[layers, blocks])

    def scatter() -> None:
        reg.stacked[layers, blocks] = st

    def dma_down() -> None:
        for k, s in enumerate(slots):
            host.slot(s).copy_(staging[k * payload : (k + 1) * payload], non_blocking=True)

    def dma_up() -> None:
        for k, s in enumerate(slots):
            staging[k * payload : (k + 1) * payload].copy_(host.slot(s), non_blocking=True)

    methods: dict[str, Callable[[], None]] = {
        "contig d2h": lambda: contig_dst.copy_(contig_src, non_blocking=True),
        "contig h2d": lambda: contig_src.copy_(contig_dst, non_blocking=True),
        "torch d2h": lambda: torch_backend.d2h(kv, host, pairs),
        "torch h2d": lambda: torch_backend.h2d(kv, host, pairs),
        "torch/dma d2h": lambda: dma_backend.d2h(kv, host, pairs),
        "torch/dma h2d": lambda: dma_backend.h2d(kv, host, pairs),
        "gather d2h": gather,
        "gather h2d": scatter,
        "dma/slot d2h": dma_down,
        "dma/slot h2d": dma_up,
    }
    mapped = uva_view(host.buffer, device)
    if mapped is not None:
        pool = mapped.as_strided((host.num_slots, payload // w * w), (host.slot_bytes, 1)).view(reg.dtype)
        rows = staging.view(reg.dtype).view(batch, -1)
        methods["uva put d2h"] = lambda: pool.index_copy_(0, slots_dev, rows)
        methods["uva gather h2d"] = lambda: torch.index_select(pool, 0, slots_dev, out=rows)
    if CupyCopyBackend.available(device, host)[0]:
        cupy_backend = CupyCopyBackend(device)
        methods["cupy d2h"] = lambda: cupy_backend.d2h(kv, host, pairs)
        methods["cupy h2d"] = lambda: cupy_backend.h2d(kv, host, pairs)
    return methods


def measure(methods: dict[str, Callable[[], None]], device: torch.device, rounds: int,
            rng: random.Random) -> dict[str, dict[str, float]]:
    stream = torch.cuda.Stream(device)
    gpu: dict[str, list[float]] = {n: [] for n in methods}
    issue: dict[str, list[float]] = {n: [] for n in methods}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    order = list(methods)
    for r in range(rounds + 1):  # round 0 warms every method up
        rng.shuffle(order)
        for name in order:
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            with torch.cuda.stream(stream):
                start.record(stream)
                methods[name]()
                end.record(stream)
            t1 = time.perf_counter()
            end.synchronize()
            wall = time.perf_counter() - t0
            if r:
                gpu[name].append(max(start.elapsed_time(end) / 1e3, 1e-9))
                issue[name].append(t1 - t0)
                gpu[name][-1] = max(gpu[name][-1], wall)  # a call slower to issue than to run
    return {n: {"seconds": statistics.median(gpu[n]), "issue_seconds": statistics.median(issue[n])}
            for n in methods}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--row-bytes", type=int, default=16 * KiB)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("copy_breakdown needs CUDA", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    rng = random.Random(0)
    print(f"device: {device_name(device)}; torch {torch.__version__}; {args.layers} layers, rows of "
          f"{args.row_bytes // KiB} KiB; medians of {args.rounds} interleaved rounds; GB/s "
          "(time = max(GPU events, host wall) per call; issue = host time to return)")
    out = []
    for chunk, batch in SHAPES:
        C = max(1, chunk // (args.layers * args.row_bytes))
        setup = Setup(device, chunk, args.layers, C, batch)
        methods = shape_methods(setup, batch, rng)
        res = measure(methods, device, args.rounds, rng)
        same = None
        if "uva put d2h" in methods:  # the mapped path must write what the DMA path writes
            methods["gather d2h"]()
            methods["dma/slot d2h"]()
            torch.cuda.synchronize(device)
            want = setup.host.buffer.clone()
            setup.host.buffer.zero_()
            methods["uva put d2h"]()
            torch.cuda.synchronize(device)
            same = torch.equal(want, setup.host.buffer)
            res["uva put d2h"]["bytes_equal_dma"] = same
        nbytes = batch * setup.kv.slot_payload_bytes(C)
        line = {"chunk": chunk, "batch": batch, "bytes": nbytes, "methods": res}
        out.append(line)
        cells = "  ".join(f"{n} {nbytes / v['seconds'] / 1e9:.1f} (issue {v['issue_seconds'] * 1e6:.0f} us)"
                          for n, v in res.items())
        print(f"{chunk // KiB:>5} KiB x {batch:>3}: {cells}; uva bytes equal: {same}", flush=True)
        del setup
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps({"device": device_name(device), "shapes": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
