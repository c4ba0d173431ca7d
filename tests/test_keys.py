"""Chunk keys: stable across processes, separated by namespace and by cache_salt."""

from __future__ import annotations

import subprocess
import sys

from tieredkv.keys import (
    KEY_PART_BYTES,
    LazyChunkKeys,
    Namespace,
    chunk_key,
    chunk_keys,
    key_from_part,
    key_part,
)
from tieredkv.testing.hashing import sha256_block_hashes

NS = Namespace(model="m", dtype="bf16", kv_layout="LBHNC", block_size=16, chunk_blocks=4,
               num_layers=4, num_kv_heads=2, head_size=64)


def test_keys_are_the_same_in_another_process():
    tokens = list(range(1000))
    here = [k.hex() for k in chunk_keys(NS.fingerprint(), sha256_block_hashes(tokens, 16), 4)]
    code = (
        "from tieredkv.keys import *; from tieredkv.testing.hashing import sha256_block_hashes;"
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


def test_keys_follow_block_hashes_truncated_in_place():
    """A streaming session truncates ``request.block_hashes`` in place and appends the next
    input's hashes: keys cached before must not survive for the replaced blocks."""
    fp = NS.fingerprint()
    first = sha256_block_hashes(list(range(640)), 16)  # 40 blocks = 10 chunks of 4
    hashes = list(first)
    keys = LazyChunkKeys(fp, hashes, 4)
    assert keys.materialize(10) == chunk_keys(fp, first, 4)
    # Keep 26 blocks (6 full chunks and a part), then append other tokens' blocks.
    other = sha256_block_hashes(list(range(416)) + [9] * 224, 16)
    del hashes[26:]
    hashes.extend(other[26:])
    assert keys.refresh() == 4  # chunks 6..9 named the old tokens
    assert keys.materialize(10) == chunk_keys(fp, other, 4)
    assert [keys[i] for i in range(10)] == chunk_keys(fp, other, 4)
    assert keys.refresh() == 0  # nothing changed since


def test_keys_are_dropped_when_the_list_shrinks_below_them():
    fp = NS.fingerprint()
    hashes = sha256_block_hashes(list(range(320)), 16)  # 5 chunks
    keys = LazyChunkKeys(fp, hashes, 4)
    keys.materialize(5)
    del hashes[9:]
    assert keys.refresh() == 3 and len(keys) == 2
    assert keys.materialize(5) == chunk_keys(fp, hashes, 4)


def test_lora_digest_separates_keys_and_plain_keys_stay_plain():
    fp = NS.fingerprint()
    hashes = sha256_block_hashes(list(range(256)), 16)
    plain = chunk_keys(fp, hashes, 4)
    a = LazyChunkKeys(fp, hashes, 4, extra=b"adapter-a").materialize(4)
    b = LazyChunkKeys(fp, hashes, 4, extra=b"adapter-b").materialize(4)
    assert set(plain).isdisjoint(a) and set(a).isdisjoint(b)
    assert all(key[-8:] == fp[:8] for key in a)  # still in the namespace
    assert plain == [h[:24] + fp[:8] for h in hashes[3::4]]


def test_block_keys_name_each_block_and_a_chunk_key_is_its_last_blocks():
    """An entry is keyed by its last block: a whole chunk's key is the block key of the
    chunk's last block, whatever the number of hashes per block."""
    fp = NS.fingerprint()
    hashes = sha256_block_hashes(list(range(640)), 8)  # 80 hash blocks of 8 tokens
    keys = LazyChunkKeys(fp, hashes, 8, hashes_per_block=2)  # 16-token blocks, 4 per chunk
    assert keys.block_granular and keys.num_blocks == 40 and len(keys) == 10
    for chunk in range(10):
        assert keys[chunk] == keys.block_key(4 * chunk + 3)
    assert keys.block_key(5) == chunk_key(fp, hashes[11])
    assert keys.block_keys(4, 7) == tuple(keys.block_key(b) for b in range(4, 7))
    lora = LazyChunkKeys(fp, hashes, 8, extra=b"adapter", hashes_per_block=2)
    assert lora.block_key(7) == lora[1] != keys[1]
    assert lora.block_keys(0, 2) == (chunk_key(fp, hashes[1], b"adapter"),
                                     chunk_key(fp, hashes[3], b"adapter"))
    assert not LazyChunkKeys(fp, hashes, 8).block_granular  # no block keys: whole chunks only
    del hashes[30:]  # truncated in place: block keys read the list as it is now
    assert keys.num_blocks == 15


def test_a_key_survives_the_trip_through_a_slot_header():
    fp = NS.fingerprint()
    key = chunk_key(fp, sha256_block_hashes(list(range(64)), 16)[3])
    assert len(key_part(key)) == KEY_PART_BYTES == 24
    assert key_from_part(key_part(key), fp) == key
