"""Disk-tier microbenchmark: tieredkv's slab path against raw I/O of the same bytes.

Spill = ``SlabFile.write_slot`` and restore = ``SlabFile.read_slot_into`` (header, checksum
and verification included), driven through ``SlabExecutor`` from asyncio with N I/Os in
flight, from and into host-tier slots. The baseline is raw pwrite/pread of the same I/O size,
flags, directory and source memory, at the same queue depth: ``depth`` threads each issuing one
I/O at a time from a shared cursor. Both sides run at depth 1 and at ``--inflight`` (tieredkv's
default), and each depth is compared with the same depth, so neither side gets more I/Os in
flight than the other. Also the host tier's slot copy (``HostPool.slot(i).copy_(src)``)
against a copy into a plain tensor.

The machine is shared and noisy, so raw and tieredkv runs alternate within one process and
each figure is the median of ``--repeats`` runs. O_DIRECT is used for both sides when the
filesystem allows it; otherwise both run buffered, the table says so, and the page cache is
dropped for both files (fsync + POSIX_FADV_DONTNEED) before every read pass.

    python -m benchmarks.disk_bench [--dir DIR] [--total-bytes 256MiB] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures as cf
import json
import os
import platform
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tieredkv.config import parse_size
from tieredkv.disk.format import align_up
from tieredkv.disk.private_files import FileIO
from tieredkv.disk.slab import SlabFile, probe_direct
from tieredkv.transfer.disk_jobs import SlabExecutor
from tieredkv.transfer.host_pool import HostPool

TARGET = 0.8
KiB, MiB = 1024, 1024 * 1024
DEFAULT_CHUNKS = "64KiB,256KiB,1MiB,4MiB"
INFO_ONLY = {64 * KiB}  # reported, not held to the target
FINGERPRINT = bytes(range(32))


@dataclass
class Row:
    what: str
    chunk_bytes: int
    tieredkv_gbs: float
    raw_gbs: float
    ratio: float
    target: float | None
    passed: bool | None
    samples_tieredkv: list[float]
    samples_raw: list[float]
    #: I/Os in flight on both sides (tieredkv: coroutines on the slab executor; raw: threads);
    #: None for the host copy, which is one memcpy at a time on both sides.
    depth: int | None = None


def _fs_type(path: Path) -> str:
    """The filesystem type holding ``path`` (longest mount-point prefix in /proc/mounts)."""
    best, fstype = "", "unknown"
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                parts = line.split()
                mount = parts[1].replace("\\040", " ")
                resolved = str(path.resolve())
                if (resolved == mount or resolved.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
                    best, fstype = mount, parts[2]
    except OSError:
        pass
    return fstype


def _key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def _drop_cache(fd: int) -> None:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


class DiskCase:
    """One chunk size: a slab file and a raw file of the same payload bytes, same directory."""

    def __init__(self, directory: Path, chunk: int, total: int, inflight: int, io_threads: int,
                 direct: bool) -> None:
        self.chunk = chunk
        self.count = max(16, total // chunk)
        self.inflight = inflight
        self.direct = direct
        self.padded = align_up(chunk)
        pool_slots = min(self.count, max(2 * inflight, 16))
        self.pool = HostPool(pool_slots, chunk, pin=False)
        generator = torch.Generator().manual_seed(chunk)
        self.pool.buffer.copy_(torch.randint(0, 256, self.pool.buffer.shape, dtype=torch.uint8,
                                             generator=generator))
        self.views = [self.pool.slot_memoryview(i) for i in range(pool_slots)]
        self.keys = [_key(i) for i in range(self.count)]
        self.slab = SlabFile.open(directory / f"bench-{chunk}.slab", self.count, chunk,
                                  FINGERPRINT, direct=direct)
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
        self.raw_path = directory / f"bench-{chunk}.raw"
        self.io = FileIO()
        self.raw_fd = self.io.open(self.raw_path, flags)
        self.io.fallocate(self.raw_fd, self.count * self.padded)
        self.executor = SlabExecutor(io_threads)
        self.raw_pool = cf.ThreadPoolExecutor(max(1, inflight), thread_name_prefix="raw-io")
        self.loop = asyncio.new_event_loop()
        # Raw I/O moves exactly the chunk's padded bytes (what an O_DIRECT transfer must move).
        self.raw_views = [memoryview(v)[: self.padded] for v in self.views]

    def drop_cache(self) -> None:
        """Buffered mode only: make the next read pass come from the device, on both sides."""
        if self.direct:
            return
        self.slab.sync()
        for path in (self.slab.path, self.raw_path):
            fd = os.open(path, os.O_RDONLY)
            try:
                _drop_cache(fd)
            finally:
                os.close(fd)

    def raw(self, write: bool, first: int, count: int, depth: int = 1) -> float:
        """``depth`` threads, each one I/O at a time from a shared cursor (depth 1: a plain
        sequential loop in this thread): the plainest way to move these bytes that many at once."""
        io = os.pwritev if write else os.preadv
        fd, views, padded = self.raw_fd, self.raw_views, self.padded
        cursor = iter(range(first, first + count))  # next() on it is atomic under the GIL

        def worker() -> None:
            for i in cursor:
                view = views[i % len(views)]
                if io(fd, [view], i * padded) != padded:
                    raise RuntimeError("short raw I/O")

        if depth > self.inflight:
            raise ValueError(f"depth {depth} is above --inflight {self.inflight}")
        start = time.perf_counter()
        if depth <= 1:
            worker()
        else:
            for future in [self.raw_pool.submit(worker) for _ in range(depth)]:
                future.result()
        return time.perf_counter() - start

    def tieredkv(self, write: bool, first: int, count: int, depth: int | None = None) -> float:
        """``depth`` (default ``inflight``) coroutines pulling slots from a shared cursor
        through SlabExecutor."""
        depth = self.inflight if depth is None else depth
        executor, slab, views, keys = self.executor, self.slab, self.views, self.keys
        cursor = iter(range(first, first + count))

        async def worker() -> None:
            for i in cursor:
                view = views[i % len(views)]
                if write:
                    await executor.write(slab, i, keys[i], view)
                else:
                    await executor.read_into(slab, i, keys[i], view)

        async def drive() -> float:
            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(depth)))
            return time.perf_counter() - start

        return self.loop.run_until_complete(drive())

    def close(self) -> None:
        self.loop.close()
        self.executor.shutdown(5)
        self.raw_pool.shutdown(wait=True)
        self.slab.close()
        self.io.close(self.raw_fd)
        for path in (self.slab.path, self.raw_path):
            path.unlink(missing_ok=True)
        self.views.clear()
        self.raw_views.clear()
        self.pool.close()


def _row(what: str, chunk: int, tkv: list[float], raw: list[float], depth: int | None = None) -> Row:
    """A table row from throughput samples in bytes per second."""
    tkv_gbs = statistics.median(tkv) / 1e9
    raw_gbs = statistics.median(raw) / 1e9
    ratio = tkv_gbs / raw_gbs
    info = chunk in INFO_ONLY
    return Row(what, chunk, tkv_gbs, raw_gbs, ratio, None if info else TARGET,
               None if info else ratio >= TARGET,
               [round(x / 1e9, 3) for x in tkv], [round(x / 1e9, 3) for x in raw], depth)


def depths(inflight: int) -> list[int]:
    """The queue depths both sides run at: one at a time, and tieredkv's ``inflight``."""
    return sorted({1, max(1, inflight)})


