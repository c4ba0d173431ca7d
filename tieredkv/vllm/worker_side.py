"""The connector's worker half: executes the step's jobs on the transfer engine and reports.

It decides nothing. It submits loads, promotions and spills as soon as the metadata arrives,
stores after the forward pass (``wait_for_save``), fences preempted blocks before the next
forward, and turns engine results into vLLM's completion sets and per-rank job outcomes.

Sleep mode: vLLM 0.32 tells no connector about sleep: ``Worker.sleep`` unmaps the KV cache
(and the weights) while a store may still be reading blocks or a load writing them, a fault on
CUDA. So, in each worker process that runs a worker half, the GPU worker class's ``sleep`` and
``wake_up`` are wrapped (once, :func:`install`): before the real ``sleep``, every live worker
half pauses its device copies (queued stores cancelled, running copies waited for, new stores
and loads refused); after the real ``wake_up``, they resume. Host and disk tiers are
untouched: what they hold is still valid after waking. The CPU build has no sleep mode (its
worker overrides ``sleep`` with a warning), so there nothing changes.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import weakref
from typing import Any, Protocol

import torch

from tieredkv.config import TieredKVConfig
from tieredkv.disk.format import slot_counts
from tieredkv.protocol import JobResult, Move, merge_results
from tieredkv.transfer.host_pool import HostPool
from tieredkv.vllm.geometry import engine_geometry
from tieredkv.vllm.metadata import (
    IDLE_WAIT_S,
    INLINE_LOAD_MAX_BYTES,
    TieredKVMetadata,
    TieredKVWorkerMetadata,
)

logger = logging.getLogger("tieredkv")


def _worker_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_world_group

        return get_world_group().rank_in_group
    except Exception:  # noqa: BLE001 - outside an initialised vLLM worker
        return 0


class WorkerHalf:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, config: TieredKVConfig) -> None:
        self.geometry = engine_geometry(vllm_config, kv_cache_config, config)
        self.config = config = self.geometry.config
        self.num_blocks = kv_cache_config.num_blocks
        self.rank = _worker_rank()
        self.engine = None
        self.host: HostPool | None = None
        self.slab = None
        self._slab_lock = None
        self._vllm_copy_op = None
        self._load_reqs: dict[int, tuple[str, bool]] = {}  # load job -> request, synchronous?
        self._store_reqs: dict[int, str] = {}  # store job -> request
        self._pending_stores: dict[str, set[int]] = {}
        self._delayed: set[str] = set()
        self._finished_recving: set[str] = set()
        self._finished_sending: set[str] = set()
        self._load_errors: set[int] = set()
        self._failed_recving: set[str] = set()
        # vLLM takes block-level load errors from one KV-cache group only, and recomputes from
        # the first failed block: with several groups, or a sliding window (the window before
        # that block was never loaded: its blocks are vLLM's null block), a failed load is
        # reported as a failed request (failed_recving) and recomputed whole.
        self._errors_by_request = self.geometry.slot_rows.hybrid
        self._results: dict[int, JobResult] = {}
        self._step = 0  # the plan number of the step being run
        self._awaited: set[int] = set()  # loads and fills in flight: someone waits on them
        self._compute_idle = False
        # Host-tier loads copied inline in start_load_kv (CPU caches; set at registration).
        self.inline_host_loads = False
        install(self)

    # ------------------------------------------------------------------ set-up

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        self._vllm_copy_op = copy_operation

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from tieredkv.transfer.backends.base import select_backend
        from tieredkv.transfer.engine import TransferEngine
        from tieredkv.transfer.kv_views import KVViews

        views = KVViews.from_kv_caches(kv_caches, self.num_blocks, layout=self.geometry.namespace.kv_layout)
        payload = views.slot_payload_bytes(self.geometry.slot_rows.rows)
        if payload != self.geometry.chunk_payload_bytes:
            raise ValueError(
                f"tieredkv: registered KV caches give {payload} bytes per chunk, the KV-cache "
                f"spec {self.geometry.chunk_payload_bytes}; refusing to start with a layout "
                "tieredkv does not understand"
            )
        host_slots, disk_slots = slot_counts(self.config, payload, self.geometry.world_size)
        cpu = views.device.type == "cpu"
        huge = cpu and self.config.huge_pages
        if huge:
            from tieredkv.transfer.huge_pages import advise_kv_caches

            advise_kv_caches(kv_caches.values())
        self.host = HostPool(host_slots, payload, huge_pages=huge)
        if disk_slots:
            from tieredkv.disk.format import rank_lock_name, slab_path
            from tieredkv.disk.private_files import DiskLock
            from tieredkv.disk.slab import SlabFile

            assert self.config.disk_path is not None
            # DiskLock checks (and creates 0700) disk_path before this worker opens any file.
            self._slab_lock = DiskLock(self.config.disk_path, name=rank_lock_name(self.rank))
            io = None
            if os.environ.get("TIEREDKV_FAULTS"):  # e2e tests and soak runs only: a slow disk
                from tieredkv.testing.fault_backend import disk_io_from_env

                io = disk_io_from_env()
            self.slab = SlabFile.open(
                slab_path(self.config.disk_path, self.rank),
                num_slots=disk_slots,
                payload_bytes=payload,
                fingerprint=self.geometry.fingerprint,
                io=io,
            )
        backend = select_backend(
            self.config.copy_backend, kv=views, host=self.host, vllm_copy_op=self._vllm_copy_op
        )
        if os.environ.get("TIEREDKV_FAULTS"):  # e2e tests and soak runs only
            from tieredkv.testing.fault_backend import maybe_inject

            backend = maybe_inject(backend)
        self.engine = TransferEngine(
            views,
            self.host,
            self.slab,
            backend=backend,
            io_threads=self.config.io_threads,
            spill_queue_depth=self.config.spill_queue_depth,
            load_timeout_s=self.config.load_timeout_s,
            remote=self._remote_jobs() if self.config.has_remote else None,
        )
        self.inline_host_loads = cpu
        logger.info(
            "tieredkv: worker rank %d ready: %d host slots (%s), %d disk slots, copy backend %s",
            self.rank, host_slots, "pinned" if self.host.pinned else "pageable", disk_slots,
            backend.describe(),
        )

    def _remote_jobs(self):
        """This rank's reads and writes of the shared tier (its own store and thread)."""
        from tieredkv.remote.from_config import open_store
        from tieredkv.transfer.remote_jobs import RemoteJobs

        config = self.config
        assert self.host is not None
        store = open_store(config, thread_name=f"tieredkv-remote-r{self.rank}")
        return RemoteJobs(
            store, self.host, fingerprint=self.geometry.fingerprint, rank=self.rank,
            prefix=config.remote_key_prefix, ttl_s=config.remote_ttl_s or None,
            timeout_s=config.remote_timeout_s, writes=config.remote_writes,
        )

    # ------------------------------------------------------------------ steps

    def handle_preemptions(self, metadata: TieredKVMetadata) -> None:
        """Before the next forward reuses preempted blocks, no store may still read them."""
        if self.engine is not None and metadata.plan.fence_block_ids:
            self.engine.fence_blocks(metadata.plan.fence_block_ids)

    def start_jobs(self, metadata: TieredKVMetadata) -> None:
        plan = metadata.plan
        self._step = plan.step  # echoed in this step's output (build_worker_meta)
        if self.engine is None:
            return
        self._compute_idle = plan.compute_idle
        jobs = [job for job in plan.jobs if job.move is not Move.STORE]  # stores: after the forward
        for job in jobs:
            if job.move is Move.LOAD:
                self._load_reqs[job.job_id] = (job.req_id, job.src.sync)  # type: ignore[union-attr]
            if job.move.brings_up:
                self._awaited.add(job.job_id)  # a request waits for these bytes
        if jobs:
            if not self.inline_host_loads:
                inline_max = 0
            elif plan.compute_idle:
                inline_max = sys.maxsize
            else:
                inline_max = INLINE_LOAD_MAX_BYTES
            self.engine.submit(jobs, inline_max_bytes=inline_max)
        # This step's stores count as pending now, before the delayed requests are looked
        # at: a request that finished with a last store (its tail) in this same metadata must
        # not be reported finished (its blocks freed) before that store has read them.
        self._register_stores(plan)
        for req_id in plan.delayed_req_ids:
            self._delayed.add(req_id)
            if not self._pending_stores.get(req_id):
                self._finish_sending(req_id)

    def _register_stores(self, plan: Any) -> None:
        """Idempotent until the jobs are submitted (none can have finished before that)."""
        for job in plan.of(Move.STORE):
            req_id = job.req_id
            if req_id is not None and job.job_id not in self._store_reqs:
                self._store_reqs[job.job_id] = req_id
                self._pending_stores.setdefault(req_id, set()).add(job.job_id)

    def submit_stores(self, metadata: TieredKVMetadata) -> None:
        plan = metadata.plan
        stores = plan.of(Move.STORE)
        if self.engine is None or not stores:
            return
        self._register_stores(plan)
        self.engine.submit(stores)

    def _finish_sending(self, req_id: str) -> None:
        self._delayed.discard(req_id)
        self._pending_stores.pop(req_id, None)
        self._finished_sending.add(req_id)

    def collect(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Fold engine results in; return (finished_sending, finished_recving) for this step."""
        if self.engine is not None:
            if self._compute_idle and self._awaited:
                self.engine.wait_for_results(IDLE_WAIT_S)
            self._compute_idle = False
            for result in self.engine.poll():
                self._record(result)
        sending, self._finished_sending = self._finished_sending, set()
        recving, self._finished_recving = self._finished_recving, set()
        return sending, recving

    def _record(self, result: JobResult) -> None:
        job_id = result.job_id
        self._awaited.discard(job_id)
        merge_results(self._results, [result])
        load = self._load_reqs.pop(job_id, None)
        if load is not None:
            # A synchronous load's request is running, not waiting: vLLM takes no completion
            # for it, and a failure only as invalid blocks (it then drops the step's output
            # for that request and recomputes from the first failed block).
            load_req, sync = load
            if not result.ok and self._errors_by_request and not sync:
                self._failed_recving.add(load_req)
            elif not result.ok:
                self._load_errors.update(result.failed_block_ids)
                logger.warning(
                    "tieredkv: load for %s failed (%s): %d blocks will be recomputed",
                    load_req, result.failure, len(result.failed_block_ids),
                )
            if not sync:
                self._finished_recving.add(load_req)
        store_req = self._store_reqs.pop(job_id, None)
        if store_req is not None:
            pending = self._pending_stores.get(store_req)
            if pending is not None:
                pending.discard(job_id)
                if not pending:
                    if store_req in self._delayed:
                        self._finish_sending(store_req)
                    else:
                        self._pending_stores.pop(store_req, None)

    def before_sleep(self) -> None:
        """vLLM sleep mode is about to free the device memory: stop touching it first."""
        if self.engine is not None:
            quiet = self.engine.pause_device_jobs(timeout_s=10.0)
            logger.info("tieredkv: worker rank %d paused device copies for sleep (%s)",
                        self.rank, "quiet" if quiet else "some still running")

    def after_wake_up(self) -> None:
        if self.engine is not None:
            self.engine.resume_device_jobs()
            logger.info("tieredkv: worker rank %d resumed device copies", self.rank)

    def take_failed_recving(self) -> set[str]:
        failed, self._failed_recving = self._failed_recving, set()
        return failed

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_worker_meta(self) -> TieredKVWorkerMetadata | None:
        """This step's results, and its number: sent every step, even with no result, so
        vLLM delivers every step's output (it skips an empty one) and the scheduler pairs
        each with its own step (the prefill rate). None only for a step never numbered."""
        if not self._results and not self._step:
            return None
        results, self._results = self._results, {}
        return TieredKVWorkerMetadata(results=results, step=self._step)

    def stats_snapshot(self) -> dict:
        """This rank's transfer counters since the last call (see TransferEngine.take_stats)."""
        if self.engine is None:
            return {}
        return {"workers": {str(self.rank): self.engine.take_stats()}}

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown(timeout_s=10.0)
            self.engine = None
        if self.slab is not None:
            self.slab.close()
            self.slab = None
        if self._slab_lock is not None:
            self._slab_lock.close()
            self._slab_lock = None


# ---------------------------------------------------------------------- sleep mode

_WORKER_MODULE = "vllm.v1.worker.gpu_worker"
_MARK = "_tieredkv_sleep_hook"


class SleepAware(Protocol):
    def before_sleep(self) -> None: ...

    def after_wake_up(self) -> None: ...


_halves: weakref.WeakSet[Any] = weakref.WeakSet()


def install(half: SleepAware, worker_class: type | None = None) -> None:
    """Register ``half`` and wrap the worker class's sleep/wake_up if not done yet.

    ``worker_class`` defaults to vLLM's GPU ``Worker`` when its module is already loaded in
    this process (a worker process always has it; nothing is imported here).
    """
    _halves.add(half)
    if worker_class is None:
        module = sys.modules.get(_WORKER_MODULE)
        worker_class = getattr(module, "Worker", None) if module is not None else None
    if worker_class is None:
        return
    patch_worker_class(worker_class)


def patch_worker_class(worker_class: type) -> None:
    """Wrap ``worker_class.sleep`` and ``wake_up`` (idempotent)."""
    sleep = getattr(worker_class, "sleep", None)
    wake_up = getattr(worker_class, "wake_up", None)
    if sleep is None or wake_up is None or getattr(sleep, _MARK, False):
        return

    @functools.wraps(sleep)
    def sleep_after_pausing_tieredkv(self: Any, *args: Any, **kwargs: Any) -> Any:
        for half in list(_halves):
            try:
                half.before_sleep()
            except Exception:  # noqa: BLE001 - never stop vLLM from sleeping
                logger.exception("tieredkv: pausing device copies before sleep failed")
        return sleep(self, *args, **kwargs)

    @functools.wraps(wake_up)
    def wake_up_then_resume_tieredkv(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = wake_up(self, *args, **kwargs)
        for half in list(_halves):
            try:
                half.after_wake_up()
            except Exception:  # noqa: BLE001 - a failed resume must not break vLLM's wake-up
                logger.exception("tieredkv: resuming device copies after wake-up failed")
        return result

    setattr(sleep_after_pausing_tieredkv, _MARK, True)
    setattr(wake_up_then_resume_tieredkv, _MARK, True)
    worker_class.sleep = sleep_after_pausing_tieredkv  # type: ignore[attr-defined]
    worker_class.wake_up = wake_up_then_resume_tieredkv  # type: ignore[attr-defined]
    logger.debug("tieredkv: wrapped %s.sleep/wake_up", worker_class.__qualname__)
