"""Configuration: sizes, validation, and errors that name the key."""

from __future__ import annotations

import json
import math
import os
from dataclasses import fields

import pytest

import tieredkv.config as config_module
from tieredkv.config import (
    MAX_SIZE_BYTES,
    ConfigError,
    GiB,
    MiB,
    TiB,
    TieredKVConfig,
    parse_size,
    physical_memory_bytes,
)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [(1024, 1024), ("512MiB", 512 * MiB), ("8GiB", 8 * GiB), ("1.5GiB", int(1.5 * GiB)),
     ("2G", 2 * 1000**3), ("4096", 4096), (" 3 kib ", 3 * 1024), (0, 0)],
)
def test_sizes_parse(raw, expected):
    assert parse_size("host_bytes", raw) == expected


@pytest.mark.parametrize("raw", ["lots", "-1GiB", -5, "8 parsecs", True, None, [1], "1.2.3GiB"])
def test_bad_sizes_name_the_key_not_the_value(raw):
    with pytest.raises(ConfigError) as err:
        parse_size("disk_bytes", raw)
    assert str(err.value).startswith("tieredkv: invalid disk_bytes: ") and "expected" in str(err.value)
    assert err.value.value is None


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


# ---------------------------------------------------------------- bounds (issue 10, point 3)

NAN, INF = float("nan"), float("inf")


def _fails_naming(extra: dict, key: str) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        TieredKVConfig.from_dict(extra)
    assert err.value.key == key
    assert key in str(err.value)
    return err.value


def test_vllm_json_parser_really_yields_nan_and_infinity():
    """The premise: vLLM's json.loads accepts these literals, so they do reach from_dict."""
    extra = json.loads('{"load_timeout_s": NaN, "a": Infinity, "b": -Infinity}')
    assert math.isnan(extra["load_timeout_s"]) and extra["a"] == INF and extra["b"] == -INF


@pytest.mark.parametrize("raw", [NAN, INF, -INF, 1e30, 10**400, 0, 0.0, -0.5, 3600.5, 86400, "30", None, True])
def test_load_timeout_must_be_finite_and_in_range(raw):
    err = _fails_naming({"load_timeout_s": raw}, "load_timeout_s")
    assert "(0, 3600]" in str(err)


@pytest.mark.parametrize("raw", [0.01, 1, 30, 3600, 3600.0])
def test_load_timeout_in_range_is_kept(raw):
    assert TieredKVConfig.from_dict({"load_timeout_s": raw}).load_timeout_s == float(raw)


@pytest.mark.parametrize(
    ("key", "raw", "bounds"),
    [
        ("chunk_blocks", NAN, "from 1 to 1024"),
        ("chunk_blocks", INF, "from 1 to 1024"),
        ("chunk_blocks", 1e30, "from 1 to 1024"),
        ("chunk_blocks", "1e30", "from 1 to 1024"),
        ("chunk_blocks", 10**30, "from 1 to 1024"),
        ("chunk_blocks", 1025, "from 1 to 1024"),
        ("chunk_blocks", 0, "from 1 to 1024"),
        ("chunk_blocks", -1, "from 1 to 1024"),
        ("spill_queue_depth", NAN, "from 1 to 65536"),
        ("spill_queue_depth", -INF, "from 1 to 65536"),
        ("spill_queue_depth", 65537, "from 1 to 65536"),
        ("spill_queue_depth", 0, "from 1 to 65536"),
        ("spill_queue_depth", "9" * 5000, "from 1 to 65536"),
        ("io_threads", INF, "from 1 to 64"),
        ("io_threads", 65, "from 1 to 64"),
        ("disk_admission", NAN, "from 1 to 1000"),
        ("disk_admission", 1001, "from 1 to 1000"),
        ("disk_admission", "seen:1e30", "from 1 to 1000"),
        ("metrics_port", INF, "from 0 to 65535"),
        ("metrics_port", -1, "from 0 to 65535"),
        ("metrics_port", 65536, "from 0 to 65535"),
    ],
)
def test_integer_keys_are_finite_and_bounded(key, raw, bounds):
    err = _fails_naming({key: raw}, key)
    assert bounds in str(err)


def test_integer_keys_at_their_bounds_are_accepted():
    cfg = TieredKVConfig.from_dict(
        {"chunk_blocks": 1024, "spill_queue_depth": 65536, "io_threads": 64, "disk_admission": 1000,
         "metrics_port": 65535}
    )
    assert (cfg.chunk_blocks, cfg.spill_queue_depth, cfg.io_threads, cfg.disk_admission) == (1024, 65536, 64, 1000)
    assert TieredKVConfig.from_dict({"spill_queue_depth": "1", "metrics_port": 0}).spill_queue_depth == 1


