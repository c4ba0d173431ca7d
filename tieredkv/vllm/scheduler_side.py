"""The connector's scheduler half: adapts vLLM's scheduler calls to the :class:`Planner`.

It computes chunk keys from vLLM's own block hashes (cached per request, so a 128k-token
lookup hashes nothing twice), tracks device block ids from the scheduler output, and owns the
disk catalog (lock, journal, recovery).
"""

from __future__ import annotations

import logging
from typing import Any

from tieredkv.config import TieredKVConfig
from tieredkv.disk.format import align_up, slot_counts
from tieredkv.keys import LazyChunkKeys
from tieredkv.metrics.specs import Count
from tieredkv.protocol import Move, StepPlan
from tieredkv.scheduler.planner import Planner
from tieredkv.vllm.geometry import AdapterDigests, engine_geometry
from tieredkv.vllm.metadata import (
    IDLE_SYNC_LOAD_MAX_BYTES,
    IDLE_WAIT_S,
    INLINE_LOAD_MAX_BYTES,
    TieredKVMetadata,
    TieredKVWorkerMetadata,
)

logger = logging.getLogger("tieredkv")


def _finished_normally(request: Any) -> bool:
    """Stopped or length-capped (not aborted, not failed): its computed KV is sound."""
    name = getattr(getattr(request, "status", None), "name", "")
    return name in ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")


