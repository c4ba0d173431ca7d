"""e2e_ttft's figure: every row's TTFT, the hits against their targets, and what the cache
path costs (TTFT minus forward compute)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.ttft.workload import (
    DISK_TARGET,
    HOST_TARGET,
    LABELS,
    LMCACHE_CONFIG,
    LMCACHE_FLOOR_CONFIG,
    SLOW_DISK_CONFIG,
    SLOW_REMOTE_CONFIG,
    MiB,
)


def plot(payload: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["rows"]
    configs = [c for c in LABELS if c in rows]
    short = {
        "recompute": "recompute\n(ceiling)", "vllm_prefix": "vLLM prefix\nhit (floor)",
        "example_connector": "Example-\nConnector", "tieredkv_host": "tieredkv\nhost",
        "tieredkv_disk": "tieredkv\ndisk", "tieredkv_disk_restart": "tieredkv disk\nafter restart",
        "tieredkv_remote": "tieredkv remote\n(other replica,\nwhole chunks)",
        LMCACHE_CONFIG: "LMCache (peer,\n256-token\nchunks)",
        SLOW_DISK_CONFIG: "tieredkv,\nslow disk\n(declined)",
        SLOW_REMOTE_CONFIG: "tieredkv,\nslow Redis\n(declined)",
        LMCACHE_FLOOR_CONFIG: "vLLM prefix hit\nin LMCache's env\n(its floor)",
    }
    colors = dict(zip(LABELS, ["#999999", "#4c72b0", "#dd8452", "#55a868", "#2e7d32", "#1b5e20",
                               "#a1887f", "#8172b3", "#b39ddb", "#c44e52", "#64b5f6"], strict=True))
    p = payload["params"]
    floor = rows["vllm_prefix"]["median_s"] * 1000
    read_ms = p["kv_bytes"] / (payload["raw_disk_read"]["gb_per_s"] * 1e9) * 1000
    fig, axes = plt.subplots(1, 3, figsize=(19 + 2 * sum(c in rows for c in ("tieredkv_remote", LMCACHE_CONFIG)), 6.4),
                             gridspec_kw={"width_ratios": [1.1, 1, 1]})

    def bars(ax, shown, values, samples, fmt="{:,.0f}"):
        xs = range(len(shown))
        drawn = ax.bar(xs, values, color=[colors[c] for c in shown])
        for x, c in enumerate(shown):
            ax.scatter([x] * len(samples[c]), samples[c], color="black", s=9, zorder=3,
                       label="each run" if x == 0 else None)
        for bar, value, c in zip(drawn, values, shown, strict=True):
            text = fmt.format(value)
            if c != "recompute" and not rows[c]["hit_ok"]:
                text += "\nNO HIT"
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                        va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points",
                        bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none", "pad": 1},
                        zorder=5)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([short[c] for c in shown], fontsize=8)
        ax.grid(True, axis="y", alpha=0.35)

    ms = {c: [x * 1000 for x in rows[c]["samples_s"]] for c in configs}
    ax = axes[0]
    bars(ax, configs, [rows[c]["median_s"] * 1000 for c in configs], ms)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (ms, log scale)")
    ax.set_title("TTFT, all rows (bar = median)", fontsize=10)
    ax.legend(fontsize=7.5, loc="upper right")

    # The slow rows are recomputes (their hits declined): on the first panel only.
    hits = [c for c in configs[1:] if c not in (SLOW_DISK_CONFIG, SLOW_REMOTE_CONFIG)]
    # The targets' panel leaves the chunk-aligned rows out (remote, LMCache): their hit
    # computes the tail blocks too, so their TTFT is not at the floor's hit length.
    aligned = [c for c in ("tieredkv_remote", LMCACHE_CONFIG) if c in rows]
    targeted = [c for c in hits if c not in aligned]
    ax = axes[1]
    bars(ax, targeted, [rows[c]["median_s"] * 1000 for c in targeted], ms)
    for value, text, color in ((HOST_TARGET * floor, "host target: 1.3 x floor", "tab:green"),
                               (DISK_TARGET * (floor + read_ms), "disk target: 1.3 x (floor + KV/BW)",
                                "tab:red")):
        ax.axhline(value, color=color, linestyle=":", linewidth=1.3)
        ax.annotate(text, xy=(0.01, value), xycoords=("axes fraction", "data"), xytext=(0, 2),
                    textcoords="offset points", fontsize=7.5, color=color)
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("Hits at the floor's hit length: wall-clock TTFT (machine load makes the "
                 "forward swing)" if aligned else
                 "Hits: wall-clock TTFT (machine load makes the forward swing)", fontsize=10)

    ax = axes[2]
    ovh = {c: [x * 1000 for x in rows[c]["overhead_samples_s"]] for c in hits}
    bars(ax, hits, [rows[c]["overhead_median_s"] * 1000 for c in hits], ovh, fmt="{:.1f}")
    ax.axhline(read_ms, color="tab:red", linestyle=":", linewidth=1.3)
    ax.annotate(f"KV / raw disk read BW = {read_ms:.1f} ms", xy=(0.01, read_ms),
                xycoords=("axes fraction", "data"), xytext=(0, 2), textcoords="offset points",
                fontsize=7.5, color="tab:red")
    ax.set_ylabel("TTFT − model forward compute (ms)")
    ax.set_title("What the cache path costs: TTFT minus forward compute", fontsize=10)

    fig.suptitle(
        "TTFT, prompts of " + " and ".join(f"{n:,}" for n in p["prompt_lengths"].values())
        + f" tokens ({p['kv_bytes'] / MiB:.0f} MiB KV per hit), "
        f"CPU-build vLLM, {payload['machine']['cpu']}", fontsize=11)
    remote_note = ""
    if "tieredkv_remote" in rows:
        expected = p["expected_remote_hit_tokens"]
        full = all(v == p["expected_hit_tokens"][k] for k, v in expected.items())
        remote_note = (" Remote: a fresh replica's hit from Redis, its tail included." if full
                       else " Remote: a fresh replica's hit from Redis, whole chunks only ("
                       + ", ".join(f"{k} {v:,} of {p['expected_hit_tokens'][k]:,} tokens"
                                   for k, v in expected.items())
                       + "): it computes the tail blocks too.")
    if LMCACHE_CONFIG in rows:
        expected = (payload.get("lmcache") or {}).get("expected_hit_tokens") or {}
        remote_note += (" LMCache: whole 256-token chunks only ("
                        + ", ".join(f"{k} {v:,} of {p['expected_hit_tokens'][k]:,} tokens"
                                    for k, v in expected.items()) + ").")
    fig.text(0.005, 0.005, "CPU build: the device KV cache and the host tier share the same RAM "
             "(a host-tier load is a memcpy). Dots: every measured run." + remote_note,
             fontsize=7.5, color="dimgrey")
    fig.tight_layout(rect=(0, 0.03, 1, 0.94))
    fig.savefig(path, dpi=110)
    plt.close(fig)
