"""Chunk keys: stable across processes, separated by namespace and by cache_salt."""

from __future__ import annotations

import subprocess
import sys

from tieredkv.keys import LazyChunkKeys, Namespace, chunk_key, chunk_keys, sha256_block_hashes

NS = Namespace(model="m", dtype="bf16", kv_layout="LBHNC", block_size=16, chunk_blocks=4,
               num_layers=4, num_kv_heads=2, head_size=64)


def test_keys_are_the_same_in_another_process():
    tokens = list(range(1000))
    here = [k.hex() for k in chunk_keys(NS.fingerprint(), sha256_block_hashes(tokens, 16), 4)]
    code = (
        "from tieredkv.keys import *;"
        "ns = Namespace(model='m', dtype='bf16', kv_layout='LBHNC', block_size=16, chunk_blocks=4,"
        " num_layers=4, num_kv_heads=2, head_size=64);"
        "print(','.join(k.hex() for k in chunk_keys(ns.fingerprint(), sha256_block_hashes(list(range(1000)), 16), 4)))"
    )
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert there.stdout.strip().split(",") == here
    assert len(here) == 1000 // 64


def test_namespace_and_salt_separate_keys():
    tokens = list(range(256))
    hashes = sha256_block_hashes(tokens, 16)
    other_ns = Namespace(**{**NS.__dict__, "tp_size": 2})
    assert chunk_keys(NS.fingerprint(), hashes, 4) != chunk_keys(other_ns.fingerprint(), hashes, 4)
    salted = sha256_block_hashes(tokens, 16, salt="tenant-b")
    assert set(chunk_keys(NS.fingerprint(), hashes, 4)).isdisjoint(chunk_keys(NS.fingerprint(), salted, 4))


def test_a_key_covers_the_whole_prefix():
    a = list(range(128))
    b = [7] + a[1:]  # differs only in the first token
    fp = NS.fingerprint()
    assert chunk_keys(fp, sha256_block_hashes(a, 16), 4)[1] != chunk_keys(fp, sha256_block_hashes(b, 16), 4)[1]


def test_lazy_keys_match_eager_keys_and_grow_with_the_request():
    fp = NS.fingerprint()
    hashes = sha256_block_hashes(list(range(640)), 16)
    lazy = LazyChunkKeys(fp, hashes, 4)
    assert len(lazy) == 10
    assert lazy[3] == chunk_key(fp, hashes[15])
    assert lazy.materialize(99) == chunk_keys(fp, hashes, 4)
    hashes.extend(sha256_block_hashes(list(range(704)), 16)[40:])  # the request grew
    assert len(lazy) == 11 and lazy[10] == chunk_key(fp, hashes[43])
    short = chunk_key(fp, b"\x01" * 8)  # non-crypto hashes may be short
    assert len(short) == 32
