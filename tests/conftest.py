"""Suite-wide settings and fixtures: the same Hypothesis settings everywhere; no test leaks
logging state into the next one; the tests that start vLLM or redis-server are marked here.

Markers are applied here, by fixture use: ``redis`` for every test that uses a fixture starting
redis-server (or is parametrized by one's name), ``vllm`` for every test under ``tests/e2e`` or
using a fixture that needs vLLM. The few that start a server outside those fixtures carry the
marker themselves (the metrics modules that start vLLM servers, a benchmark smoke run and a
Cluster fault test that start their own redis-server), and a test that starts redis-server
without the marker fails, naming itself, so none slips into the fast unit tier
``pytest -m "not vllm and not redis"``; ``scripts/test.sh`` runs everything.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.errors import InvalidArgument

from tieredkv.testing.redis_procs import RedisClusterProcs, RedisServer

pytest_plugins = ["tests.redis_fixtures"]  # Redis servers for tests/remote, transfer, scheduler

# Hypothesis switches to its "ci" profile by itself when it sees CI (or another CI variable):
# derandomized examples, no deadline, no example database. Load it always, so the property
# tests a newcomer runs (scripts/test.sh) are the ones CI runs, example for example.
CI_PROFILE = {"derandomize": True, "deadline": None, "database": None, "print_blob": True,
              "suppress_health_check": [HealthCheck.too_slow]}  # Hypothesis 6.170's built-in


def ensure_ci_profile() -> None:
    """Load "ci", registering it first where this Hypothesis has no built-in one (an older
    version, as a GPU machine's may be): start-up must not fail on the profile's name."""
    try:
        settings.get_profile("ci")
    except InvalidArgument:
        settings.register_profile("ci", **CI_PROFILE)
    settings.load_profile("ci")


ensure_ci_profile()


@pytest.fixture(autouse=True)
def _restore_tieredkv_logging() -> Iterator[None]:
    """Tests assert on tieredkv's warnings via caplog; a benchmark run in-process or vLLM's
    logging set-up must not silence them for the tests that follow."""
    logger = logging.getLogger("tieredkv")
    level, propagate, disabled = logger.level, logger.propagate, logger.disabled
    yield
    logger.setLevel(level)
    logger.propagate, logger.disabled = propagate, disabled


# Fixtures that start redis-server (tests/redis_fixtures.py; the others build on them).
REDIS_FIXTURES = frozenset({"redis_server", "redis_cluster", "fresh_server", "redis_deployment"})
# Fixtures that need a vLLM engine (tests/e2e/conftest.py, tests/metrics/conftest.py).
VLLM_FIXTURES = frozenset({"tiny_model", "reference", "require_vllm"})
E2E = Path(__file__).parent / "e2e"


def needs_redis(item: pytest.Item) -> bool:
    """Uses a redis-server fixture, directly, through another fixture, or by name as a
    parameter (tests that pick the single node or the Cluster with ``getfixturevalue``)."""
    names = set(getattr(item, "fixturenames", ()))
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        names.update(v for v in callspec.params.values() if isinstance(v, str))
    return bool(names & REDIS_FIXTURES)


def needs_vllm(item: pytest.Item) -> bool:
    return E2E in Path(item.path).parents or bool(
        set(getattr(item, "fixturenames", ())) & VLLM_FIXTURES)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if needs_redis(item):
            item.add_marker(pytest.mark.redis)
        if needs_vllm(item):
            item.add_marker(pytest.mark.vllm)


_running: list[pytest.Item] = []  # the test being set up, run or torn down


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    _running.append(item)
    try:
        return (yield)
    finally:
        _running.pop()


def _marked_redis_only(start: Callable[..., Any]) -> Callable[..., Any]:
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        item = _running[-1] if _running else None
        if item is not None and item.get_closest_marker("redis") is None:
            pytest.fail(
                f"{item.nodeid} starts redis-server but is not marked 'redis': use a fixture "
                "from tests/redis_fixtures.py or add yours to REDIS_FIXTURES in tests/conftest.py",
                pytrace=False,
            )
        return start(self, *args, **kwargs)

    return guarded


RedisServer.start = _marked_redis_only(RedisServer.start)  # type: ignore[method-assign]
RedisClusterProcs.start = _marked_redis_only(RedisClusterProcs.start)  # type: ignore[method-assign]
