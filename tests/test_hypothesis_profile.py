"""The suite's Hypothesis profile loads on a Hypothesis without a built-in "ci" profile (a GPU
machine's may be older), with the settings CI uses."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from tests.conftest import CI_PROFILE, ensure_ci_profile


def test_a_missing_ci_profile_is_registered_with_the_built_in_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built_in = settings.get_profile("ci")
    settings.load_profile("default")  # what an older Hypothesis has active at start-up
    monkeypatch.delitem(settings._profiles, "ci")  # and it never shipped a "ci" profile
    try:
        ensure_ci_profile()
        got = settings.get_profile("ci")
        for name in CI_PROFILE:
            assert getattr(got, name) == getattr(built_in, name), name
        assert settings.default.derandomize and settings.default.deadline is None
        assert HealthCheck.too_slow in settings.default.suppress_health_check
    finally:
        settings._profiles["ci"] = built_in
        settings.load_profile("ci")
