"""Slot header format: exact layout, round trips, and one typed failure per kind of damage."""

from __future__ import annotations

import struct
import zlib

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from tieredkv.disk.errors import SlabError
from tieredkv.disk.format import (
    FORMAT_VERSION,
    HEADER_BYTES,
    HEADER_USED,
    MAGIC,
    MAX_HEADER_ALIASES,
    aliases_kept,
    pack_header,
    pack_header_into,
    payload_checksum,
    slab_path,
    unpack_header,
)
from tieredkv.keys import KEY_PART_BYTES
from tieredkv.protocol import FailureCause

FP = bytes(range(32))
KEY = bytes(range(32, 64))


def header(**kw: object) -> bytes:
    args = dict(fingerprint=FP, key=KEY, payload_len=524288, checksum=0x1234, sequence=7)
    args.update(kw)
    return pack_header(**args)  # type: ignore[arg-type]


def test_layout_is_fixed_and_padded() -> None:
    raw = header()
    assert len(raw) == HEADER_BYTES == 4096
    assert raw[:8] == MAGIC == b"TKVSLAB1"
    assert struct.unpack_from("<HH", raw, 8) == (FORMAT_VERSION, 0) == (2, 0)
    assert raw[12:44] == FP and raw[44:76] == KEY
    assert struct.unpack_from("<QQQHH", raw, 76) == (524288, 0x1234, 7, 0, 0)
    assert struct.unpack_from("<I", raw, 104)[0] == zlib.crc32(raw[:104])
    assert HEADER_USED == 108
    assert raw[HEADER_USED:] == bytes(HEADER_BYTES - HEADER_USED)


def alias(i: int) -> bytes:
    return bytes([i]) * KEY_PART_BYTES + FP[:8]  # a key in FP's namespace


def test_alias_table_layout_and_roundtrip() -> None:
    aliases = (alias(1), alias(2), alias(3))
    raw = header(aliases=aliases)
    assert struct.unpack_from("<HH", raw, 100) == (3, 0)
    table = raw[HEADER_USED : HEADER_USED + 3 * 24]
    assert table == b"".join(a[:24] for a in aliases)
    assert struct.unpack_from("<I", raw, 104)[0] == zlib.crc32(table, zlib.crc32(raw[:104]))
    assert raw[HEADER_USED + 72 :] == bytes(HEADER_BYTES - HEADER_USED - 72)
    assert unpack_header(raw).aliases == aliases
    assert unpack_header(header()).aliases == ()
    most = tuple(alias(i % 256) for i in range(MAX_HEADER_ALIASES))
    assert MAX_HEADER_ALIASES == 166 and unpack_header(header(aliases=most)).aliases == most
    with pytest.raises(ValueError):
        header(aliases=(*most, alias(0)))
    with pytest.raises(ValueError):  # not a key of this namespace: could not be rebuilt
        header(aliases=(bytes(32),))


def test_aliases_kept_are_those_a_header_lists_and_no_more() -> None:
    """What the scheduler asks before a spill: every alias while they fit one header (and
    they do pack), none past that (the entry's own key is then all a restart finds)."""
    most = tuple(alias(i % 256) for i in range(MAX_HEADER_ALIASES))
    assert aliases_kept(most) == most
    assert unpack_header(header(aliases=aliases_kept(most))).aliases == most
    assert aliases_kept((*most, alias(0))) == ()
    assert aliases_kept(()) == ()


def test_a_flipped_bit_in_the_alias_table_is_a_checksum_failure() -> None:
    raw = bytearray(header(aliases=(alias(1), alias(2))))
    raw[HEADER_USED + 30] ^= 0x01
    with pytest.raises(SlabError) as err:
        unpack_header(raw)
    assert err.value.kind is FailureCause.CHECKSUM
    raw = bytearray(header(aliases=(alias(1), alias(2))))
    struct.pack_into("<H", raw, 100, 1)  # a count that disagrees with the checksum
    with pytest.raises(SlabError) as err:
        unpack_header(raw)
    assert err.value.kind is FailureCause.CHECKSUM


def test_roundtrip() -> None:
    parsed = unpack_header(header())
    assert (parsed.fingerprint, parsed.key, parsed.payload_len) == (FP, KEY, 524288)
    assert (parsed.checksum, parsed.sequence, parsed.version, parsed.flags) == (0x1234, 7, 2, 0)


