"""The layering ARCHITECTURE.md describes, checked by walking every import in the package.

A module may import its own part of the package or a part on a lower floor, never a higher
one; only ``tieredkv/vllm/`` imports vLLM; what ships (everything but ``testing/``: the
connector, the demo and its server launcher, the console command) never imports ``tieredkv.testing``
(one exception: the worker side's fault-injection hook, imported only when
``TIEREDKV_FAULTS`` is set). Function-level (lazy) imports count like module-level ones.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tieredkv"

# Floors, lowest first. A part may import parts on strictly lower floors (and itself).
FLOORS: dict[str, int] = {
    "protocol": 0, "remote_url": 0,
    "config": 1, "keys": 1,
    "disk": 2, "metrics": 2,
    "remote": 3,
    "transfer": 4,
    "scheduler": 5,
    "vllm": 6,
    "connector": 7,
    # What ships beside the connector (the demo, its vLLM server launcher) sits below the test
    # harness, which may use it; nothing that ships imports the harness.
    "tools": 8,
    "testing": 9,
    "cli": 10,
}
SHIPPED = (set(FLOORS) | {"tieredkv"}) - {"testing"}
# (importing module, imported module): documented exceptions.
ALLOWED = {
    # Fault injection for e2e tests and soak runs, imported only when TIEREDKV_FAULTS is set.
    ("tieredkv.vllm.worker_side", "tieredkv.testing.fault_backend"),
}


def _allowed(source: str, target: str) -> bool:
    return any(source == s and (target == t or target.startswith(t + ".")) for s, t in ALLOWED)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "tieredkv"


def _imports(path: Path) -> list[tuple[str, int]]:
    """(absolute module name, line) of every import in ``path``, TYPE_CHECKING blocks included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: relative import (use absolute ones)"
            assert node.module is not None
            found.append((node.module, node.lineno))
            # ``from tieredkv.x import y`` may name a submodule y: check it as one.
            found += [(f"{node.module}.{alias.name}", node.lineno) for alias in node.names
                      if node.module.startswith("tieredkv")]
    return found


def _modules() -> list[Path]:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 40, "the walk found too few modules"
    return files


def test_every_part_of_the_package_has_a_floor() -> None:
    parts = {_part(_module_name(f)) for f in _modules()} - {"tieredkv"}
    assert parts <= set(FLOORS), f"add these to FLOORS (and ARCHITECTURE.md): {parts - set(FLOORS)}"


def test_no_import_reaches_a_higher_floor() -> None:
    wrong = []
    for path in _modules():
        source = _module_name(path)
        src = _part(source)
        for target, line in _imports(path):
            if not target.startswith("tieredkv.") or _allowed(source, target):
                continue
            dst = _part(target)
            if dst == src or dst not in FLOORS or src == "tieredkv":
                continue
            if FLOORS[dst] >= FLOORS[src]:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({src}) imports {target} ({dst})")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_only_the_vllm_adapter_imports_vllm() -> None:
    wrong = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}"
        for path in _modules() if _part(_module_name(path)) != "vllm"
        for target, line in _imports(path)
        if target == "vllm" or target.startswith("vllm.")
    ]
    assert not wrong, "only tieredkv/vllm/ may import vLLM:\n" + "\n".join(wrong)


def test_shipped_code_never_imports_the_testing_package() -> None:
    """The connector, ``tieredkv demo`` and the console command run without the test harness."""
    wrong = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}"
        for path in _modules() if _part(_module_name(path)) in SHIPPED
        for target, line in _imports(path)
        if target.startswith("tieredkv.testing") and not _allowed(_module_name(path), target)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_check_itself_catches_a_violation(tmp_path: Path) -> None:
    """The walk sees lazy imports, so a wrong one inside a function would be caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    import vllm.config\n    from tieredkv.vllm import connector\n")
    assert [name for name, _ in _imports(bad)] == ["vllm.config", "tieredkv.vllm", "tieredkv.vllm.connector"]


MAX_MODULE_LINES = 500


def _over_the_limit(files: list[Path]) -> dict[str, int]:
    return {
        str(path.relative_to(PACKAGE.parent)): lines
        for path in files
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }


def test_no_module_outgrows_one_job() -> None:
    """Small modules with one job each: past ~500 lines a module is doing two."""
    big = _over_the_limit(_modules())
    assert not big, f"split these (limit {MAX_MODULE_LINES} lines): {big}"


BENCHMARKS = PACKAGE.parent / "benchmarks"


def test_the_scheduler_and_transfer_parts_stay_within_25_modules() -> None:
    """One vocabulary and one handler per move keep the two busiest parts small (issue 24):
    a new job kind or tier that needs new modules there has to make room first."""
    modules = [f for f in _modules() if _part(_module_name(f)) in ("scheduler", "transfer")
               and f.name != "__init__.py"]
    assert 10 < len(modules) <= 25, sorted(str(f) for f in modules)


def test_no_benchmark_module_outgrows_one_job() -> None:
    """The benchmarks too (their subpackages included): workload, runner, judging and report
    each in a module of their own, none over the package's limit."""
    files = sorted(BENCHMARKS.rglob("*.py"))
    assert len(files) > 10, "the walk found too few benchmark modules"
    big = _over_the_limit(files)
    assert not big, f"split these (limit {MAX_MODULE_LINES} lines): {big}"


# The worker process runs the worker half alone: it must not load the scheduler's decisions.
WORKER_HALF = "tieredkv.vllm.worker_side"
SCHEDULER_HALF = ("tieredkv.scheduler", "tieredkv.vllm.scheduler_side")


def _package_modules() -> dict[str, Path]:
    return {_module_name(path): path for path in _modules()}


def _reached(start: str, modules: dict[str, Path]) -> dict[str, str]:
    """Every package module importing ``start`` loads (its imports, theirs, and the packages
    above each), mapped to the module that first imports it."""
    seen, todo = {start: start}, [start]
    while todo:
        source = todo.pop()
        for target, _ in _imports(modules[source]):
            parts = target.split(".")
            for n in range(1, len(parts) + 1):  # importing a.b.c runs a and a.b first
                name = ".".join(parts[:n])
                if name in modules and name not in seen:
                    seen[name] = source
                    todo.append(name)
    return seen


def test_the_worker_half_never_imports_the_scheduler_half() -> None:
    """What both halves need (slot counts, metadata, geometry) sits below both: a worker that
    loaded the planner would be one refactor away from deciding placement itself."""
    reached = _reached(WORKER_HALF, _package_modules())
    wrong = sorted(
        f"{name} (imported by {by})" for name, by in reached.items()
        if any(name == s or name.startswith(s + ".") for s in SCHEDULER_HALF)
    )
    assert not wrong, f"{WORKER_HALF} reaches the scheduler half:\n" + "\n".join(wrong)


def test_the_reach_follows_imports_through_other_modules(tmp_path: Path) -> None:
    """The walk follows a chain (a -> b -> c) and the packages above an imported module."""
    for name, text in {"a": "import tieredkv.b\n", "b": "def f():\n    from tieredkv.p.c import x\n",
                       "p": "", "c": ""}.items():
        (tmp_path / f"{name}.py").write_text(text)
    modules = {"tieredkv.a": tmp_path / "a.py", "tieredkv.b": tmp_path / "b.py",
               "tieredkv.p": tmp_path / "p.py", "tieredkv.p.c": tmp_path / "c.py"}
    assert _reached("tieredkv.a", modules) == {
        "tieredkv.a": "tieredkv.a", "tieredkv.b": "tieredkv.a",
        "tieredkv.p": "tieredkv.b", "tieredkv.p.c": "tieredkv.b",
    }
