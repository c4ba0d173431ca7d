"""Manifest: JSON on disk, atomic, and None (never a crash) when it cannot be trusted."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tieredkv.disk.catalog import Manifest, load_manifest, write_manifest
from tieredkv.disk.format import FORMAT_VERSION, MANIFEST_NAME, manifest_path, slot_stride


def make(fp: bytes, **kw: object) -> Manifest:
    args = dict(payload_bytes=1 << 20, slot_stride=slot_stride(1 << 20), num_slots=64, world_size=2)
    args.update(kw)
    return Manifest.new(fp, **args)  # type: ignore[arg-type]


def test_roundtrip_json_0600(tmp_path: Path, fp: bytes) -> None:
    manifest = make(fp)
    write_manifest(tmp_path, manifest)
    file = manifest_path(tmp_path)
    assert file.stat().st_mode & 0o777 == 0o600
    raw = json.loads(file.read_text())
    assert raw["fingerprint"] == fp.hex() and raw["format_version"] == FORMAT_VERSION
    assert load_manifest(tmp_path) == manifest
    assert load_manifest(file) == manifest
    assert not (tmp_path / (MANIFEST_NAME + ".tmp")).exists()


@pytest.mark.parametrize(
    "content",
    [b"", b"{not json", b"[]", b'{"format_version": 1}', b'{"format_version": "x"}', b"\xff\xfe"],
)
def test_corrupt_manifest_is_none_with_warning(
    tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    manifest_path(tmp_path).write_bytes(content)
    with caplog.at_level(logging.WARNING):
        assert load_manifest(tmp_path) is None
    assert "unreadable manifest" in caplog.text


def test_missing_manifest_is_none(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert load_manifest(tmp_path) is None
    assert "no manifest" in caplog.text


def test_mismatch_reasons(fp: bytes, other_fp: bytes) -> None:
    manifest = make(fp)
    stride = slot_stride(1 << 20)
    assert manifest.mismatch(fp, 1 << 20, stride, 2) is None
    assert "fingerprint" in (manifest.mismatch(other_fp, 1 << 20, stride, 2) or "")
    assert "payload_bytes" in (manifest.mismatch(fp, 1 << 19, stride, 2) or "")
    assert "stride" in (manifest.mismatch(fp, 1 << 20, stride + 4096, 2) or "")
    assert "world size" in (manifest.mismatch(fp, 1 << 20, stride, 4) or "")
    old = Manifest(FORMAT_VERSION + 1, fp.hex(), 1 << 20, stride, 64, 2, 0.0)
    assert "format version" in (old.mismatch(fp, 1 << 20, stride, 2) or "")
