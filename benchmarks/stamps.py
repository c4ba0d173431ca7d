"""How kept results files are stamped and written again: the stamp line run_all puts atop
every Markdown file and under every figure, a re-render from a run's JSON that keeps it, and
the one phrasing of a model's KV size. Text only: nothing here shapes a measurement, so a
change here does not make RESULTS.md call the kept figures stale."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import common

ROOT = Path(__file__).resolve().parent.parent
STAMP_PREFIX = "> Stamped by `benchmarks/run_all.py`:"


def kv_per_token_text(nbytes: int) -> str:
    """A model's KV size as the results files say it (bold, bytes and KiB), so a reader can
    tell a tiny test model's figures from an 8B-class model's at a glance."""
    return f"**{nbytes:,} bytes ({nbytes / 1024:g} KiB) of KV per token**"


def describe_stamp(stamp: dict[str, Any]) -> str:
    """The stamp as one Markdown line (first line of the benchmark's own .md file)."""
    load_b = "/".join(f"{x:.1f}" for x in stamp["load_before"])
    load_a = "/".join(f"{x:.1f}" for x in stamp["load_after"])
    dirty = " **(uncommitted changes: " + ", ".join(stamp["dirty"]) + ")**" if stamp["dirty"] else ""
    return (f"{STAMP_PREFIX} commit `{stamp['commit'][:10]}`{dirty}, profile `{stamp['profile']}`, "
            f"{stamp['date_start']} to {stamp['date_end']}, {stamp['machine']['name']}, load average "
            f"(1/5/15 min) {load_b} before, {load_a} after, exit status {stamp['exit_status']}."
            + (f" Note: {stamp['note']}." if stamp.get("note") else ""))


def stamp_markdown(path: Path, line: str) -> None:
    """The stamp line under the Markdown file's title (replacing an older stamp line)."""
    lines = path.read_text().splitlines()
    lines = [x for x in lines if not x.startswith(STAMP_PREFIX)]
    at = 1 if lines and lines[0].startswith("# ") else 0
    lines[at:at] = ["", line] if at else [line, ""]
    path.write_text("\n".join(lines) + "\n")


def rewrite_from_json(path: Path, out_dir: Path | None, load: Callable[[Path], dict[str, Any]],
                      write: Callable[[dict[str, Any], Path | None], tuple[Path, Path, Path | None]]) -> int:
    """``--from-json`` (:func:`common.rewrite_from_json`) for a stamped run: the text written
    again keeps the run's stamp (the commit and time its figures come from), with a note of the
    commit that wrote it again, so a re-rendered page never passes for a new run."""
    written: list[tuple[dict[str, Any], tuple[Path, Path, Path | None]]] = []

    def write_and_keep(payload: dict[str, Any], out: Path | None) -> tuple[Path, Path, Path | None]:
        paths = write(payload, out)
        written.append((payload, paths))
        return paths

    status = common.rewrite_from_json(path, out_dir, load, write_and_keep)
    for payload, (_, md_path, png_path) in written:
        if payload.get("stamp"):
            line = (describe_stamp(payload["stamp"]) + " Text re-rendered from the run's JSON "
                    f"(`--from-json`) at commit `{common.git_revision(ROOT)}`; the figures are the "
                    "stamped run's.")
            stamp_markdown(md_path, line)
            if png_path is not None:
                stamp_png(png_path, line)
    return status


def stamp_png(path: Path, line: str) -> None:
    """The stamp as a caption strip under the figure (a person sees it) and as a PNG text
    chunk ``tieredkv-stamp`` (a script reads it)."""
    from PIL import Image, ImageDraw
    from PIL.PngImagePlugin import PngInfo

    with Image.open(path) as figure:
        figure.load()
        image = figure.convert("RGB")
    strip = 24
    out = Image.new("RGB", (image.width, image.height + strip), "white")
    out.paste(image, (0, 0))
    ImageDraw.Draw(out).text((8, image.height + 6), line.replace("`", "").replace("**", ""), fill="black")
    info = PngInfo()
    info.add_text("tieredkv-stamp", line)
    out.save(path, pnginfo=info)
