"""A real engine process SIGKILLed mid-write: the restarted catalog serves only exact bytes.

The child runs the scheduler's protocol for real (DiskCatalog + one SlabFile per rank, journal
REMOVE before reusing a slot, ADD after every rank wrote) in a tight loop; the parent kills it
at a random moment, several times over the same directory, and checks after each restart that
every recovered entry reads back its exact bytes on every rank, and that no slot on disk can
be read back as anything but its own key's bytes.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from tieredkv.disk.catalog import DiskCatalog
from tieredkv.disk.errors import SlabError
from tieredkv.disk.slab import SlabFile

PAYLOAD = 192 * 1024
SLOTS = 24
WORLD = 2

CHILD = r"""
import hashlib, sys, time
from pathlib import Path
from tieredkv.disk.catalog import DiskCatalog
from tieredkv.disk.slab import SlabFile

disk, start, PAYLOAD, SLOTS, WORLD = Path(sys.argv[1]), int(sys.argv[2]), *map(int, sys.argv[3:6])
FP = bytes.fromhex(sys.argv[6])
PAUSE = float(sys.argv[7])  # 0: as fast as the disk goes; >0: a slower, more typical spill rate

def make_key(i):
    return hashlib.sha256(f"key-{i}".encode()).digest()

def payload_for(key, rank, size):
    seed = hashlib.blake2b(key + rank.to_bytes(4, "little"), digest_size=64).digest()
    return (seed * (size // len(seed) + 1))[:size]

catalog = DiskCatalog.open(disk, FP, PAYLOAD, SLOTS, WORLD)
slabs = [SlabFile.open(catalog.slab_path(r), SLOTS, PAYLOAD, FP) for r in range(WORLD)]
owner = {slot: key for key, slot in catalog.recovered.items()}
print("ready", len(catalog.recovered), flush=True)
i = start
while True:
    key = make_key(i)
    slot = (i * 7) % SLOTS
    old = owner.pop(slot, None)
    if old is not None:
        catalog.record_removed(old)
    for rank, slab in enumerate(slabs):
        slab.write_slot(slot, key, payload_for(key, rank, PAYLOAD))
    catalog.record_written(key, slot)
    owner[slot] = key
    i += 1
    if PAUSE:
        time.sleep(PAUSE)
"""


def test_sigkill_mid_write_never_serves_wrong_bytes(
    tmp_path: Path, fp: bytes, key, payload, run_py
) -> None:
    disk = tmp_path / "tier"
    seed = int(os.environ.get("TIEREDKV_CRASH_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    recovered_any = False
    start = 0
    for round_ in range(6):
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(disk), str(start), str(PAYLOAD), str(SLOTS),
             str(WORLD), fp.hex(), "0" if round_ % 2 == 0 else "0.003"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line.startswith("ready"), (line, child.stderr.read() if child.stderr else "")
        time.sleep(rng.uniform(0.05, 0.6))
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        assert child.returncode == -signal.SIGKILL, f"seed {seed}: child exited on its own"
        start += 100_000  # fresh keys each round

        with DiskCatalog.open(disk, fp, PAYLOAD, SLOTS, WORLD) as catalog:
            recovered_any |= bool(catalog.recovered)
            out = bytearray(PAYLOAD)
            for rank in range(WORLD):
                with SlabFile.open(catalog.slab_path(rank), SLOTS, PAYLOAD, fp) as slab:
                    for k, slot in catalog.recovered.items():
                        slab.read_slot_into(slot, k, out)  # must not fail: verified entries
                        assert out == payload(k, rank, PAYLOAD), f"seed {seed} round {round_}"
                    # Every slot, journaled or not, either proves its own key's bytes or fails typed.
                    for slot in range(SLOTS):
                        try:
                            header = slab.read_header(slot)
                            slab.read_slot_into(slot, header.key, out)
                        except SlabError:
                            continue
                        assert out == payload(header.key, rank, PAYLOAD), f"seed {seed} slot {slot}"
    assert recovered_any, f"seed {seed}: no round journaled anything before its kill"
