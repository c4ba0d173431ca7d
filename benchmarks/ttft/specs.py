"""e2e_ttft's configurations: each row's engine settings (connector, tiers, prefix cache),
its set-up phases and one measured round's phases (:func:`build_specs`, :func:`round_phases`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks.common import kv_bytes_per_token
from benchmarks.ttft.workload import (
    CHUNK_BLOCKS,
    CHUNK_TOKENS,
    DTYPE_BYTES,
    HERE,
    LMCACHE_CONFIG,
    LMCACHE_FLOOR_CONFIG,
    MODEL,
    PROFILES,
    REMOTE_KEY_PREFIX,
    SLOW_DISK_CONFIG,
    SLOW_DISK_LEARNING_HITS,
    SLOW_DISK_RATE_PROMPTS,
    SLOW_DISK_READ_DELAY_S,
    SLOW_REMOTE_CONFIG,
    SLOW_REMOTE_TIMEOUT_S,
    TOUCH_TOKENS,
    WARMUP_TOKENS,
    MiB,
    host_entries,
    host_tier_bytes,
    hybrid_host_slots,
    lmcache_llm_kwargs,
    make_prompt,
)


def tieredkv_transfer_config(**extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "TieredKVConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"chunk_blocks": CHUNK_BLOCKS, **extra},
    }


def build_specs(args, model_dir: Path, work: Path, lengths: dict[str, int],
                remote_url: str | None = None,
                hybrid_model_dir: Path | None = None,
                lmcache: dict[str, Any] | None = None,
                model: Mapping[str, int] = MODEL,
                slow_remote_url: str | None = None) -> dict[str, dict[str, Any]]:
    """Every configuration: engine settings, set-up phases (not measured unless labelled
    ``recompute``), and ``round``: the phases of one measured round (``{i}`` = round index,
    ``{AB}`` = prompt A in even rounds, B in odd ones). The remote rows (replica A, which
    only writes, and replica B, which measures) exist when ``remote_url`` is given; the
    LMCache row and its own floor when ``lmcache`` is (:func:`lmcache_peer`: the peer venv's
    python and LMCache's vLLM settings). ``model``: the geometry (``--model-shape``). The
    slow-Redis row exists when ``slow_remote_url`` (the same Redis behind a throttling proxy)
    is given as well."""
    prof = PROFILES[args.profile]
    reps = getattr(args, "repeats", None) or prof["hit_repeats"]  # measured rounds per row
    longest = max(lengths.values())
    prompt_kv = longest * kv_bytes_per_token(model, DTYPE_BYTES)
    chunk_payload = CHUNK_TOKENS * kv_bytes_per_token(model, DTYPE_BYTES)
    # The disk rows' host tier holds one prompt (the larger one's chunks and tail), not two.
    one_prompt_slots = max(host_entries(n) for n in lengths.values())
    base = {
        "model": str(model_dir),
        "max_model_len": longest + 64,
        "kv_cache_memory_bytes": max(256 * MiB, 4 * prompt_kv),
        "prompts": {
            "warmup": make_prompt(7, WARMUP_TOKENS),
            "touch": make_prompt(8, TOUCH_TOKENS),
            "A": make_prompt(1, lengths["A"]),
            "B": make_prompt(2, lengths["B"]),
        },
        "trace": args.trace,
        "switch_interval": args.switch_interval,
    }

    def gen(prompt: str, label: str) -> dict[str, str]:
        return {"kind": "generate", "prompt": prompt, "label": label}

    reset = {"kind": "reset_prefix"}
    drain = {"kind": "drain"}
    example_dir = work / "example_connector"
    disk_dir = work / "tieredkv_disk"
    disk_cfg = tieredkv_transfer_config(
        host_bytes=one_prompt_slots * chunk_payload, disk_path=str(disk_dir),
        disk_bytes=8 * prompt_kv + 64 * MiB,
    )
    # Every connector hit is followed by the same prompt again without a reset: a vLLM
    # prefix-cache hit in the same engine a moment later ("pfloor", the same-engine floor).
    disk_round = [
        # The host tier holds exactly one prompt and A, B alternate: the measured prompt is
        # the one the other evicted from host (it is on disk). After its disk hit it is in
        # host again: a host-tier hit of the same engine follows ("hosthit").
        reset, gen("{AB}", "hit{i}"), drain, gen("{AB}", "pfloor{i}"),
        reset, gen("{AB}", "hosthit{i}"), drain,
    ]
    specs = {
        # 1. no connector, no prefix caching: every run computes everything.
        "recompute": {"prefix_caching": False, "setup": [
            gen("warmup", "warmup"),
            *[gen("AB"[i % 2], f"recompute{i}")
              for i in range(args.recompute_repeats or prof["recompute_repeats"])],
        ], "round": []},
        # 2. vLLM's own prefix cache: compute once, then hit it.
        "vllm_prefix": {"prefix_caching": True,
                        "setup": [gen("warmup", "warmup"), gen("A", "cold A"), gen("B", "cold B")],
                        "round": [gen("{AB}", "hit{i}")]},
        # 3. ExampleConnector: reads its files through the page cache, warm right after they
        #    were written; "diskhit" runs first drop them from the page cache (read from disk).
        "example_connector": {
            "prefix_caching": True,
            "kv_transfer_config": {
                "kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": str(example_dir)}},
            "setup": [gen("warmup", "warmup"), gen("A", "cold A"), gen("B", "cold B")],
            "round": [reset, gen("{AB}", "hit{i}"), gen("{AB}", "pfloor{i}"),
                      reset, {"kind": "drop_page_cache", "path": str(example_dir)},
                      gen("{AB}", "diskhit{i}")],
        },
        # 4. tieredkv host tier: plenty of host memory, no disk.
        "tieredkv_host": {
            "prefix_caching": True,
            "kv_transfer_config": tieredkv_transfer_config(
                host_bytes=host_tier_bytes(lengths, model)),
            "setup": [gen("warmup", "warmup"), drain, gen("A", "cold A"), drain,
                      gen("B", "cold B"), drain],
            "round": [reset, gen("{AB}", "hit{i}"), drain, gen("{AB}", "pfloor{i}")],
        },
        # 5. tieredkv disk tier: host_bytes = one prompt (the larger's), disk behind it.
        "tieredkv_disk": {
            "prefix_caching": True, "kv_transfer_config": disk_cfg,
            # The warmup prompt's tail (3 blocks) takes a host slot: stored (drained) before A
            # so that A's entries can evict it, and A is stored whole.
            "setup": [gen("warmup", "warmup"), drain, gen("A", "cold A"), drain,
                      gen("B", "cold B"), drain],
            "round": disk_round,
        },
        # 6. the same disk tier after a restart: a fresh engine recovers the index from the
        #    journal; its host tier starts empty, so every measured hit is read from disk.
        "tieredkv_disk_restart": {
            "prefix_caching": True, "kv_transfer_config": disk_cfg,
            "setup": [gen("warmup", "warmup"), drain], "round": disk_round,
        },
        # 5c. a slow disk: every slab read sleeps (TIEREDKV_FAULTS), the tier as row 5a's. A
        #     few cold prompts (the engine's prefill rate) and disk hits first, unmeasured
        #     (taken: nothing known yet), teach the cost model the disk's speed; each measured
        #     hit must then be declined, so its TTFT is a recompute's. A declined prompt is
        #     computed, not stored again (it is on disk), so host would keep what it held: a
        #     fresh filler prompt (F{i}) computed before each measured hit takes every host
        #     slot, and the measured prompt is on disk only. The disk holds them all. F{i} is
        #     as long as round i's measured prompt: its cold run is the hit's same-engine
        #     recompute (a shorter B beside an A-long filler would flatter B's ratio), and B
        #     takes as many host slots as A (random_b_length; a slot per entry, whatever its
        #     size), so a filler of either length still fills the host tier.
        SLOW_DISK_CONFIG: {
            "prefix_caching": True,
            "kv_transfer_config": tieredkv_transfer_config(
                host_bytes=one_prompt_slots * chunk_payload, disk_path=str(work / SLOW_DISK_CONFIG),
                disk_bytes=(reps + SLOW_DISK_RATE_PROMPTS + 8) * prompt_kv + 64 * MiB),
            "env": {"TIEREDKV_FAULTS": json.dumps({"disk_read_delay_s": getattr(
                args, "slow_disk_delay", None) or SLOW_DISK_READ_DELAY_S})},
            "prompts": {**base["prompts"],
                        **{f"C{k}": make_prompt(11 + k, lengths["A"]) for k in range(SLOW_DISK_RATE_PROMPTS)},
                        **{f"F{i}": make_prompt(1000 + i, lengths["AB"[i % 2]]) for i in range(reps)}},
            "setup": [gen("warmup", "warmup"), drain, gen("A", "cold A"), drain,
                      gen("B", "cold B"), drain,
                      *[p for k in range(SLOW_DISK_RATE_PROMPTS) for p in (gen(f"C{k}", f"cold C{k}"), drain)],
                      *[p for k in range(SLOW_DISK_LEARNING_HITS)
                        for p in (reset, gen("AB"[k % 2], f"learn{k}"), drain)]],
            "round": [reset, gen("F{i}", "fill{i}"), drain, reset, gen("{AB}", "hit{i}"), drain],
        },
    }
    if remote_url is not None:
        # Both replicas: host tier = one prompt (as the disk rows), no disk, the same Redis.
        remote_cfg = tieredkv_transfer_config(
            host_bytes=one_prompt_slots * chunk_payload, remote_url=remote_url,
            remote_key_prefix=REMOTE_KEY_PREFIX,
        )
        specs.update({
            # 7a. replica A: computes A and B (their whole chunks go to Redis), then exits.
            "tieredkv_remote_writer": {
                "prefix_caching": True, "kv_transfer_config": remote_cfg,
                "setup": [gen("warmup", "warmup"), drain, gen("A", "cold A"), drain,
                          gen("B", "cold B"), drain, {"kind": "counters", "label": "counters"}],
                "round": [],
            },
            # 7b. replica B, a fresh process started after A exited: its host tier holds one
            #     prompt and A, B alternate, so each measured prompt is read from Redis (the
            #     other one evicted it from host); after the remote hit the prompt (with the
            #     tail B computed) is in host again: a host-tier hit of the same engine follows.
            "tieredkv_remote": {
                "prefix_caching": True, "kv_transfer_config": remote_cfg,
                "setup": [gen("warmup", "warmup"), drain], "round": disk_round,
            },
        })
    if remote_url is not None and slow_remote_url is not None:
        # 6c. a slow Redis: replica A's Redis (A and B in it) reached through a proxy that
        #     delays every value's bytes, the tiers as replica B's. As row 5c: cold prompts
        #     (the prefill rate) and remote hits (taken: nothing known yet) first, unmeasured,
        #     teach the cost model; then before each measured hit a fresh filler prompt (as
        #     long as the hit's: its same-engine recompute) takes every host slot, so the hit
        #     is in Redis only, and it must be declined.
        specs[SLOW_REMOTE_CONFIG] = {
            "prefix_caching": True,
            "kv_transfer_config": tieredkv_transfer_config(
                host_bytes=one_prompt_slots * chunk_payload, remote_url=slow_remote_url,
                remote_key_prefix=REMOTE_KEY_PREFIX, remote_timeout_s=SLOW_REMOTE_TIMEOUT_S),
            "prompts": {**base["prompts"],
                        **{f"C{k}": make_prompt(21 + k, lengths["A"]) for k in range(SLOW_DISK_RATE_PROMPTS)},
                        **{f"F{i}": make_prompt(2000 + i, lengths["AB"[i % 2]]) for i in range(reps)}},
            "setup": [gen("warmup", "warmup"), drain,
                      *[p for k in range(SLOW_DISK_RATE_PROMPTS) for p in (gen(f"C{k}", f"cold C{k}"), drain)],
                      *[p for k in range(SLOW_DISK_LEARNING_HITS)
                        for p in (reset, gen("AB"[k % 2], f"learn{k}"), drain)]],
            "round": specs[SLOW_DISK_CONFIG]["round"],
        }
    if hybrid_model_dir is not None:
        # 8. the hybrid model: its floor, a host-tier hit, a disk-tier hit (host = one
        #    prompt's whole chunks, A and B alternate), each engine as its non-hybrid row.
        hybrid_model = str(hybrid_model_dir)
        specs.update({
            "hybrid_vllm_prefix": {**specs["vllm_prefix"], "model": hybrid_model},
            "hybrid_tieredkv_host": {**specs["tieredkv_host"], "model": hybrid_model},
            "hybrid_tieredkv_disk": {
                **specs["tieredkv_disk"], "model": hybrid_model,
                # A ends on a block boundary: its tail past the hit (13 blocks) is an entry of
                # its own, which a full host tier skips in A's cold run. Its first disk hit
                # stores it, evicting one of the chunks it just read: one unmeasured A, B pair
                # of disk hits does that (the tail then on disk) before the measured rounds.
                "setup": [*specs["tieredkv_disk"]["setup"],
                          reset, gen("A", "setup disk A"), drain, reset, gen("B", "setup disk B"),
                          drain],
                "kv_transfer_config": tieredkv_transfer_config(
                    host_bytes=hybrid_host_slots(lengths) * chunk_payload,
                    disk_path=str(work / "hybrid_tieredkv_disk"), disk_bytes=8 * prompt_kv + 64 * MiB),
            },
        })
    if lmcache is not None:
        # 9. LMCache (the peer): the host row's phases, its engine in .venv-lmcache with
        #    LMCacheMPConnector -> the lmcache server the parent starts (budget = row 4's
        #    host_bytes). The child imports this package only: a directory holding nothing
        #    but a link to it is its working directory and PYTHONPATH, so neither tieredkv's
        #    source nor its egg-info (a vLLM plugin entry point) is on the peer's sys.path.
        sys_path = work / "lmcache_sys_path"
        sys_path.mkdir(parents=True, exist_ok=True)
        link = sys_path / "benchmarks"
        if not link.is_symlink():
            link.symlink_to(HERE, target_is_directory=True)
        llm_kwargs, _ = lmcache_llm_kwargs(lmcache["vllm_flags"])
        specs[LMCACHE_CONFIG] = {
            **{k: v for k, v in specs["tieredkv_host"].items() if k in ("setup", "round")},
            "prefix_caching": True,
            "kv_transfer_config": lmcache["kv_transfer_config"],
            "llm_kwargs": llm_kwargs,
            "python": str(lmcache["python"]),
            "cwd": str(sys_path),
            "env": {**lmcache["env"], "PYTHONPATH": str(sys_path)},
            "lmcache_budget_bytes": lmcache["budget_bytes"],
        }
        # 9f. LMCache's own floor: vLLM's prefix-cache hit (row 2's phases) in LMCache's
        #     environment (its venv's vLLM and python, its engine settings, no connector).
        specs[LMCACHE_FLOOR_CONFIG] = {
            **{k: v for k, v in specs["vllm_prefix"].items() if k in ("setup", "round")},
            "prefix_caching": True,
            **{k: specs[LMCACHE_CONFIG][k] for k in ("llm_kwargs", "python", "cwd", "env")},
        }
    example_dir.mkdir(parents=True, exist_ok=True)
    for config, spec in specs.items():
        spec.update({k: v for k, v in base.items() if k not in spec})
        spec["config"] = config
        spec["log"] = str(work / f"{config}.log")
    return specs


def lmcache_peer(server, python: Path | str, version: str) -> dict[str, Any]:
    """What :func:`build_specs` needs for the LMCache row, and what the results record: the
    peer venv's python, LMCache's vLLM settings for ``server`` (a not yet started
    ``benchmarks.peers.lmcache.LMCacheServer``), its command line, budget and chunk size."""
    kv_config, env, flags = server.vllm_settings()
    llm_kwargs, not_applied = lmcache_llm_kwargs(flags)
    return {
        "version": f"lmcache {version}", "python": str(python),
        "server_command": " ".join(server.command()),
        "budget_bytes": server.budget_bytes, "chunk_tokens": server.chunk_size,
        "kv_transfer_config": kv_config, "env": env, "vllm_flags": list(flags),
        "llm_kwargs": llm_kwargs, "vllm_flags_not_applied": not_applied,
        "prefix_caching": "on, reset before every measured hit (as row 4)",
    }


# Configurations whose rounds are numbered from 0 in their own engine (A/B alternation starts
# with A); the others continue their numbering when they run again beside the late engines.
OWN_ROUND_NUMBERS = ("tieredkv_disk", "tieredkv_disk_restart", "tieredkv_remote",
                     "hybrid_tieredkv_disk", SLOW_DISK_CONFIG, SLOW_REMOTE_CONFIG)


def round_phases(spec: dict[str, Any], i: int) -> list[dict[str, Any]]:
    """One measured round of a configuration, labels numbered ``i``; A/B alternate by ``i``.
    A round starts with the touch prompt (``TOUCH_TOKENS``: the engine warm again, nothing
    stored or hit), unmeasured."""
    out = [{"kind": "generate", "prompt": "touch", "label": f"touch{i}"}] if spec["round"] else []
    for phase in spec["round"]:
        phase = dict(phase)
        if "label" in phase:
            phase["label"] = phase["label"].format(i=i)
            phase["prompt"] = phase["prompt"].replace("{AB}", "AB"[i % 2]).replace("{i}", str(i))
        out.append(phase)
    return out
