"""``--help`` and ``main``: the check from the command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gpucheck import report, steps
from gpucheck.common import (
    OWN_KERNELS,
    PER_TEST_TIMEOUT_S,
    RESULT_FILES,
    ROOT,
    SANITIZER_CAP_S,
    WHEEL_FILL,
    WHEEL_FOLDER,
    git_commit,
    source_digest,
)
from gpucheck.runner import Runner

DEFAULT_BUDGET_S = 360.0  # the target: a normal run fits in 6 minutes


def one_line(commit: str | None) -> str:
    """The command to give a GPU machine that gets this tree without ``.git``."""
    sha = (commit or "<commit>").removesuffix("-dirty")
    return f'GPU_CHECK_COMMIT={sha} python3 scripts/gpu_check.py --out "$OUT"'


def help_text() -> str:
    commit = git_commit()
    dirty = "\n(this tree has uncommitted changes: commit them first)" if commit and commit.endswith("-dirty") else ""
    return f"""\
Verify tieredkv on a GPU machine, inside a time budget, and write three result files.

On a GPU machine that receives the working tree without .git (Python 3.12, torch with CUDA,
cupy-cuda13x, numpy, pytest, pytest-timeout, hypothesis, xxhash, aiofiles, prometheus-client,
setuptools; no vLLM, no network), from the repository root, one line{dirty}:

    {one_line(commit)}

and bring the wheel folder {WHEEL_FOLDER}/ along: it is git-ignored, so name it in the run's
carry list (carry: ["{WHEEL_FOLDER}"]) or it stays behind. It holds what the machine
lacks: pytest-timeout, pinned (nothing the check runs needs pytest-asyncio). Fill it here,
on a machine with network:

    {WHEEL_FILL}

Nothing is installed: the tree is put first on PYTHONPATH and wheels are unpacked into a
temporary folder. Steps (each one's outcome, log and time go into the results; a failed or
cut-short step does not stop the next; correctness first, then speed, the slow sanitizer
last):

  environment  GPU, driver, torch/CUDA, CuPy, numpy, plugins; commit (GPU_CHECK_COMMIT when
               there is no .git) and the source digest
  wheels       pytest-timeout from {WHEEL_FOLDER}/ if missing
  build        CPU only: the optional C extension, built in place if missing
  cuda-tests   every test marked cuda (-m cuda), {PER_TEST_TIMEOUT_S} s per test
  integration  the worker half and transfer engine on the KV-cache layouts vLLM serves
               tieredkv; on CUDA the cuda-marked tests only, CPU otherwise
  copy-check   every backend's bytes on small caches in the same layouts, directly and
               through the engine's lanes
  overlap      (speed) d2h / h2d / next forward overlap on the GPU timeline
  bench        (speed) transfer_bench, every backend judged against the targets
  sanitizer    CUDA: the copy check under compute-sanitizer memcheck when it is installed (at
               most {SANITIZER_CAP_S:.0f} s, only {OWN_KERNELS}* kernels,
               PYTORCH_NO_CUDA_MEMORY_CACHING=1, API-error reports off); supplementary:
               cut short or not started by the budget, it is a warning, not `timeout`

Every step's time limit is clipped to what is left of --budget-s (default
{DEFAULT_BUDGET_S:.0f} s; the steps are sized for an H100 run of under 6 minutes, not yet
measured on one); a step cut short is
recorded as `timeout`. The output folder (--out, else $OUT, else
benchmarks/results/gpu/<gpu>-<date>/) gets exactly {", ".join(RESULT_FILES)}: every log, JUnit
file, timeline and benchmark file is inside the archive. gpu_check.md is also printed at the
end. Commit the folder under benchmarks/results/gpu/<gpu>-<date>/ (the JSON names it).

Two verdicts: correctness (bytes and ordering) pass / fail / incomplete, and speed met /
missed. Exit status 1 only on a correctness failure; 0 otherwise (read the verdicts); 2 on
bad arguments. --device cpu runs the CPU half: CI does (tests/test_gpu_check_script.py).
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/gpu_check.py", description=help_text(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", type=Path, default=None,
                        help="results folder (default: $OUT if set, else benchmarks/results/gpu/<name>-<date>)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help=f"seconds for the whole check (default {DEFAULT_BUDGET_S:.0f})")
    parser.add_argument("--wheels", type=Path, default=ROOT / WHEEL_FOLDER,
                        help=f"folder of extra wheels (default {WHEEL_FOLDER}/)")
    parser.add_argument("--bench", choices=("quick", "smoke", "full", "none"), default="quick",
                        help="transfer_bench profile (default quick; smoke takes seconds)")
    parser.add_argument("--no-sanitizer", action="store_true", help="copy check without compute-sanitizer")
    parser.add_argument("--skip", action="append", default=[], choices=[name for name, _ in steps.STEPS],
                        help="leave a step out (repeatable)")
    parser.add_argument("--without-vllm", action="store_true",
                        help="hide an installed vLLM from every step, as on the GPU machines")
    parser.add_argument("--commit", default=None,
                        help="commit to record (default: $GPU_CHECK_COMMIT, else git rev-parse HEAD)")
    parser.add_argument("--copy-check", action="store_true",
                        help="only the short copy run (what the copy-check step runs) on --device")
    parser.add_argument("--source-digest", action="store_true",
                        help="print this tree's source digest and exit (compare with the results)")
    args = parser.parse_args(argv)
    if args.budget_s <= 0:
        parser.error("--budget-s must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.source_digest:
        print(source_digest())
        return 0
    if args.copy_check:
        from gpucheck import copy_check

        return copy_check.main(args.device)
    if args.out is not None:
        args.out = args.out.resolve()
    args.wheels = args.wheels.resolve()
    runner = Runner(args)
    try:
        ready = steps.environment(runner)
        for name, step in steps.STEPS:
            if not ready:  # nothing can run; say so for each step when it is the budget's doing
                if runner.budget.left() < 1.0:
                    runner.record(name, steps.KINDS[name], "timeout", "not started: the budget is spent")
            elif runner.skip(name):
                runner.record(name, steps.KINDS[name], "skip", "--skip " + name)
            else:
                try:
                    step(runner)
                except Exception as exc:  # noqa: BLE001 - a broken step is a result, not a crash
                    runner.record(name, steps.KINDS[name], "fail", f"the check itself failed: {exc!r}")
        text = runner.write()
    finally:
        runner.close()
    print("\n" + text, flush=True)
    data = runner.results()
    print(f"[gpu_check] correctness {data['verdict'].upper()}, speed {data['speed']}; results in "
          f"{runner.out}", flush=True)
    return report.exit_status(runner.steps)


if __name__ == "__main__":
    sys.exit(main())
