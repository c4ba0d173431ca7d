"""Suite-wide fixtures: no test leaks logging state into the next one."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

pytest_plugins = ["tests.redis_fixtures"]  # Redis servers for tests/remote, transfer, scheduler


@pytest.fixture(autouse=True)
def _restore_tieredkv_logging() -> Iterator[None]:
    """Tests assert on tieredkv's warnings via caplog; a benchmark run in-process or vLLM's
    logging set-up must not silence them for the tests that follow."""
    logger = logging.getLogger("tieredkv")
    level, propagate, disabled = logger.level, logger.propagate, logger.disabled
    yield
    logger.setLevel(level)
    logger.propagate, logger.disabled = propagate, disabled
