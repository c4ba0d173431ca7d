"""Typed configuration built from vLLM's ``kv_connector_extra_config`` dict.

Everything a user can get wrong is caught here, at start-up, with a message that names the
key and what it expects, so a bad deployment fails before it serves a single request. The
messages never quote the value: vLLM passes this dict through from the command line, and a
value typed into the wrong key (a password, a URL with one) would land in the log.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from fractions import Fraction
from functools import partial
from pathlib import Path
from typing import Any

from tieredkv.protocol import BackendName, PolicyName
from tieredkv.remote_url import (
    DEFAULT_KEY_PREFIX,
    PASSWORD_ENV_SETTING,
    URL_PASSWORD_OK_SETTING,
    RemoteURL,
    check_prefix,
    parse_remote_url,
)

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
TiB = 1024 * GiB
PiB = 1024 * TiB

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": KiB, "ki": KiB,
    "m": 1000**2, "mb": 1000**2, "mib": MiB, "mi": MiB,
    "g": 1000**3, "gb": 1000**3, "gib": GiB, "gi": GiB,
    "t": 1000**4, "tb": 1000**4, "tib": TiB, "ti": TiB,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
# No size anywhere in this config can exceed 1 PiB; host_bytes is further bounded by the
# machine's physical memory and disk_bytes by the capacity of disk_path's filesystem.
MAX_SIZE_BYTES = PiB
_MAX_SIZE_TEXT = 64  # longer size strings are rejected before they are parsed

# Ranges of the numeric keys (inclusive unless noted); the error messages quote them.
LOAD_TIMEOUT_MAX_S = 3600.0  # load_timeout_s in (0, 3600]
CHUNK_BLOCKS_MAX = 1024  # chunk_blocks in [1, 1024]
IO_THREADS_MAX = 64  # io_threads in [1, 64]
SPILL_QUEUE_DEPTH_MAX = 65536  # spill_queue_depth in [1, 65536]
DISK_ADMISSION_MAX = 1000  # disk_admission in [1, 1000]
METRICS_PORT_MAX = 65535  # metrics_port in [0, 65535]
COST_MARGIN_MAX = 10.0  # cost_model_margin in [0, 10]
REMOTE_TIMEOUT_MAX_S = 60.0  # remote_timeout_s in (0, 60]
REMOTE_TTL_MAX_S = 365 * 24 * 3600.0  # remote_ttl_s in [0, one year]; 0: no expiry
REMOTE_QUEUE_MIN_BYTES = 1 * 1024 * 1024  # remote_write_queue_bytes >= 1 MiB

EVICTION_POLICIES = tuple(p.value for p in PolicyName)
COPY_BACKENDS = tuple(b.value for b in BackendName)
# Auto chunk size: big enough for large sequential copies and disk I/O, small enough that
# prompts of a few hundred tokens still get stored.
CHUNK_TOKENS_TARGET = 256


class _NotShown:
    def __repr__(self) -> str:
        return "<not shown>"


# Passed as a ConfigError's value to keep it out of the message (every check in this module).
NOT_SHOWN: Any = _NotShown()


class ConfigError(ValueError):
    """A configuration value is unusable; the message names the key and why.

    The message names the key alone: a value may be a secret typed into the wrong key. A
    caller that knows its value is safe (a lock's path, a port it tried) passes ``value``.
    """

    def __init__(self, key: str, reason: str, *, value: Any = NOT_SHOWN) -> None:
        shown = "" if value is NOT_SHOWN else f"={value!r}"
        super().__init__(f"tieredkv: invalid {key}{shown}: {reason}")
        self.key = key
        self.value = None if value is NOT_SHOWN else value


def format_size(size: int) -> str:
    """``size`` bytes in the largest binary unit that keeps it >= 1, e.g. ``'23.5GiB'``."""
    for unit, name in ((PiB, "PiB"), (TiB, "TiB"), (GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if size >= unit:
            return f"{size / unit:.1f}".removesuffix(".0") + name
    return f"{size}B"


def parse_size(key: str, value: Any) -> int:
    """Parse a byte size given as an int or a string such as ``"512MiB"`` or ``"8GiB"``.

    The result is in [0, 1 PiB]; NaN, infinities, non-integral floats, exponents (``"1e30"``)
    and anything larger raise :class:`ConfigError` naming ``key``, never ``OverflowError``.
    """
    bounds = f"expected a size from 0 to {format_size(MAX_SIZE_BYTES)} ({MAX_SIZE_BYTES} bytes)"
    if isinstance(value, bool):
        raise ConfigError(key, "expected a size in bytes or a string like '8GiB'")
    if isinstance(value, int):
        size = value
    elif isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise ConfigError(key, f"{bounds}, in whole bytes or a string like '8GiB'")
        size = int(value)
    elif isinstance(value, str):
        match = _SIZE_RE.match(value) if len(value) <= _MAX_SIZE_TEXT else None
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ConfigError(key, f"expected a size like 1073741824, '512MiB' or '8GiB' ({bounds})")
        # Exact arithmetic: no float rounding, no overflow to inf for long digit strings.
        size = int(Fraction(match.group(1)) * _UNITS[unit])
    else:
        raise ConfigError(key, "expected a size in bytes or a string like '8GiB'")
    if size < 0:
        raise ConfigError(key, f"a size cannot be negative ({bounds})")
    if size > MAX_SIZE_BYTES:
        raise ConfigError(key, f"too large: {bounds}")
    return size


def physical_memory_bytes() -> int | None:
    """This machine's physical memory in bytes, or None where the OS does not say."""
    try:
        pages = os.sysconf("SC_PHYS_PAGES")
        page_size = os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None
    if pages <= 0 or page_size <= 0:
        return None
    return pages * page_size


def filesystem_capacity_bytes(path: Path) -> int | None:
    """Total size of the filesystem that holds ``path`` (or would, once created), or None."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        stat = os.statvfs(probe)
    except (AttributeError, OSError):
        return None
    capacity = stat.f_blocks * (stat.f_frsize or stat.f_bsize)
    return capacity if capacity > 0 else None


def _check_host_bytes(key: str, value: Any) -> int:
    """host_bytes in [1, physical memory]: the host tier is required and must fit in RAM."""
    size = parse_size(key, value)
    if size == 0:
        raise ConfigError(
            key,
            "the host tier cannot be empty (disk hits pass through it); expected 1 byte up to "
            "the machine's physical memory, e.g. '4GiB'",
        )
    physical = physical_memory_bytes()
    if physical is not None and size > physical:
        raise ConfigError(
            key,
            f"more than this machine's physical memory: it has {format_size(physical)} "
            f"({physical} bytes); expected 1 byte up to that",
        )
    return size


def _check_disk_bytes(key: str, value: Any, disk_path: Path) -> int:
    """disk_bytes in [0, capacity of disk_path's filesystem] (and never above 1 PiB); 0: no disk tier."""
    size = parse_size(key, value)
    capacity = filesystem_capacity_bytes(disk_path)
    if capacity is not None and size > capacity:
        raise ConfigError(
            key,
            "more than the filesystem holding disk_path can store: it has "
            f"{format_size(capacity)} ({capacity} bytes) in all; expected 0 up to that",
        )
    return size


def _parse_int(key: str, value: Any, minimum: int, maximum: int) -> int:
    """An int (or a string of one) in [minimum, maximum]; floats, NaN and bools are refused."""
    expected = f"expected an integer from {minimum} to {maximum}"
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(key, expected)
    if isinstance(value, str) and len(value) > _MAX_SIZE_TEXT:
        raise ConfigError(key, expected)
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(key, expected) from None
    if not minimum <= number <= maximum:
        raise ConfigError(key, expected)
    return number


def _parse_seconds(key: str, value: Any, maximum: float) -> float:
    """A finite number of seconds in (0, maximum]; NaN and infinities are refused."""
    expected = f"expected a finite number of seconds in (0, {maximum:g}]"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(key, expected)
    # Compare before converting: float() of a huge int raises OverflowError.
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(key, expected)
    if not 0 < value <= maximum:
        raise ConfigError(key, expected)
    return float(value)


def _parse_margin(key: str, value: Any) -> float:
    """A finite number in [0, COST_MARGIN_MAX]: how much faster than recomputing a read must
    be predicted to be (0.2: 20 % faster)."""
    expected = f"expected a number from 0 to {COST_MARGIN_MAX:g}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(key, expected)
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(key, expected)
    if not 0 <= value <= COST_MARGIN_MAX:
        raise ConfigError(key, expected)
    return float(value)


def _parse_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        return value.lower() in ("true", "1", "yes", "on")
    raise ConfigError(key, "expected true or false")


def _parse_admission(key: str, value: Any) -> int:
    """``"all"`` writes every stored chunk; an int N only chunks seen at least N times."""
    if isinstance(value, str) and value.strip().lower() in ("all", "always"):
        return 1
    if isinstance(value, str) and value.strip().lower().startswith("seen:"):
        value = value.split(":", 1)[1].strip()
    return _parse_int(key, value, minimum=1, maximum=DISK_ADMISSION_MAX)


def _parse_choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    """One of ``choices``, in any case (returned lower-cased)."""
    if not isinstance(value, str) or value.lower() not in choices:
        raise ConfigError(key, f"expected one of {', '.join(choices)}")
    return value.lower()


# The keys checked on their own, each by one parser, in the order they are checked (an error
# names the first bad key in this order).
_STANDALONE_KEYS: dict[str, Callable[[str, Any], Any]] = {
    "eviction": partial(_parse_choice, choices=EVICTION_POLICIES),
    "disk_admission": _parse_admission,
    "chunk_blocks": partial(_parse_int, minimum=1, maximum=CHUNK_BLOCKS_MAX),
    "io_threads": partial(_parse_int, minimum=1, maximum=IO_THREADS_MAX),
    "copy_backend": partial(_parse_choice, choices=COPY_BACKENDS),
    "store_generated": _parse_bool,
    "load_timeout_s": partial(_parse_seconds, maximum=LOAD_TIMEOUT_MAX_S),
    "spill_queue_depth": partial(_parse_int, minimum=1, maximum=SPILL_QUEUE_DEPTH_MAX),
    "cost_model": _parse_bool,
    "cost_model_margin": _parse_margin,
    "sync_loads": _parse_bool,
    "huge_pages": _parse_bool,
}


def _check_disk_path(key: str, value: Any) -> Path:
    if not isinstance(value, str | os.PathLike) or not str(value).strip():
        raise ConfigError(key, "expected a directory path")
    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(key, "exists and is not a directory")
    if not path.exists():
        parent = path.parent
        while not parent.exists():
            parent = parent.parent
        if not os.access(parent, os.W_OK | os.X_OK):
            raise ConfigError(key, "does not exist and its nearest existing parent is not writable")
    elif not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(key, "is not a writable directory")
    return path


@dataclass(frozen=True)
class TieredKVConfig:
    """Engine-wide settings; capacities are per engine and split across TP ranks.

    Every numeric key is finite and range-checked by :meth:`from_dict` (ranges inclusive
    unless noted); values outside a range raise :class:`ConfigError` naming the key.
    """

    # [1 byte, physical memory of the machine] (and <= 1 PiB); bytes or "8GiB".
    host_bytes: int = 4 * GiB
    disk_path: Path | None = None
    # [0, total size of disk_path's filesystem] (and <= 1 PiB); 0: no disk tier.
    disk_bytes: int = 0
    eviction: str = "lru"
    # [1, 1000] sightings before a chunk is written to disk ("all" = 1).
    disk_admission: int = 1
    # 0 (auto: resolved to ~256-token chunks from the engine's block size) or [1, 1024].
    chunk_blocks: int = 0
    # [1, 64]
    io_threads: int = 2
    copy_backend: str = "auto"
    store_generated: bool = False
    # (0, 3600] seconds, finite: NaN would fail every read, inf would wait forever.
    load_timeout_s: float = 30.0
    # [1, 65536]
    spill_queue_depth: int = 64
    # Decline a disk or remote hit predicted slower than recomputing it (scheduler/policies.py).
    cost_model: bool = True
    # [0, 10]: a read must be predicted this much faster than recomputing (0.2: 20 %).
    cost_model_margin: float = 0.2
    # vLLM's CPU build: a host-tier hit of at most INLINE_LOAD_MAX_BYTES (tieredkv/vllm/
    # metadata.py) per rank and step (IDLE_SYNC_LOAD_MAX_BYTES when no other request runs)
    # is copied right before the forward that uses it, in the same step; false, or a GPU:
    # every load runs between steps (a step of its own).
    sync_loads: bool = True
    # vLLM's CPU build: transparent huge pages for the host tier and vLLM's KV cache
    # (tieredkv/transfer/huge_pages.py); false: memory stays as allocated.
    huge_pages: bool = True
    # None (off) or [0, 65535]; 0 picks a free port.
    metrics_port: int | None = None
    # The shared tier (Redis/Valkey, one node or a Cluster); None: no remote tier. The
    # password (URL or remote_password_env) lives only in the RemoteURL, never in a repr.
    remote_url: RemoteURL | None = None
    remote_password_env: str | None = None
    # A password inside remote_url is refused (vLLM logs this dict) unless this is true.
    remote_url_password_ok: bool = False
    remote_key_prefix: str = DEFAULT_KEY_PREFIX
    # (0, 60] seconds: probes and reads give up after this (background write batches: >= 5 s).
    remote_timeout_s: float = 0.5
    # [0, 1 year] seconds; 0: values never expire (Redis's maxmemory-policy evicts them).
    remote_ttl_s: float = 0.0
    remote_writes: bool = True
    # [1, 1000] sightings before a chunk is written to the remote tier ("all" = 1).
    remote_admission: int = 1
    # [1 MiB, 1 PiB]: writes waiting for Redis beyond this are dropped (and counted).
    remote_write_queue_bytes: int = 256 * MiB

    @classmethod
    def from_dict(cls, extra: dict[str, Any] | None) -> TieredKVConfig:
        """Build and validate a config; raise :class:`ConfigError` naming the first bad key."""
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(
                unknown[0],
                f"unknown key; known keys are {', '.join(sorted(known))}",
            )
        values: dict[str, Any] = {}
        if "host_bytes" in extra:
            values["host_bytes"] = _check_host_bytes("host_bytes", extra["host_bytes"])
        if extra.get("disk_path") is not None:
            values["disk_path"] = _check_disk_path("disk_path", extra["disk_path"])
        if "disk_bytes" in extra:
            if "disk_path" not in values:
                parse_size("disk_bytes", extra["disk_bytes"])  # a bad value is named first
                raise ConfigError("disk_bytes", "set disk_path too: no disk tier without it")
            values["disk_bytes"] = _check_disk_bytes("disk_bytes", extra["disk_bytes"], values["disk_path"])
        elif "disk_path" in values:
            values["disk_bytes"] = 16 * GiB
        for key, parse in _STANDALONE_KEYS.items():
            if key in extra:
                values[key] = parse(key, extra[key])
        if extra.get("metrics_port") is not None:
            values["metrics_port"] = _parse_int(
                "metrics_port", extra["metrics_port"], minimum=0, maximum=METRICS_PORT_MAX
            )
        values.update(_parse_remote(extra))
        return cls(**values)

    def resolved(self, block_size: int) -> TieredKVConfig:
        """This config with ``chunk_blocks`` fixed for a block size (auto: ~256 tokens)."""
        if self.chunk_blocks:
            return self
        return replace(self, chunk_blocks=max(1, CHUNK_TOKENS_TARGET // max(1, block_size)))

    @property
    def has_remote(self) -> bool:
        return self.remote_url is not None

    @property
    def has_disk(self) -> bool:
        return self.disk_path is not None and self.disk_bytes > 0

    def host_bytes_per_rank(self, world_size: int) -> int:
        return self.host_bytes // max(1, world_size)

    def disk_bytes_per_rank(self, world_size: int) -> int:
        return self.disk_bytes // max(1, world_size)

    def check_remote_value(self, payload_bytes: int, header_bytes: int) -> None:
        """Refuse a ``remote_write_queue_bytes`` smaller than one chunk's value (every write
        dropped). A value's size (one rank's KV of a chunk plus the codec's header) is known
        only once the model is: both halves call this then."""
        if not (self.has_remote and self.remote_writes):
            return
        value_bytes = payload_bytes + header_bytes
        if self.remote_write_queue_bytes < value_bytes:
            raise ConfigError(
                "remote_write_queue_bytes",
                f"smaller than one chunk's value ({format_size(value_bytes)}, {value_bytes} bytes: "
                f"the chunk's KV on one rank and a {header_bytes}-byte header), so every write to "
                f"the remote tier would be dropped; set it to several values (e.g. "
                f"{format_size(8 * value_bytes)}), lower chunk_blocks, or set remote_writes: false",
                value=self.remote_write_queue_bytes,
            )

    def forgeable_hash_warning(self, hash_algo: str, collision_resistant: bool, stable: bool) -> str | None:
        """Why keys of a tier that outlives the process are forgeable under ``hash_algo``, or None.

        tieredkv keys chunks by vLLM's block hashes. A non-cryptographic algorithm is only safe
        while its seed is secret and random per process (vLLM's default without PYTHONHASHSEED;
        tieredkv then keeps the disk tier and Redis to this process). With PYTHONHASHSEED set
        (``stable``) the seed is shared: a prompt whose block hashes collide with another's
        can be computed offline, and the disk tier (across restarts) and Redis (for every
        replica) keep what it stores. Accepted, since the operator chose it, but said loudly.
        """
        if collision_resistant or not stable or not (self.has_disk or self.has_remote):
            return None
        tiers = " and ".join(name for name, on in (("disk", self.has_disk), ("remote (Redis)", self.has_remote)) if on)
        return (
            f"tieredkv: prefix_caching_hash_algo={hash_algo} is not collision resistant, and with "
            "PYTHONHASHSEED set its seed is fixed and predictable, so colliding prompts can be "
            "precomputed offline (vLLM keeps a random seed for this algorithm for that reason); "
            f"the {tiers} tier keeps these keys beyond this process (on disk across restarts, in "
            "Redis for every replica), so a prompt forged to collide with another can be served "
            "the other's KV, or make others be served its own. Use --prefix-caching-hash-algo "
            "sha256 (or sha256_cbor) where tenants do not trust each other"
        )


def _parse_remote(extra: dict[str, Any]) -> dict[str, Any]:
    """The ``remote_*`` keys; every one but ``remote_url`` needs ``remote_url`` set.

    Errors never quote a value: not ``remote_url`` (a password may sit anywhere in a mistyped
    one), not ``remote_password_env`` (a password typed there by mistake).
    """
    raw_url = extra.get("remote_url")
    others = sorted(k for k in extra if k.startswith("remote_") and k != "remote_url")
    if raw_url is None:
        if others:
            raise ConfigError(others[0], "set remote_url too: no remote tier without it")
        return {}
    values: dict[str, Any] = {}
    password_env = extra.get(PASSWORD_ENV_SETTING)
    if password_env is not None and (not isinstance(password_env, str) or not password_env):
        raise ConfigError(PASSWORD_ENV_SETTING, "expected an environment variable name")
    password_ok = False
    if URL_PASSWORD_OK_SETTING in extra:
        password_ok = values[URL_PASSWORD_OK_SETTING] = _parse_bool(
            URL_PASSWORD_OK_SETTING, extra[URL_PASSWORD_OK_SETTING])
    try:
        values["remote_url"] = parse_remote_url(
            raw_url, password_env=password_env, url_password_ok=password_ok)
    except ValueError as exc:
        raise ConfigError("remote_url", str(exc).removeprefix("remote_url: ")) from None
    values["remote_password_env"] = password_env
    if "remote_key_prefix" in extra:
        try:
            values["remote_key_prefix"] = check_prefix(extra["remote_key_prefix"])
        except ValueError as exc:
            raise ConfigError("remote_key_prefix", str(exc)) from None
    if "remote_timeout_s" in extra:
        values["remote_timeout_s"] = _parse_seconds(
            "remote_timeout_s", extra["remote_timeout_s"], maximum=REMOTE_TIMEOUT_MAX_S)
    if "remote_ttl_s" in extra:
        ttl = extra["remote_ttl_s"]
        values["remote_ttl_s"] = 0.0 if ttl in (0, 0.0, None) and not isinstance(ttl, bool) else (
            _parse_seconds("remote_ttl_s", ttl, maximum=REMOTE_TTL_MAX_S))
    if "remote_writes" in extra:
        values["remote_writes"] = _parse_bool("remote_writes", extra["remote_writes"])
    if "remote_admission" in extra:
        values["remote_admission"] = _parse_admission("remote_admission", extra["remote_admission"])
    if "remote_write_queue_bytes" in extra:
        size = parse_size("remote_write_queue_bytes", extra["remote_write_queue_bytes"])
        if size < REMOTE_QUEUE_MIN_BYTES:
            raise ConfigError("remote_write_queue_bytes", f"expected at least {format_size(REMOTE_QUEUE_MIN_BYTES)} (and at "
                              "least one chunk's value, checked once the model is known)")
        values["remote_write_queue_bytes"] = size
    return values
