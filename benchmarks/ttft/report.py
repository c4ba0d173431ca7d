"""e2e_ttft's report: the Markdown tables (every row, the remote, LMCache and hybrid rows on
their own), the results files and what is printed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.ttft.judging import (
    engine_ratios,
    fmt_ms,
    fmt_or_na,
    lmcache_comparison,
    median_of,
    remote_ratios,
    remote_ratios_by_prompt,
    same_hits,
)
from benchmarks.ttft.plot import plot
from benchmarks.ttft.targets import (
    SUB_ROWS,
    lmcache_floor_text,
    print_lines,
    raw_copy_line,
    raw_disk_line,
    raw_get_markdown,
    slow_row_hit,
    slow_rows_text,
    sub_row_hit,
    verdict_table,
)
from benchmarks.ttft.workload import (
    BLOCK_SIZE,
    CHUNK_BLOCKS,
    CHUNK_TOKENS,
    HYBRID_CONFIGS,
    HYBRID_LABELS,
    LABELS,
    LMCACHE_CONFIG,
    NAME,
    REMOTE_KEY_PREFIX,
    MiB,
)


def write_outputs(payload: dict[str, Any]) -> tuple[Path, Path, Path]:
    out = common.results_dir()
    # Another model shape writes files of its own: the tiny default's are not overwritten.
    shape = payload["params"].get("model_shape", "tiny")
    stem = NAME if shape == "tiny" else f"{NAME}_{shape}"
    json_path, md_path, png_path = (out / f"{stem}.{ext}" for ext in ("json", "md", "png"))
    text = json.dumps(payload, indent=2, default=str) + "\n"
    json_path.write_text(text)
    md_path.write_text(f"# End-to-end TTFT\n\n{payload['markdown']}\n")
    plot(payload, png_path)
    return json_path, md_path, png_path


def _by_prompt_text(by_prompt: dict[str, list[int]]) -> str:
    """``A 3968 ×10; B 4416 ×10``."""
    return "; ".join(f"{prompt} {_compact(hits)}" for prompt, hits in by_prompt.items())


def _compact(values: list[int]) -> str:
    """``4096 ×12`` for a run of equal counts, else the list."""
    if values and all(v == values[0] for v in values):
        return f"{values[0]} ×{len(values)}"
    return ", ".join(str(v) for v in values)


def table_markdown(payload: dict[str, Any]) -> str:
    rows = payload["rows"]
    p = payload["params"]
    model = p["model"]
    floor = rows["vllm_prefix"]["median_s"]
    compute = rows["vllm_prefix"]["forward_median_s"]
    floor_row = rows["vllm_prefix"]
    floor_hits = _by_prompt_text(floor_row.get("hit_tokens_by_prompt") or {})
    lines = [
        "| configuration | TTFT median (ms) | min–max (ms) | n | x floor (cross-engine) "
        "| x floor (same engine) | forward compute, median (ms) | TTFT − compute, median (ms) "
        "| at equal compute (ms) | hit tokens per prompt | floor's hit tokens | hit? |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]

    def line(label: str, row: dict[str, Any], samples: list[float], hit: str,
             same_engine: float | None = None, chunk_aligned: str = "",
             numbers: bool = True) -> str:
        if not numbers:  # a peer's row whose hits did not happen: no figure to quote
            tokens = _by_prompt_text(row.get("hit_tokens_by_prompt") or {})
            return (f"| {label} | no hit | — | {len(samples)} | — | — | — | — | — | {tokens} "
                    f"| {floor_hits} | {hit} (**≠ expected {chunk_aligned}**) |")
        med = median_of(samples)
        ratio = f"{med / floor:.2f}" if floor and med else "n/a"
        same = f"{same_engine:.2f}" if same_engine is not None else "—"
        ovh = row.get("overhead_median_s")
        eq = "n/a"
        if compute is not None and ovh is not None and row is not rows["recompute"]:
            eq = fmt_ms(compute + ovh)
        by_prompt = row.get("hit_tokens_by_prompt")
        tokens = _by_prompt_text(by_prompt) if by_prompt else _compact(row["num_cached_tokens"])
        if chunk_aligned:  # the remote and LMCache rows: whole chunks, short of the floor's hit
            hit += f" (= {chunk_aligned}, expected; **< floor's** by the tail blocks)" if (
                row["hit_ok"]) else f" (**≠ expected {chunk_aligned}**)"
        elif by_prompt and row is not rows["recompute"]:
            hit += " (= floor)" if same_hits(row, floor_row) else " (**≠ floor**)"
        return (
            f"| {label} | {fmt_ms(med)} | {fmt_ms(min(samples))}–{fmt_ms(max(samples))} "
            f"| {len(samples)} | {ratio} | {same} | {fmt_ms(row.get('forward_median_s'))} "
            f"| {fmt_ms(ovh)} | {eq} | {tokens} | {floor_hits} | {hit} |"
        )

    for config, label in LABELS.items():
        if config not in rows:
            continue
        row = rows[config]
        hit = "n/a (ceiling)" if config == "recompute" else ("yes" if row["hit_ok"] else "**NO — FAIL**")
        hit = slow_row_hit(config, row) or hit  # a slow row (5c, 6c): declined?
        aligned = {LMCACHE_CONFIG: "LMCache's whole 256-token chunks"}.get(config, "")
        if config == "tieredkv_remote" and p["expected_remote_hit_tokens"] != p["expected_hit_tokens"]:
            aligned = "whole chunks"
        lines.append(line(label, row, row["samples_s"], hit,
                          (row.get("paired_floor") or {}).get("ratio_median"),
                          chunk_aligned=aligned,
                          numbers=config != LMCACHE_CONFIG or row["hit_ok"]))
        for key, text in SUB_ROWS.items():  # the same engine's other runs, a line each
            extra = row.get(key)
            if extra:
                lines.append(line(text, extra, extra["samples_s"], sub_row_hit(key, extra)))
    pf = {c: r["paired_floor"] for c, r in rows.items() if r.get("paired_floor")}
    paired_text = "; ".join(
        f"{c} {fmt_ms(v['median_s'])} ms (compute {fmt_ms(v['forward_median_s'])})" for c, v in pf.items()
    )
    disk = payload["raw_disk_read"]
    restart = rows.get("tieredkv_disk_restart", {}).get("first_after_restart_s")
    cold = {c: rows[c]["cold_s"] for c in rows if rows[c]["cold_s"]}
    cold_text = "; ".join(f"{c} {', '.join(fmt_ms(s) for s in v)} ms" for c, v in cold.items())
    return "\n".join([
        f"Machine: **{payload['machine']['name']}** — CPU-build vLLM ({payload['vllm']}): the "
        "\"device\" KV cache and tieredkv's host tier are the same RAM, so a host-tier load is a "
        "memcpy, not a PCIe DMA; these are not GPU figures.",
        "",
        f"Model: random Llama (shape `{p.get('model_shape', 'tiny')}`), hidden "
        f"{model['hidden_size']}, {model['num_layers']} layers, {model['num_heads']} heads, "
        f"{model['num_kv_heads']} KV heads, head dim "
        f"{model.get('head_dim') or model['hidden_size'] // model['num_heads']}, bf16: "
        f"**{p['kv_bytes_per_token']:,} bytes ({p['kv_bytes_per_token'] / 1024:g} KiB) of KV per "
        f"token**; block {BLOCK_SIZE}, "
        f"tieredkv chunk {CHUNK_BLOCKS} blocks ({CHUNK_TOKENS} tokens). Prompts "
        + ", ".join(f"{name} {n:,} tokens (hit {p['expected_hit_tokens'][name]:,})"
                    for name, n in p["prompt_lengths"].items())
        + f", alternating in every row (B's length is random, seed {p['prompt_seed']}, among "
        "those taking as many tieredkv slots as A, and no multiple of the block); no length "
        "is a multiple of the chunk, so every hit ends inside a chunk. "
        f"KV of a hit = {p['kv_bytes'] / MiB:.1f} MiB (mean of the two). TTFT = wall time of "
        "`generate(max_tokens=1)`"
        + (f"; every measured round starts with an unmeasured {p['touch_tokens']}-token prompt "
           "(under a block: nothing cached, stored or hit), so a round's first hit runs in a "
           "warm engine like the same-engine floor after it" if p.get("touch_tokens") else "")
        + "; profile "
        f"`{p['profile']}`, git {payload.get('git') or 'n/a'}, Python switch interval "
        f"{p['switch_interval_s'] * 1000:g} ms, load average at the end "
        f"{', '.join(f'{x:.1f}' for x in payload['load_average_end'])}.",
        "",
        "\n".join(lines),
        "",
        raw_disk_line(disk, p["kv_bytes"]) + raw_copy_line(disk.get("copy"), p["kv_bytes"], floor),
        f"Recompute for scale: {fmt_ms(rows['recompute']['median_s'])} ms. "
        + (f"First request after the restart: {fmt_ms(restart)} ms. " if restart else "")
        + f"Cold (storing) runs: {cold_text}.",
        "",
        "\"Forward compute\" is the time in the model's forward passes for the request (the "
        "same forward in every hit row: the tokens of the block holding the prompt's last "
        "token, "
        + " and ".join(f"{n - p['expected_hit_tokens'][name]} for {name}"
                       for name, n in p["prompt_lengths"].items())
        + ", on the same context, except the chunk-aligned rows' longer tails; a synchronous "
        "connector load inside the forward, ExampleConnector's and LMCache's, is not counted "
        "as compute). \"At equal "
        "compute\" = the floor row's median forward + the row's median TTFT − compute. "
        "vLLM prefix-cache hit of the same prompt in each connector's engine right after each "
        f"hit (the same-engine floor): {paired_text}.",
        "",
        "Targets, each judged on the worse of its cross-engine and same-engine figures (the "
        "figure beside its limit decides; the equal-compute ratio is information):",
        "",
        verdict_table(payload["verdicts"]),
        "",
        slow_rows_text(payload),
        "",
        ratio_text(payload),
        "",
        remote_markdown(payload),
        "",
        lmcache_markdown(payload),
        "",
        hybrid_markdown(payload),
    ])


def hybrid_markdown(payload: dict[str, Any]) -> str:
    """The hybrid-model rows: their TTFTs against the hybrid floor, their hits (as long as
    the floor's) checked, and rows 4/5a's targets applied to them (PASS/MISS)."""
    rows = payload["rows"]
    hybrid = payload.get("hybrid") or {}
    if "hybrid_vllm_prefix" not in rows:
        return f"**Hybrid rows not run**: {hybrid.get('skipped', 'not selected')}."
    p = payload["params"]
    lengths, floor_hit = p["prompt_lengths"], p["expected_hit_tokens"]
    expected = p["expected_hybrid_hit_tokens"]
    floor_row = rows["hybrid_vllm_prefix"]
    compute = floor_row.get("forward_median_s")

    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f}"

    table = [
        "| hybrid row | TTFT median (ms) | min–max (ms) | n | x hybrid floor (cross-engine) "
        "| x floor (same engine) | forward compute, median (ms) | TTFT − compute, median (ms) "
        "| at equal compute (ms) | hit tokens per prompt | expected | tokens computed (row vs "
        "floor) | hit? |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|",
    ]

    def line(label: str, row: dict[str, Any], want: dict[str, int], same: float | None) -> str:
        samples = row["samples_s"]
        med = median_of(samples)
        ratio = fmt(med / floor_row["median_s"]) if med and floor_row.get("median_s") else "n/a"
        ovh = row.get("overhead_median_s")
        eq = fmt_ms(compute + ovh) if compute is not None and ovh is not None else "n/a"
        hit = "yes" if row["hit_ok"] else "**NO — FAIL** (" + "; ".join(row["problems"]) + ")"
        return (f"| {label} | {fmt_ms(med)} | {fmt_ms(min(samples)) if samples else 'n/a'}–"
                f"{fmt_ms(max(samples)) if samples else 'n/a'} | {len(samples)} | {ratio} "
                f"| {'—' if same is None else fmt(same)} | {fmt_ms(row.get('forward_median_s'))} "
                f"| {fmt_ms(ovh)} | {eq} | {_by_prompt_text(row.get('hit_tokens_by_prompt') or {})} "
                f"| {'; '.join(f'{k} {v}' for k, v in want.items())} "
                f"| {'; '.join(f'{k} {lengths[k] - want[k]} vs {lengths[k] - floor_hit[k]}' for k in lengths)} "
                f"| {hit} |")

    for config, label in HYBRID_LABELS.items():
        if config not in rows:
            continue
        row = rows[config]
        want = floor_hit if config == "hybrid_vllm_prefix" else expected
        table.append(line(label, row, want, (row.get("paired_floor") or {}).get("ratio_median")))
        extra = row.get("host_hits_same_engine")
        if extra:
            table.append(line("↳ host-tier hit of the same prompt, same engine, right after",
                              extra, expected, None))
    vlines = verdict_table(payload.get("hybrid_verdicts") or [], "target (hybrid)")
    return "\n".join([
        "**Hybrid model (rows H1–H3).** The same geometry with layers alternating "
        f"sliding-window attention (window {p['hybrid_window']} tokens, smaller than the "
        f"{CHUNK_TOKENS}-token chunk, so a sliding layer stores {hybrid.get('sliding_blocks', '?')} "
        f"of a chunk's {CHUNK_BLOCKS} blocks) and full attention; vLLM's hybrid KV-cache "
        "manager stays on. The disk row's host tier holds the entries one prompt's hit reads "
        f"({hybrid.get('disk_host_slots', '?')} slots: whole chunks and the partial entry it "
        "ends in) and A, B alternate, after one unmeasured pair of disk hits (A ends on a block "
        "boundary: its first repeat stores its tail past the hit, an entry of its own, "
        "evicting a chunk it just read, so that the first host hit right after would read "
        "that chunk from disk). A tieredkv hit on a hybrid model is as long as vLLM's "
        "own (a stored prompt's tail keeps the window before its end, and a prompt ending on "
        "a block boundary also the entry one block shorter, where its repeat hits): "
        + "; ".join(f"{k} {expected[k]:,} tokens against the hybrid floor's {floor_hit[k]:,}"
                    for k in lengths)
        + "; the equal-compute column (hybrid floor's median forward + the row's TTFT − "
        "compute) leaves any difference in forward time out. KV copied "
        f"per hit: {p['hybrid_kv_bytes'] / MiB:.1f} MiB (mean of the two prompts). Each hit is "
        "checked (num_cached_tokens = the hybrid hit, and the tier's hit counter).",
        "",
        "\n".join(table),
        "",
        "The hybrid host hit's target (1.3 x the hybrid floor, in the exit status) and row 5a's "
        "target applied to the hybrid disk row as a reference line (not in the exit status):",
        "",
        vlines,
    ])


def remote_markdown(payload: dict[str, Any]) -> str:
    """Row 6 on its own: how replica A filled Redis, the chunk-aligned hit replica B got, and
    its ratios to the floor and to recompute (its target, <= 1.5 x floor, is in the targets'
    table)."""
    remote = payload.get("remote") or {}
    rows = payload["rows"]
    if "tieredkv_remote" not in rows:
        return f"**Row 6 (remote tier) not run**: {remote.get('skipped', 'not selected')}."
    row, floor_row, recompute_row = rows["tieredkv_remote"], rows["vllm_prefix"], rows["recompute"]
    r = remote_ratios(row, floor_row, recompute_row)
    p = payload["params"]
    lengths, floor_hit = p["prompt_lengths"], p["expected_hit_tokens"]
    expected = p["expected_remote_hit_tokens"]

    def fmt(x: float | None, digits: int = 2) -> str:
        return "n/a" if x is None else f"{x:.{digits}f}"

    writer = remote.get("writer") or {}
    hit = "yes" if row["hit_ok"] else "**NO — FAIL** (" + "; ".join(row["problems"]) + ")"
    read_chunks = sorted({c.get("remote_read_chunks", 0) for c in row.get("tieredkv_counters", [])})
    table = [
        "| remote-tier row (target: <= 1.5 x floor, worse of the two) | TTFT median (ms) "
        "| x floor, cross-engine "
        "| x floor, same engine | x recompute (row / recompute) | recompute / row "
        "| hit tokens per prompt | expected (whole chunks) | floor's hit | tokens computed per "
        "prompt (remote hit vs floor) | forward compute, median (ms) | TTFT − compute, median (ms) "
        "| hit? |",
        "|---|---:|---:|---:|---:|---:|---|---|---|---|---:|---:|---|",
        f"| {LABELS['tieredkv_remote']}, both prompts | {fmt_ms(row['median_s'])} "
        f"| {fmt(r['cross_engine_ratio'])} | {fmt(r['same_engine_ratio'])} "
        f"| {fmt(r['x_recompute'], 3)} | {fmt(r['speedup_vs_recompute'], 1)} "
        f"| {_by_prompt_text(row.get('hit_tokens_by_prompt') or {})} "
        f"| {'; '.join(f'{k} {v}' for k, v in expected.items())} "
        f"| {'; '.join(f'{k} {v}' for k, v in floor_hit.items())} "
        f"| {'; '.join(f'{k} {lengths[k] - expected[k]} vs {lengths[k] - floor_hit[k]}' for k in lengths)} "
        f"| {fmt_ms(row.get('forward_median_s'))} | {fmt_ms(row.get('overhead_median_s'))} | {hit} |",
    ]
    for prompt, q in remote_ratios_by_prompt(row, floor_row, recompute_row).items():
        table.append(
            f"| ↳ prompt {prompt} only ({lengths[prompt]:,} tokens; ratios against the floor's "
            f"and recompute's {prompt}) | {fmt_ms(q['median_s'])} | {fmt(q['cross_engine_ratio'])} "
            f"| {fmt(q['same_engine_ratio'])} | {fmt(q['x_recompute'], 3)} "
            f"| {fmt(q['speedup_vs_recompute'], 1)} "
            f"| {_compact((row.get('hit_tokens_by_prompt') or {}).get(prompt, []))} "
            f"| {expected[prompt]} | {floor_hit[prompt]} "
            f"| {lengths[prompt] - expected[prompt]} vs {lengths[prompt] - floor_hit[prompt]} "
            f"| {fmt_ms(q['forward_median_s'])} | {fmt_ms(q['overhead_median_s'])} | |")
    keys = remote.get("keys_after_writer")
    return "\n".join([
        "**Row 6, the shared remote tier (multi-replica).** "
        f"{remote.get('server', 'redis-server')} on loopback (no persistence), key prefix "
        f"`{REMOTE_KEY_PREFIX}`, `remote_timeout_s` {remote.get('timeout_s', 0.5):g} s (the "
        "default). Replica A (its own engine process; host tier "
        f"{remote.get('host_slots', '?')} slots = one prompt, no disk) computed A and B cold "
        f"({', '.join(fmt_ms(x) for x in writer.get('cold_s', []))} ms), wrote "
        f"{writer.get('counters', {}).get('remote_written_chunks', 'n/a')} chunks "
        f"(Redis held {keys if keys is not None else 'n/a'} keys under the prefix after A exited: "
        f"the whole chunks of both prompts, {remote.get('expected_keys', '?')} expected), and "
        "exited. Replica B, a fresh process started after that on the same Redis, the same host "
        "size, measured: A and B alternate, so each measured prompt was evicted from B's host "
        "tier by the other and is read from Redis (chunks read per hit: "
        f"{', '.join(str(x) for x in read_chunks) or 'n/a'}).",
        "",
        (("**The remote hit is as long as the floor's.** A prompt's tail is in Redis as a "
          "value of its own rows, so replica B's hit ends where vLLM's prefix cache ends: "
          + "; ".join(f"{k} {expected[k]:,} tokens" for k in lengths) + ".")
         if all(expected[k] == floor_hit[k] for k in lengths) else
         "**The remote hit is chunk-aligned, shorter than the floor's.** The remote tier stored "
         "whole chunks only then (a prompt's partial last chunk stayed in the replica that "
         "computed it), so replica B's hit ends at the last whole chunk: "
         + "; ".join(f"{k} {expected[k]:,} tokens, against vLLM's prefix-cache hit of "
                     f"{floor_hit[k]:,}" for k in lengths)
        + ". B computes the rest of the prompt ("
        + " and ".join(f"{lengths[k] - expected[k]} tokens for {k}" for k in lengths)
        + ", against "
        + " and ".join(f"{lengths[k] - floor_hit[k]}" for k in lengths)
        + " in every other hit row), so its forward compute is longer and its TTFT is not "
        "comparable with the floor at equal hit tokens; the ratios below compare TTFTs as a "
        "user sees them. Its \"at equal compute\" figure in the table above is the floor's "
        "forward plus this row's TTFT − compute (what the Redis read and load cost). The "
        "↳ host-tier row under it is the same prompt hit again in replica B's host tier "
        "(tail included) right after."),
        "",
        raw_get_markdown(remote.get("raw_get"), p.get("kv_bytes", 0), floor_row["median_s"]),
        "",
        "\n".join(table),
    ])



def lmcache_markdown(payload: dict[str, Any]) -> str:
    """Row 7 on its own: LMCache's settings, the chunk-aligned hit it was checked against, the
    server's own count, and the info comparison with row 4."""
    info = payload.get("lmcache") or {}
    rows = payload["rows"]
    if LMCACHE_CONFIG not in rows:
        return f"**Row 7 (LMCache peer) not run**: {info.get('skipped', 'not selected')}."
    row = rows[LMCACHE_CONFIG]
    p = payload["params"]
    lengths, floor_hit = p["prompt_lengths"], p["expected_hit_tokens"]
    expected = info.get("expected_hit_tokens") or {}
    counts = info.get("server_log_counts") or {}
    comparison = info.get("comparison") or lmcache_comparison(rows) or {}
    flags = ", ".join(f"`{f}`" for f in info.get("vllm_flags", []))
    return "\n".join([
        f"**Row 7, a real peer: {info.get('version', 'LMCache')}** in its multiprocess mode "
        "(`benchmarks/peers/lmcache.py`), the documented way on vLLM's CPU build: an "
        "`lmcache server` started by this script, L1 (CPU memory) budget "
        f"{info.get('budget_bytes', 0) / MiB:.0f} MiB = row 4's `host_bytes`, **chunk "
        f"{info.get('chunk_tokens', '?')} tokens** (LMCache's default), LRU, engine-driven "
        "transfer over POSIX shared memory (`"
        + info.get("server_command", "?").split(" -m ", 1)[-1] + "`); its engine runs with "
        "`.venv-lmcache`'s python (nothing of tieredkv there), `LMCacheMPConnector` "
        f"(kv_both) and its env ({', '.join(f'`{k}={v}`' for k, v in info.get('env', {}).items())}); "
        f"of LMCache's vLLM flags ({flags}) the offline `LLM` gets "
        f"{', '.join(f'`{k}={v}`' for k, v in info.get('llm_kwargs', {}).items()) or 'none'}; "
        "vLLM's prefix cache stays **on**, reset before every measured hit, as in row 4 "
        "(LMCache's docs turn it off; its connector handles an APC hit), so the same-engine "
        "floor is measured the same way. The same prompts and rounds as row 4.",
        "",
        "**LMCache's hit is chunk-aligned, shorter than the floor's**: it stores whole "
        f"{info.get('chunk_tokens', '?')}-token chunks only, so each hit must be "
        + "; ".join(f"{k} {expected.get(k, 0):,} tokens (the floor's {floor_hit[k]:,}; computed "
                    f"{lengths[k] - expected.get(k, 0)} vs {lengths[k] - floor_hit[k]})" for k in lengths)
        + " — checked through `num_cached_tokens` (not at equal hit tokens: its target compares "
        "ratios to each row's own floor), and against the server's log: it logged "
        f"{counts.get('retrieved_tokens', 'n/a')} tokens retrieved and "
        f"{counts.get('stored_tokens', 'n/a')} stored over the run. Hits: "
        + ("yes" if row["hit_ok"] else "**NO** (" + "; ".join(row["problems"]) + ")") + ".",
        "",
        comparison.get("text", "") + ".",
        "",
        lmcache_floor_text(rows),
    ])


def ratio_text(payload: dict[str, Any]) -> str:
    """Each tieredkv row against vLLM's prefix-cache hit, both ways, and the worse of the two
    (the figure a headline should quote)."""
    rows = payload["rows"]
    out = ["| tieredkv row | x floor, cross-engine (row median / floor row median) "
           "| x floor, same engine (median of hit / prefix-cache hit right after) "
           "| worse of the two | hit tokens = floor's |",
           "|---|---:|---:|---:|---|"]
    floor_row = rows["vllm_prefix"]
    for config in ("tieredkv_host", "tieredkv_disk", "tieredkv_disk_restart", "tieredkv_remote"):
        if config not in rows:
            continue
        r = engine_ratios(rows[config], floor_row)

        def fmt(x: float | None) -> str:
            return "n/a" if x is None else f"{x:.2f}"

        out.append(f"| {LABELS[config]} | {fmt(r['cross_engine_ratio'])} | "
                   f"{fmt(r['same_engine_ratio'])} | **{fmt(r['worse_ratio'])}** | "
                   f"{'yes' if same_hits(rows[config], floor_row) else '**no**'} |")
    return "\n".join(out)


def brief_table(rows: dict[str, dict[str, Any]], expected_hit: dict[str, int],
                expected_lmcache: dict[str, int]) -> str:
    """The measured rows of a partial run (``--only``): medians and hit tokens, no targets."""
    floor_hits = _by_prompt_text((rows.get("vllm_prefix") or {}).get("hit_tokens_by_prompt") or {})
    out = ["| configuration | TTFT median (ms) | n | x floor (same engine) | hit tokens per prompt "
           "| expected | floor's hit tokens | hit? |", "|---|---:|---:|---:|---|---|---|---|"]
    for config, row in rows.items():
        want = expected_lmcache if config == LMCACHE_CONFIG else (
            {} if config == "recompute" else expected_hit)
        same = (row.get("paired_floor") or {}).get("ratio_median")
        numbers = row["hit_ok"] or config != LMCACHE_CONFIG
        out.append(
            f"| {config} | {fmt_ms(row['median_s']) if numbers else 'no hit'} | {row['n']} "
            f"| {fmt_or_na(same) if numbers else '—'} "
            f"| {_by_prompt_text(row.get('hit_tokens_by_prompt') or {})} "
            f"| {'; '.join(f'{k} {v}' for k, v in want.items()) or '—'} | {floor_hits or 'n/a'} "
            f"| {'yes' if row['hit_ok'] else '**NO** (' + '; '.join(row['problems']) + ')'} |")
    return "\n".join(out)


def print_outcome(payload: dict[str, Any], paths: tuple[Path, ...], trace: bool) -> None:
    """The tables, the files written, the first traces (``--trace``), the LMCache comparison,
    and on stderr each row whose hits did not happen."""
    rows = payload["rows"]
    lmcache_info, remote_info = payload["lmcache"], payload["remote"]
    print(payload["markdown"])
    print("\nTargets (the worse of cross-engine and same-engine beside each limit):")
    print("\n".join(print_lines([*payload["verdicts"], *(payload.get("hybrid_verdicts") or [])])))
    print("\nwrote " + ", ".join(str(p) for p in paths))
    if trace:
        for config, traces in payload["traces"].items():
            for label, lines in traces.items():
                if label not in ("hit0", "hit1", "hosthit0", "hosthit1"):
                    continue  # all of them are in the JSON
                print(f"\n--- trace {config} {label}")
                print("\n".join(lines))
    if (lmcache_info.get("comparison") or {}).get("text"):
        print(lmcache_info["comparison"]["text"])
    if LMCACHE_CONFIG in rows and not rows[LMCACHE_CONFIG]["hit_ok"]:  # a peer: not in the exit status
        print("row 7 (LMCache peer): the hits did not happen: "
              + "; ".join(rows[LMCACHE_CONFIG]["problems"]), file=sys.stderr)
    if not remote_info.get("hit_ok", True):
        print("row 6 (remote tier): the hits did not happen: "
              + "; ".join(rows["tieredkv_remote"]["problems"]), file=sys.stderr)
    if not all(rows[c]["hit_ok"] for c in HYBRID_CONFIGS if c in rows):
        print("hybrid rows: the hits did not happen: " + "; ".join(
            q for c in HYBRID_CONFIGS if c in rows for q in rows[c]["problems"]), file=sys.stderr)


def print_partial(rows: dict[str, dict[str, Any]], expected_hit: dict[str, int],
                  remote_info: dict[str, Any], lmcache_info: dict[str, Any]) -> None:
    """A partial run's (``--only``) rows, as JSON and as a brief table: no targets."""
    print(json.dumps(rows, indent=1))
    print(json.dumps({"remote": remote_info, "lmcache": lmcache_info}, indent=1))
    print(brief_table(rows, expected_hit, lmcache_info.get("expected_hit_tokens") or {}))
    if (lmcache_info.get("comparison") or {}).get("text"):
        print(lmcache_info["comparison"]["text"])