class SchedulerHalf:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, config: TieredKVConfig) -> None:
        self.geometry = geometry = engine_geometry(vllm_config, kv_cache_config, config)
        self.config = config = geometry.config
        hash_block = getattr(kv_cache_config, "hash_block_size", None) or geometry.block_size
        if (geometry.block_size * config.chunk_blocks) % hash_block:
            raise ValueError(
                f"tieredkv: chunk of {config.chunk_blocks} blocks is not a whole number of "
                f"{hash_block}-token hash blocks; change chunk_blocks"
            )
        self._hashes_per_chunk = geometry.block_size * config.chunk_blocks // hash_block
        # Hybrid models (several KV-cache groups, or a sliding window): hits end on chunk
        # boundaries or where a stored prompt ended (its tail keeps the windows before it).
        self._hybrid = geometry.slot_rows.hybrid
        if self._hybrid:
            logger.info("tieredkv: KV-cache groups %s: hits end on %d-token chunk boundaries "
                        "or at a stored prompt's end", geometry.slot_rows.describe(),
                        geometry.block_size * config.chunk_blocks)
        # Hits end at the last vLLM block held when a block is a whole number of hash blocks
        # (always so in vLLM 0.32: the hash block size divides every group's block size).
        if geometry.block_size % hash_block == 0:
            self._hashes_per_block = geometry.block_size // hash_block
        else:
            self._hashes_per_block = 0
            logger.warning(
                "tieredkv: block size %d is not a whole number of %d-token hash blocks: hits "
                "end at chunk boundaries", geometry.block_size, hash_block,
            )
        host_slots, disk_slots = slot_counts(config, geometry.chunk_payload_bytes, geometry.world_size)
        if host_slots == 0:
            raise ValueError(
                f"tieredkv: invalid host_bytes={config.host_bytes}: smaller than one chunk "
                f"({align_up(geometry.chunk_payload_bytes) * geometry.world_size} bytes across "
                f"{geometry.world_size} rank(s)); raise host_bytes or lower chunk_blocks"
            )
        catalog = None
        if config.has_disk:
            if disk_slots == 0:
                raise ValueError(
                    f"tieredkv: invalid disk_bytes={config.disk_bytes}: smaller than one chunk slot"
                )
            if not geometry.stable_hashes:
                logger.warning(
                    "tieredkv: prefix_caching_hash_algo is not stable across processes and "
                    "PYTHONHASHSEED is unset: the disk tier will not survive a restart"
                )
            from tieredkv.disk.catalog import DiskCatalog

            assert config.disk_path is not None
            catalog = DiskCatalog.open(
                config.disk_path,
                fingerprint=geometry.fingerprint,
                payload_bytes=geometry.chunk_payload_bytes,
                num_slots=disk_slots,
                world_size=geometry.world_size,
            )
        self.catalog = catalog
        self.remote_store = None
        remote = self._open_remote(config, host_slots, disk_slots) if config.has_remote else None
        self.planner = Planner(
            config,
            block_size=geometry.block_size,
            num_host_slots=host_slots,
            num_disk_slots=disk_slots,
            world_size=geometry.world_size,
            catalog=catalog,
            remote=remote,
            slot_rows=geometry.slot_rows,
            chunk_bytes=geometry.chunk_payload_bytes * geometry.world_size,
        )
        # Data parallel: engines step in lockstep; one sleeping would hold up the others.
        self._single_engine = getattr(vllm_config.parallel_config, "data_parallel_size", 1) == 1
        policy = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "fail")
        if policy != "recompute":
            logger.warning(
                "tieredkv: kv_load_failure_policy=%r: tieredkv promises only verified chunks, so "
                "a corrupted disk chunk is a plain miss; but a load that fails after its promise "
                "(an I/O error mid-copy) will end that request with an error. Set "
                "\"kv_load_failure_policy\":\"recompute\" to have vLLM recompute instead.",
                policy,
            )
        self._requests: dict[str, Any] = {}
        self._keys: dict[str, LazyChunkKeys] = {}
        # Synchronous loads (``sync_loads``): on vLLM's CPU build a hit is a memcpy from host
        # slots, cheaper than the engine step an asynchronous load waits for, so vLLM is told
        # the load is synchronous and schedules the request at once. Not for hybrid models:
        # vLLM takes no per-request failure for a synchronous load, and block-level failures
        # only from one KV-cache group. 0: off.
        device = getattr(getattr(vllm_config, "device_config", None), "device_type", "")
        self._sync_block_bytes = (geometry.chunk_payload_bytes // config.chunk_blocks
                                  if config.sync_loads and device == "cpu" and not self._hybrid
                                  else 0)
        self._sync_bytes: dict[str, int] = {}  # this step's synchronous loads, by request
        # Requests the last step scheduled and that have not finished since: none, and a
        # synchronous load delays nobody's forward (IDLE_SYNC_LOAD_MAX_BYTES applies).
        self._running: set[str] = set()
        self.events = self._open_events(vllm_config, kv_cache_config, hash_block)
        self._adapters = AdapterDigests()
        self._exporter = None
        self._exporter_server = None
        if config.metrics_port is not None:
            self._start_exporter(config.metrics_port, str(vllm_config.model_config.model))
        logger.info(
            "tieredkv: scheduler ready: %d host slots, %d disk slots per rank, chunk %d tokens "
            "(%d bytes per rank), world size %d, loads %s",
            host_slots, disk_slots, geometry.block_size * config.chunk_blocks,
            geometry.chunk_payload_bytes, geometry.world_size,
            f"synchronous up to {INLINE_LOAD_MAX_BYTES >> 20} MiB per step "
            f"({IDLE_SYNC_LOAD_MAX_BYTES >> 20} MiB when no other request runs)"
            if self._sync_block_bytes else "asynchronous",
        )

    def _open_remote(self, config: TieredKVConfig, host_slots: int, disk_slots: int):
        """The shared tier's probe and write admission; the store connects in the background.

        vLLM builds the scheduler just before the first requests arrive, and a lookup while
        the store is not up skips it (a miss): the first requests of a new replica would miss
        a Redis that holds their prefixes while its first handshake (a Cluster's takes
        ~0.1 s) is still on the wire. So start-up waits for that one attempt, bounded by
        its connect timeout; a server that refuses ends the wait at once.
        """
        from tieredkv.remote.from_config import await_first_connect, open_store
        from tieredkv.scheduler.remote_tier import RemoteProbe, RemoteTier

        geometry = self.geometry
        store = self.remote_store = open_store(config, thread_name="tieredkv-remote-scheduler")
        await_first_connect(store, config)
        probe = RemoteProbe(
            store, geometry.fingerprint, geometry.world_size,
            prefix=config.remote_key_prefix, deadline_s=config.remote_timeout_s,
        )
        assert config.remote_url is not None
        logger.info(
            "tieredkv: remote tier %s (prefix %r, timeout %.3g s, writes %s); it is probed "
            "without blocking the scheduler and connects in the background",
            config.remote_url.redacted(), config.remote_key_prefix, config.remote_timeout_s,
            "on" if config.remote_writes else "off",
        )
        return RemoteTier(
            probe, is_up=lambda: store.up, writes=config.remote_writes,
            admission=config.remote_admission,
            seen_limit=max(1024, 4 * (host_slots + disk_slots)),
            server_info=lambda: store.run(lambda: store.store.server_info(), None),
        )

    def _open_events(self, vllm_config: Any, kv_cache_config: Any, hash_block: int):
        """KV events (see :mod:`tieredkv.vllm.kv_events`), only when vLLM publishes them."""
        events_config = getattr(vllm_config, "kv_events_config", None)
        if events_config is None or not events_config.enable_kv_cache_events:
            return None
        from tieredkv.vllm.kv_events import KVEvents, event_groups

        config, planner = self.config, self.planner
        events = KVEvents(
            block_size=self.geometry.block_size, chunk_blocks=config.chunk_blocks,
            hash_block_size=hash_block,
            groups=event_groups(kv_cache_config, self.geometry.slot_rows),
            log_dir=config.disk_path if config.has_disk else None,
        )
        self._finished_requests: dict[str, Any] = {}  # finished, their last stores not planned
        self._block_index: dict[str, tuple[int, dict[bytes, int]]] = {}
        planner.host.listener = events
        disk = planner.disk
        if disk is not None:
            disk.listener = events

            def ready_aliases(key: bytes) -> tuple[bytes, ...] | None:
                placement = disk.get(key) if disk.is_ready(key) else None
                return None if placement is None else placement.aliases

            events.recover(disk.keys(), ready_aliases)
        logger.info("tieredkv: KV events on: host %s, disk %s",
                    "CPU", "STORAGE" if disk is not None else "none")
        return events

    def _record_events(self, plan: StepPlan) -> None:
        """Name the blocks of every entry this step's copies will make READY, while their
        requests are alive (the entry's key alone does not say vLLM's block hashes)."""
        events = self.events
        assert events is not None
        for job in plan.jobs:
            if job.req_id is None or job.move not in (Move.STORE, Move.PROMOTE, Move.REMOTE_READ):
                continue
            if events.has_record(job.key):
                continue
            request = self._requests.get(job.req_id) or self._finished_requests.get(job.req_id)
            if request is None:
                continue
            block = self._block_of(request, job.key)
            if block is not None:
                events.record(job.key, request, block)
        for req_id in self._finished_requests:
            self._keys.pop(req_id, None)
            self._block_index.pop(req_id, None)
        self._finished_requests.clear()

    def _block_of(self, request: Any, key: bytes) -> int | None:
        """Which block of ``request`` (tieredkv's block size) ``key`` is the key of."""
        done, index = self._block_index.get(request.request_id, (0, {}))
        if key not in index:
            done, index = self._index_blocks(request, done, index)
            if key not in index and done:  # hashes replaced in place (a streaming session)
                done, index = self._index_blocks(request, 0, {})
            self._block_index[request.request_id] = (done, index)
        return index.get(key)

    def _index_blocks(self, request: Any, done: int, index: dict[bytes, int]) -> tuple[int, dict[bytes, int]]:
        keys = self.keys_for(request)
        if keys.block_granular:
            total = keys.num_blocks
            for b, k in enumerate(keys.block_keys(min(done, total), total), start=min(done, total)):
                index[k] = b
            return total, index
        total, cb = len(keys), self.config.chunk_blocks
        chunk_keys = keys.materialize(total)
        for c in range(min(done, total), total):
            index[chunk_keys[c]] = (c + 1) * cb - 1
        return total, index

    def take_events(self) -> list:
        """This step's KV events (empty unless vLLM's KV events are on)."""
        return self.events.take() if self.events is not None else []

    # ------------------------------------------------------------------ keys

    def keys_for(self, request: Any) -> LazyChunkKeys:
        """Chunk keys of every full chunk of ``request``, derived lazily and cached.

        Cached keys are re-checked against vLLM's list on every call: a streaming session
        truncates ``request.block_hashes`` in place and appends the next input's hashes, and
        a key derived before that would name the old tokens. A LoRA request's keys mix in
        the adapter files' digest, which vLLM's block hashes (name and path only) lack.
        """
        keys = self._keys.get(request.request_id)
        if keys is None or keys.block_hashes is not request.block_hashes:
            lora = getattr(request, "lora_request", None)
            extra = self._adapters.digest(lora) if lora is not None else b""
            keys = self._keys[request.request_id] = LazyChunkKeys(
                self.geometry.fingerprint, request.block_hashes, self._hashes_per_chunk, extra,
                hashes_per_block=self._hashes_per_block,
            )
        elif keys.refresh():
            logger.debug("tieredkv: request %s: block hashes replaced, keys re-derived", request.request_id)
        return keys

    # ------------------------------------------------------------------ vLLM calls

    def on_new_request(self, request: Any) -> None:
        self._requests[request.request_id] = request
        if self.planner.remote is not None and not getattr(request, "skip_reading_prefix_cache", False):
            # Probe Redis while the current step's forward runs: the first lookup then
            # usually finds the answer instead of asking vLLM to come back a step later.
            self.planner.prefetch_remote(request.request_id, self.keys_for(request), request.num_tokens)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._requests[request.request_id] = request
        if getattr(request, "skip_reading_prefix_cache", False):
            return 0, False
        hit = self.planner.lookup(
            request.request_id, self.keys_for(request), num_computed_tokens, request.num_tokens
        )
        if hit is None:
            return None, False
        if hit > 0 and self._sync_block_bytes and self._sync_fits(request, num_computed_tokens, hit):
            return hit, False
        return hit, hit > 0

    def _sync_fits(self, request: Any, num_computed_tokens: int, hit: int) -> bool:
        """Whether a hit of ``hit`` tokens is loaded synchronously: this step's synchronous
        loads, with it, copy at most INLINE_LOAD_MAX_BYTES per rank before the forward
        (IDLE_SYNC_LOAD_MAX_BYTES when no other request is running: no one's forward waits
        on the copy), and the host tier can take the prompt's chunks past the hit without
        evicting what the hit reads (the same step stores them, while the load still pins
        its chunks; an asynchronous load has unpinned them by then, so it is used instead)."""
        req_id = request.request_id
        host = self.planner.host
        new_chunks = -(-(request.num_prompt_tokens - num_computed_tokens - hit) // self.planner.chunk_tokens)
        need = -(-hit // self.geometry.block_size) * self._sync_block_bytes
        others = sum(b for r, b in self._sync_bytes.items() if r != req_id)
        bound = INLINE_LOAD_MAX_BYTES if self._running - {req_id} else IDLE_SYNC_LOAD_MAX_BYTES
        if host.num_slots - host.pinned_count < new_chunks or others + need > bound:
            self._sync_bytes.pop(req_id, None)
            return False
        self._sync_bytes[req_id] = need
        return True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        req_id = request.request_id
        if self._hybrid:
            self.planner.on_alloc(req_id, blocks.get_block_ids(), num_external_tokens)
            return
        block_ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
        self.planner.on_alloc(req_id, block_ids, num_external_tokens, sync=req_id in self._sync_bytes)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[str, int]:
        tokens = self.planner.hit_tokens(request.request_id)
        return {tier: count for tier, count in tokens.items() if count > 0}

    def build_connector_meta(self, scheduler_output: Any) -> TieredKVMetadata:
        planner = self.planner
        for req_id in scheduler_output.preempted_req_ids or ():
            planner.preempted(req_id)
        group = slice(None) if self._hybrid else 0  # hybrid: every group's blocks
        for new in scheduler_output.scheduled_new_reqs:
            planner.set_block_ids(new.req_id, new.block_ids[group], replace=True)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids, strict=False):
            if new_ids is not None:
                planner.set_block_ids(req_id, new_ids[group], replace=req_id in resumed)
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None:
                continue
            after = request.num_computed_tokens + scheduled
            prompt = request.num_prompt_tokens
            if self.config.store_generated:
                limit = request.num_tokens - 1
            else:
                limit = prompt
            storable = min(after, limit)
            # The step that computes the prompt's last tokens also stores the prompt's tail
            # (its full blocks past the last full chunk), once.
            tail = request.num_computed_tokens < prompt <= after
            if tail:
                storable = max(storable, prompt)
            planner.plan_stores(req_id, self.keys_for(request), storable, tail=tail,
                                computed_tokens=request.num_computed_tokens)
        plan = planner.take_plan()
        self._sync_bytes.clear()
        self._running = set(scheduler_output.num_scheduled_tokens)
        if self.events is not None:
            self._record_events(plan)
        scheduled_tokens = getattr(scheduler_output, "total_num_scheduled_tokens", 1)
        plan.compute_idle = not scheduled_tokens
        if plan.compute_idle and self._single_engine:
            planner.wait_idle(IDLE_WAIT_S)
        plan.step = planner.step_scheduled(scheduled_tokens)  # timed to its output: prefill rate
        return TieredKVMetadata(plan=plan)

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        ours = isinstance(meta, TieredKVWorkerMetadata)
        self.planner.step_done(meta.step if ours and meta.step else None)
        if ours and meta.results:
            self.planner.apply(meta.results.values())
        worker_stats = getattr(connector_output, "kv_connector_stats", None)
        if self._exporter is not None and worker_stats is not None:
            self._exporter.observe({"workers": worker_stats.data.get("workers") or {}})

    def request_finished(self, request: Any) -> bool:
        req_id = request.request_id
        if self.config.store_generated and _finished_normally(request):
            # Generated text past the last full chunk: stored as a tail before the blocks go
            # (the return value below then delays their free until the store is done).
            storable = min(request.num_computed_tokens, request.num_tokens - 1)
            self.planner.finish_tail(req_id, self.keys_for(request), storable)
        if self.events is not None:
            self._finished_requests[req_id] = request  # its last stores are planned next step
        self._requests.pop(req_id, None)
        self._keys.pop(req_id, None)
        self._running.discard(req_id)
        return self.planner.finished(req_id)

    def reset_cache(self) -> bool:
        self.planner.reset()
        return True

    def _start_exporter(self, port: int, model_name: str) -> None:
        """Serve the same metrics outside vLLM's /metrics, on 127.0.0.1:``metrics_port``."""
        from prometheus_client import CollectorRegistry

        from tieredkv.config import ConfigError
        from tieredkv.metrics.exporter import build_exporter_metrics, start_exporter

        registry = CollectorRegistry()
        self._exporter = build_exporter_metrics(registry, model_name=model_name)
        try:
            self._exporter_server, _ = start_exporter(port, registry)
        except OSError as exc:
            raise ConfigError("metrics_port", f"cannot serve metrics there: {exc}", value=port) from exc
        self.metrics_port = self._exporter_server.server_port
        logger.info("tieredkv: metrics on http://127.0.0.1:%d/metrics", self.metrics_port)

    def stats_snapshot(self) -> dict:
        """Scheduler-side counter deltas and gauges (plain data for vLLM's stats path)."""
        snapshot = self._snapshot()
        if self._exporter is not None:
            self._exporter.observe(snapshot)
        return snapshot

    def _snapshot(self) -> dict:
        if self.catalog is not None:  # the journal's counts (declared Counts, like every one)
            for name, count in self.catalog.take_counter_deltas().items():
                self.planner.counters[Count(name)] += count
        counters = self.planner.take_counter_deltas()
        latency = self.planner.take_latency()
        return {
            "scheduler": {
                "counters": counters,
                **({"latency_s": latency} if latency else {}),
                "gauges": self.planner.gauges(),
                "chunk_bytes": self.geometry.chunk_payload_bytes,
                "chunk_tokens": self.geometry.block_size * self.config.chunk_blocks,
                "world_size": self.geometry.world_size,
            }
        }

    def has_pending_work(self) -> bool:
        """Jobs in flight, or a recovered disk tier still to announce (vLLM keeps stepping an
        idle engine while a connector has pending work: a router relearns it without traffic)."""
        return self.planner.has_pending_work() or (self.events is not None and self.events.announcing)

    def shutdown(self) -> None:
        if self._exporter_server is not None:
            self._exporter_server.shutdown()
            self._exporter_server = None
        if self.events is not None:
            self.events.close()
        if self.catalog is not None:
            self.catalog.close()
            self.catalog = None
        if self.remote_store is not None:
            self.remote_store.close(2.0)
            self.remote_store = None
