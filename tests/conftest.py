"""Suite-wide settings and fixtures: the same Hypothesis settings everywhere; no test leaks
logging state into the next one."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from hypothesis import settings

pytest_plugins = ["tests.redis_fixtures"]  # Redis servers for tests/remote, transfer, scheduler

# Hypothesis switches to its "ci" profile by itself when it sees CI (or another CI variable):
# derandomized examples, no deadline, no example database. Load it always, so the property
# tests a newcomer runs (scripts/test.sh) are the ones CI runs, example for example.
settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _restore_tieredkv_logging() -> Iterator[None]:
    """Tests assert on tieredkv's warnings via caplog; a benchmark run in-process or vLLM's
    logging set-up must not silence them for the tests that follow."""
    logger = logging.getLogger("tieredkv")
    level, propagate, disabled = logger.level, logger.propagate, logger.disabled
    yield
    logger.setLevel(level)
    logger.propagate, logger.disabled = propagate, disabled
