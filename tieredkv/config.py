"""Typed configuration built from vLLM's ``kv_connector_extra_config`` dict.

Everything a user can get wrong is caught here, at start-up, with a message that names the
key and the value, so a bad deployment fails before it serves a single request.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
TiB = 1024 * GiB

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": KiB, "ki": KiB,
    "m": 1000**2, "mb": 1000**2, "mib": MiB, "mi": MiB,
    "g": 1000**3, "gb": 1000**3, "gib": GiB, "gi": GiB,
    "t": 1000**4, "tb": 1000**4, "tib": TiB, "ti": TiB,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

EVICTION_POLICIES = ("lru", "arc")
COPY_BACKENDS = ("auto", "native", "torch", "cupy", "vllm")
# Auto chunk size: big enough for large sequential copies and disk I/O, small enough that
# prompts of a few hundred tokens still get stored.
CHUNK_TOKENS_TARGET = 256


class ConfigError(ValueError):
    """A configuration value is unusable; the message names the key and the value."""

    def __init__(self, key: str, value: Any, reason: str) -> None:
        super().__init__(f"tieredkv: invalid {key}={value!r}: {reason}")
        self.key = key
        self.value = value


def parse_size(key: str, value: Any) -> int:
    """Parse a byte size given as an int or a string such as ``"512MiB"`` or ``"8GiB"``."""
    if isinstance(value, bool):
        raise ConfigError(key, value, "expected a size in bytes or a string like '8GiB'")
    if isinstance(value, int):
        size = value
    elif isinstance(value, float) and value.is_integer():
        size = int(value)
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ConfigError(key, value, "expected a size like 1073741824, '512MiB' or '8GiB'")
        size = int(float(match.group(1)) * _UNITS[unit])
    else:
        raise ConfigError(key, value, "expected a size in bytes or a string like '8GiB'")
    if size < 0:
        raise ConfigError(key, value, "a size cannot be negative")
    return size


def _parse_int(key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(key, value, f"expected an integer >= {minimum}")
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(key, value, f"expected an integer >= {minimum}") from None
    if number < minimum:
        raise ConfigError(key, value, f"expected an integer >= {minimum}")
    return number


def _parse_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        return value.lower() in ("true", "1", "yes", "on")
    raise ConfigError(key, value, "expected true or false")


def _parse_admission(key: str, value: Any) -> int:
    """``"all"`` writes every stored chunk to disk; an int N only chunks seen at least N times."""
    if isinstance(value, str) and value.strip().lower() in ("all", "always"):
        return 1
    if isinstance(value, str) and value.strip().lower().startswith("seen:"):
        value = value.split(":", 1)[1].strip()
    return _parse_int(key, value, minimum=1)


def _check_disk_path(key: str, value: Any) -> Path:
    if not isinstance(value, str | os.PathLike) or not str(value).strip():
        raise ConfigError(key, value, "expected a directory path")
    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(key, value, "exists and is not a directory")
    if not path.exists():
        parent = path.parent
        while not parent.exists():
            parent = parent.parent
        if not os.access(parent, os.W_OK | os.X_OK):
            raise ConfigError(key, value, f"does not exist and {parent} is not writable")
    elif not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(key, value, "is not a writable directory")
    return path


@dataclass(frozen=True)
class TieredKVConfig:
    """Engine-wide settings; capacities are per engine and split across TP ranks."""

    host_bytes: int = 4 * GiB
    disk_path: Path | None = None
    disk_bytes: int = 0
    eviction: str = "lru"
    disk_admission: int = 1
    chunk_blocks: int = 0  # 0: resolved to ~256-token chunks from the engine's block size
    io_threads: int = 2
    copy_backend: str = "auto"
    store_generated: bool = False
    load_timeout_s: float = 30.0
    spill_queue_depth: int = 64
    metrics_port: int | None = None

    @classmethod
    def from_dict(cls, extra: dict[str, Any] | None) -> TieredKVConfig:
        """Build and validate a config; raise :class:`ConfigError` naming the first bad key."""
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(
                unknown[0], extra[unknown[0]],
                f"unknown key; known keys are {', '.join(sorted(known))}",
            )
        values: dict[str, Any] = {}
        if "host_bytes" in extra:
            values["host_bytes"] = parse_size("host_bytes", extra["host_bytes"])
        if extra.get("disk_path") is not None:
            values["disk_path"] = _check_disk_path("disk_path", extra["disk_path"])
        if "disk_bytes" in extra:
            values["disk_bytes"] = parse_size("disk_bytes", extra["disk_bytes"])
            if "disk_path" not in values:
                raise ConfigError("disk_bytes", extra["disk_bytes"], "set disk_path too: no disk tier without it")
        elif "disk_path" in values:
            values["disk_bytes"] = 16 * GiB
        if "eviction" in extra:
            policy = extra["eviction"]
            if not isinstance(policy, str) or policy.lower() not in EVICTION_POLICIES:
                raise ConfigError("eviction", policy, f"expected one of {', '.join(EVICTION_POLICIES)}")
            values["eviction"] = policy.lower()
        if "disk_admission" in extra:
            values["disk_admission"] = _parse_admission("disk_admission", extra["disk_admission"])
        if "chunk_blocks" in extra:
            values["chunk_blocks"] = _parse_int("chunk_blocks", extra["chunk_blocks"], minimum=1)
        if "io_threads" in extra:
            values["io_threads"] = _parse_int("io_threads", extra["io_threads"], minimum=1)
            if values["io_threads"] > 64:
                raise ConfigError("io_threads", extra["io_threads"], "at most 64")
        if "copy_backend" in extra:
            backend = extra["copy_backend"]
            if not isinstance(backend, str) or backend.lower() not in COPY_BACKENDS:
                raise ConfigError("copy_backend", backend, f"expected one of {', '.join(COPY_BACKENDS)}")
            values["copy_backend"] = backend.lower()
        if "store_generated" in extra:
            values["store_generated"] = _parse_bool("store_generated", extra["store_generated"])
        if "load_timeout_s" in extra:
            raw = extra["load_timeout_s"]
            if isinstance(raw, bool) or not isinstance(raw, int | float) or raw <= 0:
                raise ConfigError("load_timeout_s", raw, "expected a positive number of seconds")
            values["load_timeout_s"] = float(raw)
        if "spill_queue_depth" in extra:
            values["spill_queue_depth"] = _parse_int("spill_queue_depth", extra["spill_queue_depth"], minimum=1)
        if extra.get("metrics_port") is not None:
            port = _parse_int("metrics_port", extra["metrics_port"], minimum=0)
            if port > 65535:
                raise ConfigError("metrics_port", extra["metrics_port"], "expected a TCP port number")
            values["metrics_port"] = port
        return cls(**values)

    def resolved(self, block_size: int) -> TieredKVConfig:
        """This config with ``chunk_blocks`` fixed for a block size (auto: ~256 tokens)."""
        if self.chunk_blocks:
            return self
        return replace(self, chunk_blocks=max(1, CHUNK_TOKENS_TARGET // max(1, block_size)))

    @property
    def has_disk(self) -> bool:
        return self.disk_path is not None and self.disk_bytes > 0

    def host_bytes_per_rank(self, world_size: int) -> int:
        return self.host_bytes // max(1, world_size)

    def disk_bytes_per_rank(self, world_size: int) -> int:
        return self.disk_bytes // max(1, world_size)