def test_defaults_are_unchanged():
    cfg = TieredKVConfig.from_dict({})
    assert cfg == TieredKVConfig()
    assert (cfg.host_bytes, cfg.disk_bytes, cfg.chunk_blocks, cfg.io_threads) == (4 * GiB, 0, 0, 2)
    assert (cfg.load_timeout_s, cfg.spill_queue_depth, cfg.disk_admission, cfg.metrics_port) == (30.0, 64, 1, None)


@pytest.mark.parametrize(
    "raw",
    [NAN, INF, -INF, 1e30, 1e308, "1e30", "1E30GiB", "nan", "inf", "Infinity", 10**30, "9" * 400 + "TiB",
     "9" * 5000, 2.5, MAX_SIZE_BYTES + 1, "1025TiB", "٣GiB"],
)
@pytest.mark.parametrize("key", ["host_bytes", "disk_bytes"])
def test_sizes_reject_nan_infinity_and_huge_values_naming_the_key(key, raw):
    with pytest.raises(ConfigError) as err:  # never OverflowError / ValueError from int(inf)
        parse_size(key, raw)
    assert err.value.key == key
    assert key in str(err.value)


def test_size_upper_bound_is_one_pib_inclusive():
    assert parse_size("disk_bytes", "1024TiB") == MAX_SIZE_BYTES
    assert parse_size("disk_bytes", float(MAX_SIZE_BYTES)) == MAX_SIZE_BYTES
    assert parse_size("host_bytes", "0.5KiB") == 512


@pytest.mark.parametrize("raw", [NAN, INF, -INF, 1e30, "1e30", 0, "0GiB", -1])
def test_host_bytes_bad_values_fail_in_from_dict(raw):
    _fails_naming({"host_bytes": raw}, "host_bytes")


def test_host_bytes_above_physical_memory_fails_saying_what_the_machine_has():
    physical = physical_memory_bytes()
    if physical is None:
        pytest.skip("this OS does not report its physical memory")
    err = _fails_naming({"host_bytes": physical + 4096}, "host_bytes")
    assert str(physical) in str(err)
    assert TieredKVConfig.from_dict({"host_bytes": physical}).host_bytes == physical


def test_one_tib_of_host_memory_on_a_smaller_machine_fails(monkeypatch):
    monkeypatch.setattr(config_module, "physical_memory_bytes", lambda: 64 * GiB)
    err = _fails_naming({"host_bytes": "1TiB"}, "host_bytes")
    assert "64GiB" in str(err) and str(64 * GiB) in str(err)
    assert TieredKVConfig.from_dict({"host_bytes": "64GiB"}).host_bytes == 64 * GiB


def test_host_bytes_unchecked_where_the_os_does_not_report_memory(monkeypatch):
    monkeypatch.setattr(config_module, "physical_memory_bytes", lambda: None)
    assert TieredKVConfig.from_dict({"host_bytes": "1TiB"}).host_bytes == TiB


def test_disk_bytes_above_the_filesystem_capacity_fails(tmp_path):
    stat = os.statvfs(tmp_path)
    capacity = stat.f_blocks * stat.f_frsize
    # A disk_path that does not exist yet is measured on the filesystem that will hold it.
    for path in (tmp_path, tmp_path / "not" / "yet"):
        err = _fails_naming({"disk_path": str(path), "disk_bytes": capacity + 4096}, "disk_bytes")
        assert str(capacity) in str(err)
    assert TieredKVConfig.from_dict({"disk_path": str(tmp_path), "disk_bytes": capacity}).disk_bytes == capacity


def test_disk_bytes_on_a_tiny_filesystem(monkeypatch, tmp_path):
    monkeypatch.setattr(config_module, "filesystem_capacity_bytes", lambda path: 10 * GiB)
    err = _fails_naming({"disk_path": str(tmp_path), "disk_bytes": "1TiB"}, "disk_bytes")
    assert "10GiB" in str(err)


@pytest.mark.parametrize("raw", [NAN, INF, -INF, 1e30, "1e30", "2048TiB", -1])
def test_disk_bytes_bad_values_fail_in_from_dict(tmp_path, raw):
    _fails_naming({"disk_path": str(tmp_path), "disk_bytes": raw}, "disk_bytes")
    _fails_naming({"disk_bytes": raw}, "disk_bytes")  # without disk_path too


def test_disk_bytes_zero_still_means_no_disk_tier(tmp_path):
    cfg = TieredKVConfig.from_dict({"disk_path": str(tmp_path), "disk_bytes": 0})
    assert cfg.disk_bytes == 0 and not cfg.has_disk


