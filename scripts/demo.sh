#!/usr/bin/env bash
# The main job: vLLM (CPU build here, CUDA where present) serving long multi-turn prompts
# through TieredKVConnector on a small model made locally; prints TTFT per tier.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/tieredkv demo "$@"