def bench_disk(directory: Path, chunk: int, total: int, inflight: int, io_threads: int,
               repeats: int, direct: bool, block_bytes: int) -> list[Row]:
    """``repeats`` passes over the files, each cut into blocks that alternate raw/tieredkv,
    at every queue depth of :func:`depths` (both sides at the same depth).

    Alternating every block (not every pass) means a burst of load from other tenants of a
    shared machine lands on both sides alike; the median over all blocks is reported.
    """
    case = DiskCase(directory, chunk, total, inflight, io_threads, direct)
    try:
        case.raw(True, 0, case.count)  # warm-up: both files written once, threads started
        case.tieredkv(True, 0, case.count)
        per_block = max(2 * inflight, block_bytes // chunk)
        levels = depths(inflight)
        samples: dict[tuple[str, int], list[float]] = {
            (f"{side}_{op}", d): [] for side in ("raw", "tkv") for op in "wr" for d in levels}
        turn = 0
        for _ in range(repeats):
            for first in range(0, case.count, per_block):
                count = min(per_block, case.count - first)
                if count < per_block:
                    continue  # a short last block would skew the median
                for depth in levels:
                    sides = ("raw", "tkv") if turn % 2 == 0 else ("tkv", "raw")
                    turn += 1
                    for side in sides:
                        run = case.raw if side == "raw" else case.tieredkv
                        samples[(f"{side}_w", depth)].append(count * chunk / run(True, first, count, depth))
                    case.drop_cache()
                    for side in sides:
                        run = case.raw if side == "raw" else case.tieredkv
                        samples[(f"{side}_r", depth)].append(count * chunk / run(False, first, count, depth))
        rows = []
        for depth in levels:
            rows.append(_row("spill (write_slot)", chunk, samples[("tkv_w", depth)],
                             samples[("raw_w", depth)], depth))
            rows.append(_row("restore (read_slot_into)", chunk, samples[("tkv_r", depth)],
                             samples[("raw_r", depth)], depth))
        return rows
    finally:
        case.close()


def bench_host_copy(chunk: int, repeats: int, block_bytes: int = 32 * MiB) -> Row:
    """HostPool slot copy vs a plain contiguous tensor copy of the same bytes.

    Both sides copy one source tensor into a ring of destinations of equal size (so cache
    behaviour matches), alternating in blocks of ``block_bytes``: on a shared machine a load
    burst then hits both sides alike instead of one whole pass. Median over the blocks.
    """
    slots = max(2, min(64, (256 * MiB) // chunk))
    per_block = max(1, block_bytes // chunk)
    pool = HostPool(slots, chunk)
    plain = [torch.empty(chunk, dtype=torch.uint8) for _ in range(slots)]
    src = torch.randint(0, 256, (chunk,), dtype=torch.uint8)
    targets = [pool.slot(i) for i in range(slots)]
    position = {"tkv": 0, "raw": 0}

    def run(side: str) -> float:
        dst = targets if side == "tkv" else plain
        i = position[side]
        start = time.perf_counter()
        for j in range(i, i + per_block):
            dst[j % slots].copy_(src)
        position[side] = (i + per_block) % slots
        return time.perf_counter() - start

    for _ in range(max(1, slots // per_block) + 1):  # first touch of every page, on both sides
        run("tkv")
        run("raw")
    samples: dict[str, list[float]] = {"tkv": [], "raw": []}
    for rep in range(3 * repeats):
        for side in (("raw", "tkv") if rep % 2 == 0 else ("tkv", "raw")):
            samples[side].append(per_block * chunk / run(side))
    targets.clear()
    pool.close()
    return _row("host slot copy", chunk, samples["tkv"], samples["raw"])


def _size(n: int) -> str:
    return f"{n // MiB}MiB" if n >= MiB and n % MiB == 0 else f"{n // KiB}KiB"


def _print_table(rows: list[Row], header: str) -> None:
    print(header)
    print(f"{'what':<26}{'chunk':>8}{'depth':>6}{'tieredkv GB/s':>15}{'raw GB/s':>10}{'ratio':>8}{'target':>9}  result")
    for r in rows:
        chunk = _size(r.chunk_bytes)
        target = f">={r.target:.1f}" if r.target is not None else "info"
        result = "-" if r.passed is None else ("PASS" if r.passed else "FAIL")
        depth = "-" if r.depth is None else str(r.depth)
        print(f"{r.what:<26}{chunk:>8}{depth:>6}{r.tieredkv_gbs:>15.2f}{r.raw_gbs:>10.2f}{r.ratio:>8.2f}{target:>9}  {result}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=None,
                        help="where the test files go (default: a temp dir under the current directory)")
    parser.add_argument("--total-bytes", default="256MiB",
                        help="file span per chunk size (bytes of one pass)")
    parser.add_argument("--block-bytes", default="16MiB",
                        help="raw and tieredkv alternate every this many bytes")
    parser.add_argument("--chunk-sizes", default=DEFAULT_CHUNKS)
    parser.add_argument("--inflight", type=int, default=4,
                        help="I/Os in flight, on both sides (depth 1 is always run too)")
    parser.add_argument("--io-threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="passes over each file")
    parser.add_argument("--direct", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--copy-threads", type=int, default=1,
                        help="torch intra-op threads for the host copy (both sides alike)")
    parser.add_argument("--json", type=Path, default=None, help="write results here")
    args = parser.parse_args(argv)
    if args.inflight < 1 or args.io_threads < 1:
        parser.error("--inflight and --io-threads must be >= 1")

    total = parse_size("--total-bytes", args.total_bytes)
    block = parse_size("--block-bytes", args.block_bytes)
    torch.set_num_threads(args.copy_threads)
    chunks = [parse_size("--chunk-sizes", c) for c in args.chunk_sizes.split(",")]
    made_dir = args.dir is None
    directory = Path(args.dir) if args.dir else Path.cwd() / f".disk_bench.{os.getpid()}"
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    fstype = _fs_type(directory)
    if fstype in ("tmpfs", "ramfs"):
        print(f"warning: {directory} is on {fstype}: this measures memory, not a disk", file=sys.stderr)
    if args.direct == "auto":
        direct, why = probe_direct(directory, FileIO())
    else:
        direct, why = args.direct == "on", "forced by --direct"
    mode = "O_DIRECT" if direct else f"buffered ({why}; page cache dropped before reads)"
    header = (f"disk_bench: {directory} ({fstype}), {mode}; {_size(total)} x {args.repeats} "
              f"passes, raw/tieredkv alternating every {_size(block)}, median; each queue depth "
              f"{'/'.join(map(str, depths(args.inflight)))} compared with the same depth (tieredkv: that many "
              f"coroutines on {args.io_threads} I/O threads; raw: that many threads, one pwrite/pread each); "
              f"{os.cpu_count()} CPUs, torch {torch.__version__} with {args.copy_threads} copy "
              f"thread(s), host pool {'pinned' if torch.cuda.is_available() else 'pageable'}")
    rows: list[Row] = []
    started = time.perf_counter()
    try:
        for chunk in chunks:
            rows += bench_disk(directory, chunk, total, args.inflight, args.io_threads,
                               args.repeats, direct, block)
        for chunk in chunks:
            rows.append(bench_host_copy(chunk, args.repeats))
    finally:
        if made_dir:
            shutil.rmtree(directory, ignore_errors=True)
    _print_table(rows, header)
    print(f"({time.perf_counter() - started:.1f} s)")
    if args.json:
        args.json.write_text(json.dumps({
            "directory": str(directory), "filesystem": fstype, "direct": direct,
            "direct_note": why, "total_bytes": total, "block_bytes": block, "repeats": args.repeats,
            "inflight": args.inflight, "io_threads": args.io_threads,
            "depths": depths(args.inflight),
            "cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "host_pinned": torch.cuda.is_available(),
            "rows": [asdict(r) for r in rows],
        }, indent=2) + "\n")
    failed = [r for r in rows if r.passed is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
