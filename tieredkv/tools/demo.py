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
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tieredkv.tools.tiny_model import make_tiny_llama

BLOCK_SIZE = 32


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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

    def start(self, timeout_s: float = 300.0) -> Server:
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model), "--skip-tokenizer-init", "--enforce-eager",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", "8192", "--block-size", str(BLOCK_SIZE),
            "--kv-cache-memory-bytes", str(256 << 20), "--served-model-name", "tiny",
            "--no-enable-prefix-caching", *self.extra_args,
        ]
        if self.kv_config is not None:
            args += ["--kv-transfer-config", json.dumps(self.kv_config)]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
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
        body = {
            "model": "tiny", "prompt": tokens, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "ignore_eos": True, "return_token_ids": True,
        }
        request = urllib.request.Request(
            self.url + "/v1/completions", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"}, method="POST",
        )
        started = time.perf_counter()
        first: float | None = None
        generated: list[int] = []
        with urllib.request.urlopen(request, timeout=600) as reply:
            for raw in reply:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                if first is None:
                    first = time.perf_counter() - started
                choice = json.loads(line[5:])["choices"][0]
                generated.extend(choice.get("token_ids") or [])
        return (first if first is not None else time.perf_counter() - started), generated


def tieredkv_metric(metrics_text: str, name: str) -> float:
    """Sum of a metric's samples in Prometheus text format (0 when absent)."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def conversation_turns(users: int, turns: int, system_tokens: int, turn_tokens: int, seed: int = 0):
    """Per user, the growing prompt of each turn (shared system prompt, new text every turn)."""
    rnd = random.Random(seed)
    system = [rnd.randrange(3, 2000) for _ in range(system_tokens)]
    histories = {user: list(system) for user in range(users)}
    for turn in range(turns):
        for user in range(users):
            histories[user] += [rnd.randrange(3, 2000) for _ in range(turn_tokens)]
            yield turn, user, list(histories[user])


def run_demo(workdir: Path, users: int = 3, turns: int = 3) -> int:
    workdir = workdir.resolve()
    model = make_tiny_llama(workdir / "model")
    tier = workdir / "tier"
    if tier.exists():
        import shutil

        shutil.rmtree(tier)
    kv_config = {
        "kv_connector": "TieredKVConnector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "host_bytes": "4MiB", "disk_path": str(tier), "disk_bytes": "256MiB", "chunk_blocks": 4,
        },
    }
    rows: list[tuple[str, float, int]] = []
    print(f"[demo] model: {model}\n[demo] disk tier: {tier}", flush=True)
    prompts = list(conversation_turns(users, turns, system_tokens=1024, turn_tokens=384))
    with Server(model, kv_config, workdir / "server1.log") as server:
        print(f"[demo] vLLM + TieredKVConnector on {server.url}", flush=True)
        for turn, user, tokens in prompts:
            ttft, _ = server.complete(tokens)
            # Turn 0 of user 0 is cold; later turns re-use the previous turn's prefix.
            label = "cold" if (turn == 0 and user == 0) else "warm (host or disk)"
            rows.append((f"run 1 turn {turn} user {user} ({len(tokens)} tok) {label}", ttft, len(tokens)))
        before = server.metrics()
    print("[demo] restarting the server on the same disk tier", flush=True)
    with Server(model, kv_config, workdir / "server2.log") as server:
        last_turn = [p for p in prompts if p[0] == turns - 1]
        for _turn, user, tokens in last_turn:
            ttft, _ = server.complete(tokens)
            rows.append((f"run 2 (restart) user {user} ({len(tokens)} tok) from disk", ttft, len(tokens)))
        after = server.metrics()
    print()
    print(f"{'request':<58} {'TTFT ms':>9}")
    print("-" * 68)
    for label, ttft, _ in rows:
        print(f"{label:<58} {ttft * 1000:9.1f}")
    print("-" * 68)
    for title, text in (("run 1", before), ("run 2", after)):
        host = tieredkv_metric(text, "vllm:tieredkv_hit_tokens_total")
        print(f"{title}: tieredkv metrics hit tokens={host:.0f}")
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
