"""The short copy run (``gpu_check.py --copy-check``), small enough for compute-sanitizer.

Every copy backend moves the right bytes between small KV caches in the layouts vLLM serves
tieredkv and host slots, directly and through the transfer engine's lanes, and touches nothing
else. Needs torch and tieredkv, imported only here; prints one line per (layout, backend) and
a final ``copy-check: ...`` line (``copy-check: FAILED: ...`` on a wrong byte).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from gpucheck.common import ROOT
from tieredkv.protocol import Job

COPY_CASES = ("flash_attn-LBHNC", "triton_attn-LBHNC-fp8", "flashinfer-sm100-BLHNC",
              "flashinfer-sm90-LBHNC-block128", "flex_attention-LBNHC-fp16", "flashmla-MLA")
_CC_LAYERS, _CC_BLOCKS, _CC_CHUNK, _CC_SLOTS = 2, 16, 4, 6


def _copy_check_imports() -> None:
    """torch and tieredkv for the copy check, bound as module globals (the rest of the check
    runs without them)."""
    global torch, CASE_BY_ID, build_kv_caches, HostPool, CopyBackend, CupyCopyBackend
    global NativeCopyBackend, TorchCopyBackend, TransferEngine, LoadChunk, Job, KVViews
    sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "transfer")]
    import torch
    from vllm_cuda_layouts import CASE_BY_ID, build_kv_caches

    from tieredkv.protocol import Job, LoadChunk
    from tieredkv.transfer.backends.base import CopyBackend
    from tieredkv.transfer.backends.cupy_backend import CupyCopyBackend
    from tieredkv.transfer.backends.native_backend import NativeCopyBackend
    from tieredkv.transfer.backends.torch_backend import TorchCopyBackend
    from tieredkv.transfer.engine import TransferEngine
    from tieredkv.transfer.host_pool import HostPool
    from tieredkv.transfer.kv_views import KVViews


class Mismatch(AssertionError):
    """A wrong byte found by the copy check."""


def _copy_backends(device: torch.device) -> tuple[dict[str, CopyBackend], list[str]]:
    found: dict[str, CopyBackend] = {"torch": TorchCopyBackend()}
    notes = []
    if device.type == "cuda":
        found["torch-dma"] = TorchCopyBackend(mapped=False)  # torch's path for unmapped pools
        ok, why = CupyCopyBackend.available(device)
        if ok:
            found["cupy"] = CupyCopyBackend(device)
        else:
            notes.append(f"cupy not checked: {why}")
    else:
        ok, why = NativeCopyBackend.available(device)
        if ok:
            found["native"] = NativeCopyBackend()
        else:
            notes.append(f"native not checked: {why}")
    return found, notes


def _slot_rows(kv: KVViews, host: HostPool, slot: int, layer: int, position: int) -> torch.Tensor:
    chunk_blocks = kv.chunk_blocks_for(host.payload_bytes)
    offset = kv.layer_offsets(chunk_blocks)[layer] + position * kv.block_bytes[layer]
    return host.slot(slot)[offset : offset + kv.block_bytes[layer]]


def _copy_check_case(case: Any, device: torch.device, name: str, backend: CopyBackend) -> int:
    """Direct d2h/h2d with the backend on a side stream, then a store + load through the
    engine's lanes; returns the number of blocks verified."""
    caches, raw = build_kv_caches(case, _CC_LAYERS, _CC_BLOCKS, device, seed=7)
    replica, replica_raw = build_kv_caches(case, _CC_LAYERS, _CC_BLOCKS, "cpu", seed=7)
    kv = KVViews.from_kv_caches(caches, _CC_BLOCKS, layout=case.layout)
    ref = KVViews.from_kv_caches(replica, _CC_BLOCKS, layout=case.layout)
    host = HostPool(_CC_SLOTS, kv.slot_payload_bytes(_CC_CHUNK), pin=device.type == "cuda")
    host.buffer.zero_()
    cuda = device.type == "cuda"
    stream = torch.cuda.Stream(device) if cuda else None
    verified = 0

    def on_stream(fn) -> None:
        if stream is None:
            fn()
            return
        with torch.cuda.stream(stream):
            fn()
        stream.synchronize()

    down = [(0, 0, (9, 2, 14, 5)), (3, 1, (7, 11))]  # a full chunk and a partial one
    on_stream(lambda: backend.d2h(kv, host, down))
    for slot, first, ids in down:
        for layer in range(_CC_LAYERS):
            for j, block in enumerate(ids):
                if not torch.equal(_slot_rows(kv, host, slot, layer, first + j), ref.rows[layer][block]):
                    raise Mismatch(f"{case.id}/{name}: d2h block {block} layer {layer} -> slot {slot}")
                verified += 1
    up = [(0, 1, (0, 1, 3)), (3, 1, (15, 12))]
    on_stream(lambda: backend.h2d(kv, host, up))
    for slot, first, ids in up:
        for layer in range(_CC_LAYERS):
            for j, block in enumerate(ids):
                ref.rows[layer][block] = _slot_rows(kv, host, slot, layer, first + j)
                verified += 1
    if not torch.equal(raw.cpu(), replica_raw):
        raise Mismatch(f"{case.id}/{name}: h2d left the device cache different from expected")

    engine = TransferEngine(kv, host, None, backend=backend)
    try:
        engine.submit([Job.store(1, b"c1", 5, (4, 6, 8, 10))])
        _wait_for_job(engine, 1)
        engine.submit([Job.load(2, "r", (LoadChunk(b"c1", 5, 2, (13, 0)),))])
        _wait_for_job(engine, 2)
    finally:
        engine.shutdown(timeout_s=5.0)
    for layer in range(_CC_LAYERS):
        ref.rows[layer][13] = ref.rows[layer][8]
        ref.rows[layer][0] = ref.rows[layer][10]
    if cuda:
        torch.cuda.synchronize(device)
    if not torch.equal(raw.cpu(), replica_raw):
        raise Mismatch(f"{case.id}/{name}: store + load through the engine gave wrong bytes")
    return verified + 2 * _CC_LAYERS


def _wait_for_job(engine: TransferEngine, job_id: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for result in engine.poll():
            if result.job_id == job_id:
                if not result.ok:
                    raise Mismatch(f"job {job_id} failed: {result.failure}")
                return
        time.sleep(0.005)
    raise Mismatch(f"job {job_id} gave no result in {timeout_s:.0f} s")


def main(device_name: str) -> int:
    """The copy check (``--copy-check``); prints a final ``copy-check: ...`` line."""
    _copy_check_imports()
    device = torch.device(device_name)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("copy-check: FAILED: torch sees no CUDA device")
        return 1
    backends, notes = _copy_backends(device)
    for note in notes:
        print(note)
    total = 0
    try:
        for case_id in COPY_CASES:
            case = CASE_BY_ID[case_id]
            for name, backend in backends.items():
                count = _copy_check_case(case, device, name, backend)
                total += count
                print(f"{case.id:34} {name:7} ok ({count} blocks)", flush=True)
    except Mismatch as exc:
        print(f"copy-check: FAILED: {exc}")
        return 1
    print(f"copy-check: {len(COPY_CASES)} layouts x {', '.join(backends)}: {total} blocks right"
          + (f" ({'; '.join(notes)})" if notes else ""))
    return 0


