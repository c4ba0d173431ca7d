"""Smoke test of the LMCache peer: a ~2,000-token prompt twice through vLLM + LMCache MP mode.

Run with the project venv (it writes the tiny model and drives HTTP); vLLM and the LMCache
server run with ``.venv-lmcache``'s python (``benchmarks/peers/lmcache_env.sh`` builds it)::

    .venv/bin/python -m benchmarks.peers.lmcache_smoke [--out DIR]

vLLM's own prefix cache is off, so a second request that reports cached prompt tokens got them
from LMCache. Evidence printed: vLLM's ``cached_tokens`` per request, vLLM's external prefix
cache counters, LMCache's ``Stored/Retrieved N tokens`` log lines and its Prometheus counters;
the greedy tokens of both requests must match. Exit status 0 only if all of that holds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.peers.lmcache import CHUNK_SIZE, LMCACHE_VERSION, LMCacheServer, env_python
from tieredkv.tools.ports import free_port
from tieredkv.tools.tiny_model import make_tiny_llama
from tieredkv.tools.vllm_server import BLOCK_SIZE, SERVED_MODEL_NAME, Server, wait_until_healthy

PROMPT_TOKENS = 2000
MAX_TOKENS = 16


def start_vllm(python: Path, model: Path, lmcache: LMCacheServer, log_path: Path, timeout_s: float = 900.0) -> Server:
    """vLLM's OpenAI server in the peer venv, with the launch flags of ``tieredkv.tools.vllm_server``."""
    kv_config, extra_env, extra_args = lmcache.vllm_settings()
    port = free_port()
    args = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--skip-tokenizer-init", "--enforce-eager",
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "8192", "--block-size", str(BLOCK_SIZE),
        "--kv-cache-memory-bytes", str(256 << 20), "--served-model-name", SERVED_MODEL_NAME,
        "--enable-prompt-tokens-details", *extra_args,
        "--kv-transfer-config", json.dumps(kv_config),
    ]
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", **os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **extra_env}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "wb")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = Server(model=model, kv_config=kv_config, log_path=log_path, port=port, proc=proc)
    try:
        wait_until_healthy(proc, server.url + "/health", timeout_s, "vLLM", log_path)
    except TimeoutError:
        server.stop()
        raise
    return server


def metric_lines(text: str, pattern: str) -> list[str]:
    return [line for line in text.splitlines() if not line.startswith("#") and re.search(pattern, line)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/tieredkv_lmcache_smoke"))
    args = parser.parse_args()
    python = env_python()
    if python is None:
        print("no usable .venv-lmcache: run benchmarks/peers/lmcache_env.sh", file=sys.stderr)
        return 2
    model = make_tiny_llama(args.out / "tiny-llama")
    rng = random.Random(15)
    prompt = [rng.randrange(3, 2048) for _ in range(PROMPT_TOKENS)]
    print(f"[smoke] lmcache {LMCACHE_VERSION} MP mode, chunk {CHUNK_SIZE} tokens, prompt {PROMPT_TOKENS} tokens")
    with LMCacheServer(budget_bytes=1 << 30, log_path=args.out / "lmcache_server.log") as lmcache:
        print(f"[smoke] lmcache server up: zmq 127.0.0.1:{lmcache.port}, http {lmcache.http_port}")
        started = time.monotonic()
        server = start_vllm(python, model, lmcache, args.out / "vllm.log")
        try:
            print(f"[smoke] vLLM up in {time.monotonic() - started:.0f}s: {server.url}")
            ttft1, tokens1, cached1 = server.complete_with_usage(prompt, MAX_TOKENS)
            time.sleep(2.0)  # the store is asynchronous
            after_first = lmcache.log_counts()
            ttft2, tokens2, cached2 = server.complete_with_usage(prompt, MAX_TOKENS)
            time.sleep(1.0)
            after_second = lmcache.log_counts()
            vllm_metrics = server.metrics()
        finally:
            server.stop()
        try:
            lmcache_metrics = metric_lines(lmcache.metrics(), r"^lmcache_mp_l1_(read|write)_chunks")
        except OSError as error:
            lmcache_metrics = [f"(no Prometheus endpoint: {error})"]
    print(f"[smoke] request 1: ttft {ttft1 * 1000:.0f} ms, vLLM cached_tokens {cached1}, lmcache log {after_first}")
    print(f"[smoke] request 2: ttft {ttft2 * 1000:.0f} ms, vLLM cached_tokens {cached2}, lmcache log {after_second}")
    for line in metric_lines(vllm_metrics, r"^vllm:(external_prefix_cache|prefix_cache)_(hits|queries)"):
        print(f"[smoke] vLLM  {line}")
    for line in lmcache_metrics:
        print(f"[smoke] LMCache {line}")
    print(f"[smoke] tokens 1: {tokens1}\n[smoke] tokens 2: {tokens2}")
    expected_hit = (PROMPT_TOKENS - 1) // CHUNK_SIZE * CHUNK_SIZE
    checks = {
        "first request computed everything (cached_tokens == 0)": cached1 == 0,
        f"second request served {expected_hit} tokens from LMCache (cached_tokens)": cached2 == expected_hit,
        "LMCache logged a store after request 1": after_first["stored_tokens"] > 0,
        "LMCache logged a retrieve after request 2": after_second["retrieved_tokens"] > after_first["retrieved_tokens"],
        "greedy tokens match": tokens1 == tokens2 and len(tokens1) == MAX_TOKENS,
    }
    for name, ok in checks.items():
        print(f"[smoke] {'PASS' if ok else 'FAIL'}: {name}")
    print(f"[smoke] logs: {args.out}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
