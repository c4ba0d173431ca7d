"""tieredkv's GPU check: test, sanitize, benchmark and record, on a bare GPU machine.

``python3 scripts/gpu_check.py --help`` says what it needs and does. The code lives in
``scripts/gpucheck/`` (standard library only until a step runs: the check must start on a
machine that lacks the project's dependencies, and say so in its results).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpucheck.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