def test_every_numeric_key_rejects_nan_and_infinity(tmp_path):
    numeric = ["host_bytes", "disk_bytes", "disk_admission", "chunk_blocks", "io_threads",
               "load_timeout_s", "spill_queue_depth", "metrics_port", "remote_timeout_s",
               "remote_ttl_s", "remote_admission", "remote_write_queue_bytes",
               "cost_model_margin"]
    # A numeric key added later must join this list (and get a stated range).
    assert {f.name for f in fields(TieredKVConfig) if f.type in ("int", "float", "int | None")} == set(numeric)
    for key in numeric:
        for raw in (NAN, INF, -INF, 1e30):
            extra = {key: raw}
            if key == "disk_bytes":
                extra["disk_path"] = str(tmp_path)
            if key.startswith("remote_"):
                extra["remote_url"] = "redis://127.0.0.1:6379/0"
            _fails_naming(extra, key)


# ------------------------------------------------- no value in any error (issue 23, point 6)

# A valid environment variable name, so that remote_password_env gets past its name check.
SENTINEL = "S3CRET_sentinel_7f3a"
_REMOTE_BASE = {"remote_url": "redis://127.0.0.1:6379/0"}
_WRONG_TYPES = [SENTINEL, [SENTINEL], {SENTINEL: SENTINEL}, SENTINEL.encode(), (SENTINEL, 1)]
_BAD_URLS = [
    SENTINEL, f"redis://h:{SENTINEL}", f"redis://h/{SENTINEL}", f"redis://h?password={SENTINEL}",
    f"http://u:{SENTINEL}@h", f"redis://:{SENTINEL}@h", f"redis://{SENTINEL}:{SENTINEL}@h:1",
    f"redis://[{SENTINEL}]:1", f"redis://h1,{SENTINEL}", f"redis+cluster://h:1/{SENTINEL}",
    f"{SENTINEL}://h", f"redis://{SENTINEL} x", ["redis://h:1", SENTINEL],
    ["redis://h:1", f"redis://h2:{SENTINEL}"], [f"redis://:{SENTINEL}@h1", "redis://h2"],
]


def _secret_cases(tmp_path) -> list[tuple[str, dict]]:
    """(key, extra) for every key and a bad value of every type, each holding SENTINEL."""
    cases: list[tuple[str, dict]] = [("bogus_key", {"bogus_key": SENTINEL})]
    for key in (f.name for f in fields(TieredKVConfig)):
        if key == "remote_url":
            cases += [(key, {key: url}) for url in _BAD_URLS]
            continue
        base = _REMOTE_BASE if key.startswith("remote_") else (
            {"disk_path": str(tmp_path)} if key == "disk_bytes" else {})
        if key == "remote_key_prefix":  # the sentinel is a valid prefix: break the rules
            cases += [(key, {**base, key: SENTINEL + bad}) for bad in ("*", "?", "[x]", "\\", "é", ":")]
        cases += [(key, {**base, key: value}) for value in _WRONG_TYPES
                  if key != "disk_path" and not (key == "remote_key_prefix" and value == SENTINEL)]
        if key.startswith("remote_"):  # without remote_url, these are refused first
            cases.append((key, {key: SENTINEL}))
    afile = tmp_path / SENTINEL
    afile.write_text("x")
    cases += [
        ("disk_path", {"disk_path": str(afile)}),  # exists and is not a directory
        ("disk_path", {"disk_path": str(afile / SENTINEL / "kv")}),  # its parent is a file
        ("disk_path", {"disk_path": [SENTINEL]}),
        ("disk_bytes", {"disk_bytes": SENTINEL}),  # without disk_path
    ]
    return cases


def test_no_config_error_ever_shows_the_value(tmp_path, monkeypatch):
    """vLLM logs kv_connector_extra_config and the errors it raises: a password typed into the
    wrong key (or a URL holding one) must not reach the log through a tieredkv error."""
    monkeypatch.delenv(SENTINEL, raising=False)
    cases = _secret_cases(tmp_path)
    keys = {key for key, _ in cases}
    assert keys >= {f.name for f in fields(TieredKVConfig)}  # every key is covered
    for key, extra in cases:
        with pytest.raises(ConfigError) as err:
            TieredKVConfig.from_dict(extra)
        message = str(err.value)
        assert SENTINEL not in message, (key, extra, message)
        assert SENTINEL not in repr(err.value) and SENTINEL not in repr(err.value.value)
        assert SENTINEL.lower() not in message.lower()
        # The error names a key: the one at fault, or remote_url when the URL cannot be used.
        assert err.value.key in (key, "remote_url") and err.value.key in message, (key, message)
