"""The chat client: a greedy streamed completion, and one level's users played concurrently
(one thread each, think times between turns), against one server or several replicas."""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.serve.workload import (
    ChatWorkload,
    Conversation,
    make_conversations,
    random_tokens,
    system_prompt,
)
from tieredkv.tools.vllm_server import BLOCK_SIZE


def stream_completion(url: str, tokens: Sequence[int], max_tokens: int, timeout_s: float) -> tuple[float, list[int]]:
    """Greedy streamed completion; (seconds to the first streamed token, generated ids)."""
    body = {
        "model": "tiny", "prompt": list(tokens), "max_tokens": max_tokens, "temperature": 0.0,
        "stream": True, "ignore_eos": True, "return_token_ids": True,
    }
    request = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"}, method="POST",
    )
    started = time.perf_counter()
    first: float | None = None
    generated: list[int] = []
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        for raw in reply:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            payload = json.loads(line[5:])
            if "error" in payload:
                raise RuntimeError(f"server error: {payload['error']}")
            ids = payload["choices"][0].get("token_ids") or []
            if first is None and ids:
                first = time.perf_counter() - started
            generated.extend(ids)
    return (first if first is not None else time.perf_counter() - started), generated


def run_level(
    server_url: str | Sequence[str],
    spec: ChatWorkload,
    level: int,
    *,
    timeout_s: float,
    request_timeout_s: float,
    on_done: Any = None,
    conversations: Sequence[Conversation] | None = None,
    route: Callable[[int, int, int], int] | None = None,
) -> tuple[list[dict[str, Any]], float]:
    """Play one level's conversations concurrently (one thread per user); (records, wall s).

    Several ``server_url``s (replicas): turn ``t`` of user ``u`` goes to
    ``server_url[route(u, t, len(server_url))]``, recorded as the turn's ``replica``."""
    urls = [server_url] if isinstance(server_url, str) else list(server_url)
    system = list(system_prompt(spec))
    if conversations is None:
        conversations = make_conversations(spec, level)
    records: list[dict[str, Any]] = []
    lock = threading.Lock()
    start = time.monotonic()
    deadline = start + timeout_s

    def user_loop(conv: Conversation) -> None:
        history = system if conv.system_len is None else system[: conv.system_len]
        for turn, text in enumerate(conv.user_texts):
            wait = conv.think_s[turn]
            if time.monotonic() + wait >= deadline:
                return
            time.sleep(wait)
            prompt = history + list(text)
            replica = route(conv.user, turn, len(urls)) if route is not None else 0
            record: dict[str, Any] = {
                "user": conv.user, "turn": turn, "prompt_tokens": len(prompt),
                "t_start": time.monotonic() - start,
            }
            if len(urls) > 1:
                record["replica"] = replica
            try:
                ttft, out = stream_completion(
                    urls[replica], prompt, spec.reply_tokens,
                    min(request_timeout_s, max(1.0, deadline - time.monotonic() + request_timeout_s)),
                )
                record.update(ok=True, ttft_s=ttft, output=out,
                              latency_s=time.monotonic() - start - record["t_start"])
            except (OSError, RuntimeError, ValueError, urllib.error.URLError) as exc:
                record.update(ok=False, error=f"{type(exc).__name__}: {exc}")
            with lock:
                records.append(record)
            if on_done is not None:
                on_done(record)
            if not record["ok"]:
                return  # the conversation cannot go on without its reply
            history = prompt + list(record["output"])

    threads = [threading.Thread(target=user_loop, args=(c,), daemon=True) for c in conversations]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()) + request_timeout_s + 5)
    wall = time.monotonic() - start
    with lock:
        return sorted(records, key=lambda r: (r["user"], r["turn"])), wall


def warm_up(url: str, timeout_s: float = 120.0) -> None:
    """One short request of tokens no conversation uses (shorter than a chunk: nothing is
    offloaded), so no configuration's first measured request pays a cold start."""
    stream_completion(url, random_tokens(random.Random("serve_bench:warmup"), 3 * BLOCK_SIZE + 5), 4, timeout_s)
