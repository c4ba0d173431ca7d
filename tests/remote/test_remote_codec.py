"""Remote values prove what they hold: every kind of bad value is rejected with its cause."""

from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.remote.remote_helpers import FINGERPRINT, OTHER_FINGERPRINT, make_key, payload_for
from tieredkv.protocol import FAILURE_CAUSES, FailureCause
from tieredkv.remote import codec
from tieredkv.remote.codec import HEADER_BYTES, Rejected, Verified, decode, encode, remote_key

KEY = make_key(1)
PAYLOAD = payload_for(KEY, 0, 5000)


def _good() -> bytes:
    return encode(PAYLOAD, fingerprint=FINGERPRINT, key=KEY, rank=0)


def _decode(value: bytes | None, **overrides: object) -> Verified | Rejected:
    args: dict[str, object] = {"fingerprint": FINGERPRINT, "key": KEY, "rank": 0}
    args.update(overrides)
    return decode(value, **args)  # type: ignore[arg-type]


def _with_header(**fields: object) -> bytes:
    """A value whose header is rewritten (and re-checksummed): a *well-formed* foreign value."""
    value = bytearray(_good())
    names = ("magic", "version", "flags", "rank", "fingerprint", "key", "length", "checksum")
    current = dict(zip(names, codec._FIELDS.unpack_from(value), strict=True))
    current.update(fields)
    codec._FIELDS.pack_into(value, 0, *(current[n] for n in names))
    struct.pack_into("<I", value, codec._FIELDS.size, zlib.crc32(value[: codec._FIELDS.size]))
    return bytes(value)


def test_round_trip_is_zero_copy() -> None:
    value = _good()
    assert len(value) == HEADER_BYTES + len(PAYLOAD)
    result = _decode(value, expected_len=len(PAYLOAD))
    assert isinstance(result, Verified) and result.ok
    assert result.payload == PAYLOAD and result.payload.obj is value  # a view, not a copy


def _flip(value: bytes, offset: int) -> bytes:
    out = bytearray(value)
    out[offset] ^= 0x40
    return bytes(out)


@pytest.mark.parametrize(
    ("name", "make", "overrides", "cause"),
    [
        ("absent", lambda: None, {}, FailureCause.MISSING),
        ("payload bit flip", lambda: _flip(_good(), HEADER_BYTES + 1234), {}, FailureCause.CHECKSUM),
        ("header bit flip", lambda: _flip(_good(), 60), {}, FailureCause.CHECKSUM),
        ("foreign text", lambda: b"just some application's cached JSON {}" * 5, {}, FailureCause.CHECKSUM),
        ("tiny foreign value", lambda: b"1", {}, FailureCause.SHORT_READ),
        ("header cut", lambda: _good()[: HEADER_BYTES - 1], {}, FailureCause.SHORT_READ),
        ("payload cut", lambda: _good()[:-1], {}, FailureCause.SHORT_READ),
        ("trailing bytes", lambda: _good() + b"\0", {}, FailureCause.CHECKSUM),
        ("other namespace", lambda: encode(PAYLOAD, fingerprint=OTHER_FINGERPRINT, key=KEY, rank=0),
         {}, FailureCause.WRONG_NAMESPACE),
        ("other format version", lambda: _with_header(version=codec.FORMAT_VERSION + 1), {},
         FailureCause.WRONG_NAMESPACE),
        ("other geometry", _good, {"expected_len": len(PAYLOAD) + 4096}, FailureCause.WRONG_NAMESPACE),
        ("other chunk", lambda: encode(PAYLOAD, fingerprint=FINGERPRINT, key=make_key(2), rank=0),
         {}, FailureCause.WRONG_KEY),
        ("other rank", lambda: encode(PAYLOAD, fingerprint=FINGERPRINT, key=KEY, rank=1),
         {}, FailureCause.WRONG_KEY),
        ("lying length", lambda: _with_header(length=len(PAYLOAD) + 1), {}, FailureCause.SHORT_READ),
    ],
)
def test_bad_values_are_rejected_with_cause(
    name: str, make: object, overrides: dict[str, object], cause: FailureCause
) -> None:
    result = _decode(make(), **overrides)  # type: ignore[operator]
    assert isinstance(result, Rejected), name
    assert not result.ok and result.cause is cause and result.detail
    assert result.cause.value in FAILURE_CAUSES  # the counters' label set


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.integers(min_value=0, max_value=HEADER_BYTES + 64))
def test_decode_never_raises_and_never_accepts_garbage(garbage: bytes, cut: int) -> None:
    assert isinstance(_decode(garbage), Rejected)
    good = _good()
    spliced = good[:cut] + garbage + good[cut + len(garbage):]
    result = _decode(spliced)
    if spliced != good:
        assert isinstance(result, Rejected)


def test_remote_key_layout() -> None:
    name = remote_key(FINGERPRINT, 3, KEY, "tkv")
    assert name == f"tkv:{FINGERPRINT.hex()[:16]}:r3:{{{KEY.hex()}}}".encode()
    names = {
        remote_key(FINGERPRINT, 0, KEY), remote_key(FINGERPRINT, 1, KEY),
        remote_key(OTHER_FINGERPRINT, 0, KEY), remote_key(FINGERPRINT, 0, make_key(2)),
        remote_key(FINGERPRINT, 0, KEY, "other"),
    }
    assert len(names) == 5


def test_remote_key_hash_tag_puts_ranks_in_one_cluster_slot() -> None:
    from redis.crc import key_slot

    slots = {key_slot(remote_key(FINGERPRINT, rank, KEY)) for rank in range(8)}
    assert len(slots) == 1
    spread = {key_slot(remote_key(FINGERPRINT, 0, make_key(i))) for i in range(100)}
    assert len(spread) > 90


@pytest.mark.parametrize("prefix", ["", "a{b", "a}b", "a:b", "a b", "tab\t"])
def test_bad_prefix(prefix: str) -> None:
    with pytest.raises(ValueError, match="prefix"):
        remote_key(FINGERPRINT, 0, KEY, prefix)


def test_bad_ids_raise_on_encode() -> None:
    with pytest.raises(ValueError, match="fingerprint"):
        encode(b"x", fingerprint=b"short", key=KEY, rank=0)
    with pytest.raises(ValueError, match="key"):
        encode(b"x", fingerprint=FINGERPRINT, key=b"short", rank=0)
    with pytest.raises(ValueError, match="rank"):
        encode(b"x", fingerprint=FINGERPRINT, key=KEY, rank=-1)


def test_a_value_received_as_header_and_payload_apart_is_verified_the_same():
    """A value whose payload was received into a host slot (its header aside) verifies as
    the whole value would, and fails as it would: a flipped payload byte, a header cut short,
    a payload of another length."""
    good = _good()
    head, body = memoryview(good)[:HEADER_BYTES], bytearray(good[HEADER_BYTES:])
    got = _decode(head, payload=memoryview(body), value_len=len(good), expected_len=len(PAYLOAD))
    assert isinstance(got, Verified) and bytes(got.payload) == PAYLOAD
    body[1234] ^= 1
    assert _decode(head, payload=memoryview(body), value_len=len(good)).cause is FailureCause.CHECKSUM
    body[1234] ^= 1
    assert _decode(head[:-1], payload=memoryview(body)).cause is FailureCause.SHORT_READ
    assert _decode(head, payload=memoryview(body)[:-1]).cause is FailureCause.SHORT_READ
    assert _decode(head, payload=memoryview(body + b"x")).cause is FailureCause.CHECKSUM
