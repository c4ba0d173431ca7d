"""scripts/gpu_check.py in parts: one GPU (or CPU) check of tieredkv, inside a time budget.

- ``common``: paths, provenance (commit, source digest), JUnit parsing, the time budget;
- ``probe``: what the machine has (GPU, driver, torch, CuPy, numpy, tieredkv's origin);
- ``runner``: running a step's command inside the budget, recording it, packing results;
- ``steps``: the steps, in order (set-up, correctness, then speed);
- ``report``: the verdicts and ``gpu_check.md``;
- ``copy_check``: the short copy run the sanitizer step checks;
- ``cli``: ``--help`` and ``main``.

Standard library only, except ``copy_check`` (torch and tieredkv, imported when it runs): the
check must start on a machine that lacks the project's dependencies and say so in its results.
"""
