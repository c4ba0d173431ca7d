"""Slot header format: exact layout, round trips, and one typed failure per kind of damage."""

from __future__ import annotations

import struct
import zlib

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from tieredkv.disk.errors import FailureKind, SlabError
from tieredkv.disk.format import (
    FORMAT_VERSION,
    HEADER_BYTES,
    HEADER_USED,
    MAGIC,
    align_up,
    pack_header,
    pack_header_into,
    payload_checksum,
    slot_stride,
    unpack_header,
)

FP = bytes(range(32))
KEY = bytes(range(32, 64))


def header(**kw: int) -> bytes:
    args = dict(fingerprint=FP, key=KEY, payload_len=524288, checksum=0x1234, sequence=7)
    args.update(kw)
    return pack_header(**args)  # type: ignore[arg-type]


def test_layout_is_fixed_and_padded() -> None:
    raw = header()
    assert len(raw) == HEADER_BYTES == 4096
    assert raw[:8] == MAGIC == b"TKVSLAB1"
    assert struct.unpack_from("<HH", raw, 8) == (FORMAT_VERSION, 0)
    assert raw[12:44] == FP and raw[44:76] == KEY
    assert struct.unpack_from("<QQQ", raw, 76) == (524288, 0x1234, 7)
    assert struct.unpack_from("<I", raw, 100)[0] == zlib.crc32(raw[:100])
    assert HEADER_USED == 104
    assert raw[HEADER_USED:] == bytes(HEADER_BYTES - HEADER_USED)


def test_roundtrip() -> None:
    parsed = unpack_header(header())
    assert (parsed.fingerprint, parsed.key, parsed.payload_len) == (FP, KEY, 524288)
    assert (parsed.checksum, parsed.sequence, parsed.version, parsed.flags) == (0x1234, 7, 1, 0)


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
        unpack_header(bytes(HEADER_BYTES), slot=5, path="/x/rank0.slab")
    assert err.value.kind is FailureKind.MISSING
    assert "slot 5" in str(err.value) and "/x/rank0.slab" in str(err.value)


@pytest.mark.parametrize("byte", [0, 7, 9, 12, 50, 80, 90, 99, 100, 103])
def test_any_flipped_bit_is_a_checksum_failure(byte: int) -> None:
    raw = bytearray(header())
    raw[byte] ^= 0x10
    with pytest.raises(SlabError) as err:
        unpack_header(raw)
    assert err.value.kind is FailureKind.CHECKSUM


def test_garbage_is_a_checksum_failure_not_missing() -> None:
    with pytest.raises(SlabError) as err:
        unpack_header(b"\x01" + bytes(HEADER_BYTES - 1))
    assert err.value.kind is FailureKind.CHECKSUM


def test_other_format_version_is_wrong_namespace() -> None:
    raw = bytearray(header())
    struct.pack_into("<H", raw, 8, FORMAT_VERSION + 1)
    struct.pack_into("<I", raw, 100, zlib.crc32(bytes(raw[:100])))
    with pytest.raises(SlabError) as err:
        unpack_header(raw)
    assert err.value.kind is FailureKind.WRONG_NAMESPACE


def test_truncated_header_is_short_read() -> None:
    with pytest.raises(SlabError) as err:
        unpack_header(header()[:50])
    assert err.value.kind is FailureKind.SHORT_READ


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


def test_geometry() -> None:
    assert align_up(1) == 4096 and align_up(4096) == 4096 and align_up(4097) == 8192
    assert slot_stride(512 * 1024) == 4096 + 512 * 1024
    assert slot_stride(1000) == 8192
