"""Configuration: sizes, validation, and errors that name the key."""

from __future__ import annotations

import os

import pytest

from tieredkv.config import ConfigError, GiB, MiB, TieredKVConfig, parse_size


@pytest.mark.parametrize(
    ("raw", "expected"),
    [(1024, 1024), ("512MiB", 512 * MiB), ("8GiB", 8 * GiB), ("1.5GiB", int(1.5 * GiB)),
     ("2G", 2 * 1000**3), ("4096", 4096), (" 3 kib ", 3 * 1024), (0, 0)],
)
def test_sizes_parse(raw, expected):
    assert parse_size("host_bytes", raw) == expected


@pytest.mark.parametrize("raw", ["lots", "-1GiB", -5, "8 parsecs", True, None, [1], "1.2.3GiB"])
def test_bad_sizes_name_the_key_and_value(raw):
    with pytest.raises(ConfigError) as err:
        parse_size("disk_bytes", raw)
    assert "disk_bytes" in str(err.value)
    assert repr(raw) in str(err.value)


def test_defaults_and_per_rank_split():
    cfg = TieredKVConfig.from_dict({"host_bytes": "8GiB"})
    assert cfg.host_bytes == 8 * GiB and not cfg.has_disk
    assert cfg.host_bytes_per_rank(4) == 2 * GiB
    assert cfg.resolved(32).chunk_blocks == 8
    assert cfg.resolved(128).chunk_blocks == 2
    assert cfg.resolved(1024).chunk_blocks == 1
    assert TieredKVConfig.from_dict({"chunk_blocks": 3}).resolved(32).chunk_blocks == 3


def test_disk_tier_keys(tmp_path):
    cfg = TieredKVConfig.from_dict({"disk_path": str(tmp_path / "t"), "disk_bytes": "1GiB"})
    assert cfg.has_disk and cfg.disk_bytes_per_rank(2) == GiB // 2
    assert TieredKVConfig.from_dict({"disk_path": str(tmp_path)}).disk_bytes == 16 * GiB


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"hots_bytes": 1}, "hots_bytes"),
        ({"disk_bytes": "1GiB"}, "disk_bytes"),
        ({"eviction": "fifo"}, "eviction"),
        ({"disk_admission": 0}, "disk_admission"),
        ({"chunk_blocks": "x"}, "chunk_blocks"),
        ({"io_threads": 0}, "io_threads"),
        ({"io_threads": 1000}, "io_threads"),
        ({"copy_backend": "magic"}, "copy_backend"),
        ({"store_generated": "maybe"}, "store_generated"),
        ({"load_timeout_s": -1}, "load_timeout_s"),
        ({"metrics_port": 70000}, "metrics_port"),
    ],
)
def test_bad_values_fail_naming_the_key(extra, key):
    with pytest.raises(ConfigError) as err:
        TieredKVConfig.from_dict(extra)
    assert err.value.key == key
    assert key in str(err.value)


def test_disk_path_must_be_a_writable_directory(tmp_path):
    afile = tmp_path / "f"
    afile.write_text("x")
    with pytest.raises(ConfigError, match="disk_path"):
        TieredKVConfig.from_dict({"disk_path": str(afile)})
    locked = tmp_path / "ro"
    locked.mkdir()
    os.chmod(locked, 0o500)
    try:
        if os.geteuid() != 0:  # root can write anywhere
            with pytest.raises(ConfigError, match="not a writable"):
                TieredKVConfig.from_dict({"disk_path": str(locked)})
    finally:
        os.chmod(locked, 0o700)


def test_admission_forms():
    assert TieredKVConfig.from_dict({"disk_admission": "all"}).disk_admission == 1
    assert TieredKVConfig.from_dict({"disk_admission": "seen:3"}).disk_admission == 3
    assert TieredKVConfig.from_dict({"disk_admission": 2}).disk_admission == 2


@pytest.mark.parametrize("name", ["auto", "native", "torch", "cupy", "vllm", "NATIVE"])
def test_every_copy_backend_name_is_accepted(name):
    assert TieredKVConfig.from_dict({"copy_backend": name}).copy_backend == name.lower()