@given(
    fp=st.binary(min_size=32, max_size=32),
    key=st.binary(min_size=32, max_size=32),
    length=st.integers(0, 2**64 - 1),
    checksum=st.integers(0, 2**64 - 1),
    sequence=st.integers(0, 2**64 - 1),
    flags=st.integers(0, 2**16 - 1),
)
def test_roundtrip_property(fp: bytes, key: bytes, length: int, checksum: int, sequence: int, flags: int) -> None:
    raw = pack_header(fingerprint=fp, key=key, payload_len=length, checksum=checksum,
                      sequence=sequence, flags=flags)
    parsed = unpack_header(raw)
    assert (parsed.fingerprint, parsed.key, parsed.payload_len) == (fp, key, length)
    assert (parsed.checksum, parsed.sequence, parsed.flags) == (checksum, sequence, flags)


def test_pack_into_overwrites_stale_bytes() -> None:
    buf = bytearray(b"\xff" * HEADER_BYTES)
    pack_header_into(buf, fingerprint=FP, key=KEY, payload_len=1, checksum=2, sequence=3)
    assert bytes(buf) == header(payload_len=1, checksum=2, sequence=3)


def test_zeroed_header_is_missing() -> None:
    with pytest.raises(SlabError) as err:
        unpack_header(bytes(HEADER_BYTES), slot=5, path=slab_path("/x", 0))
    assert err.value.kind is FailureCause.MISSING
    assert "slot 5" in str(err.value) and "/x/rank0.slab" in str(err.value)


@pytest.mark.parametrize("byte", [0, 7, 9, 12, 50, 80, 90, 99, 100, 102, 103, 104, 107])
def test_any_flipped_bit_is_a_checksum_failure(byte: int) -> None:
    raw = bytearray(header())
    raw[byte] ^= 0x10
    with pytest.raises(SlabError) as err:
        unpack_header(raw)
    assert err.value.kind is FailureCause.CHECKSUM


def test_garbage_is_a_checksum_failure_not_missing() -> None:
    with pytest.raises(SlabError) as err:
        unpack_header(b"\x01" + bytes(HEADER_BYTES - 1))
    assert err.value.kind is FailureCause.CHECKSUM


def test_other_format_version_is_wrong_namespace() -> None:
    raw = bytearray(header())
    struct.pack_into("<H", raw, 8, FORMAT_VERSION + 1)
    struct.pack_into("<I", raw, 104, zlib.crc32(bytes(raw[:104])))
    with pytest.raises(SlabError) as err:
        unpack_header(raw)
    assert err.value.kind is FailureCause.WRONG_NAMESPACE


def test_a_version_1_header_is_wrong_namespace_not_corruption() -> None:
    """Version 1 had no alias fields and its checksum at offset 100 (of bytes 0..99)."""
    raw = bytearray(HEADER_BYTES)
    struct.pack_into("<8sHH32s32sQQQ", raw, 0, MAGIC, 1, 0, FP, KEY, 524288, 0x1234, 7)
    struct.pack_into("<I", raw, 100, zlib.crc32(bytes(raw[:100])))
    with pytest.raises(SlabError) as err:
        unpack_header(raw)
    assert err.value.kind is FailureCause.WRONG_NAMESPACE
    assert "format version 1" in str(err.value)


def test_truncated_header_is_short_read() -> None:
    with pytest.raises(SlabError) as err:
        unpack_header(header()[:50])
    assert err.value.kind is FailureCause.SHORT_READ


def test_bad_ids_are_programming_errors() -> None:
    with pytest.raises(ValueError):
        header_args = dict(fingerprint=FP[:31], key=KEY, payload_len=1, checksum=1, sequence=1)
        pack_header(**header_args)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        pack_header(fingerprint=FP, key=KEY + b"x", payload_len=1, checksum=1, sequence=1)


def test_payload_checksum_is_xxh3_64() -> None:
    data = bytes(range(256)) * 100
    assert payload_checksum(memoryview(data)) == xxhash.xxh3_64_intdigest(data)
    assert payload_checksum(data) != payload_checksum(data[:-1] + b"\x00")
