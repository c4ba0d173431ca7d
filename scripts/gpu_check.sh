#!/usr/bin/env bash
# Verify tieredkv on a bare GPU machine: tests marked cuda, the GPU integration test on the
# layouts vLLM serves tieredkv, a compute-sanitizer copy run and the transfer benchmark, inside
# a time budget (--budget-s, default 360 s), into three files (gpu_check.json, gpu_check.md,
# gpu_check.tar.gz). `bash scripts/gpu_check.sh --help` says what it needs and does, and the
# one line to give a machine that gets the tree without .git; `--device cpu` runs the CPU half
# (CI does, in tests/test_gpu_check_script.py). Same as `python3 scripts/gpu_check.py`.
#
# The interpreter: $PYTHON if set, else the checkout's .venv if there is one, else python3.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then
        PY="$ROOT/.venv/bin/python"
    elif command -v python3 >/dev/null 2>&1; then
        PY=python3
    else
        PY=python
    fi
fi
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "gpu_check: $PY is not Python >= 3.11 (set PYTHON=/path/to/python3.12)" >&2
    exit 2
fi
cd "$ROOT"
exec "$PY" "$ROOT/scripts/gpu_check.py" "$@"
