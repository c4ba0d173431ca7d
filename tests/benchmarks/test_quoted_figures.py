"""Benchmark figures quoted in the docs come from a kept results file, named beside them (#27).

Scanned: README.md, CHANGELOG.md's [Unreleased] section and benchmarks/README.md, paragraph
by paragraph (a CHANGELOG bullet is one paragraph; code blocks and tables are skipped).

- A *measured figure* is a decimal number with a unit (``1.19x``, ``39.5 ms``, ``1.46 GB/s``,
  ``+5.76 MiB/h``, ``51 %`` is not one: no decimals), including the other decimals of a list
  that ends with the unit (``39.5 against 34.9 ms``). A figure after a comparison (``<= 1.3x``,
  ``at least 0.8x``) is a target, not a measurement, and is skipped.
- Every measured figure needs a kept results file (``results/<name>.md|json|txt``) named in its
  paragraph, and must appear in that file (or a sibling with the same stem). In a paragraph that
  names one, counts with a thousands separator (``3,968 tokens``) must appear there too.
- Where the file shows a pair of ratios for one row (cross-engine and same-engine, as
  ``e2e_ttft``'s verdict tables do), a quoted ratio must be the worse of its pair: a
  quote may not pick the kinder one (it may give it beside the worse one).
- ``R x (A against B ms)``: the ratio right before a pair of times must be their ratio.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ("README.md", "CHANGELOG.md", "benchmarks/README.md")

UNIT = r"(?:x|×|ms|GB/s|MB/s|MiB/h|tok/s|%)"
NUM = r"[+-]?\d+\.\d+"
# A decimal, optionally followed by more decimals joined by a list word, then the unit.
FIGURE = re.compile(
    rf"(?<![\w.]){NUM}(?:(?:\s*,\s*|\s+and\s+|\s+against\s+(?:a\s+)?|\s+vs\.?\s+|\s*/\s*){NUM})*"
    rf"\s?{UNIT}(?![\w/])")
DECIMAL = re.compile(NUM)
COUNT = re.compile(r"(?<![\w.,])\d{1,3}(?:,\d{3})+(?![\w-]|,\d|\.\d)")
FILE = re.compile(r"(?:benchmarks/)?results/([\w-]+)\.(?:md|json|txt|png)")
TARGET_BEFORE = re.compile(r"(?:<=|>=|≤|≥|<|>|at least|at most|under|over|above|below)\s*$")
AGAINST = re.compile(rf"({NUM})\s*(?:ms\s+)?against\s+(?:a\s+)?({NUM})\s*ms")
RATIO = re.compile(rf"({NUM})\s?[x×](?![\w/])")


@dataclass(frozen=True)
class Paragraph:
    doc: str
    line: int
    text: str


def _unreleased(text: str) -> str:
    """CHANGELOG's [Unreleased] section only (released entries quote the runs of their day)."""
    match = re.search(r"^## \[Unreleased\][^\n]*\n(.*?)(?=^## \[|\Z)", text, re.S | re.M)
    return match.group(1) if match else ""


def paragraphs(doc: str, text: str) -> list[Paragraph]:
    """Blank-line separated paragraphs and top-level bullets, without code blocks or tables."""
    out: list[Paragraph] = []
    current: list[str] = []
    start = 0
    fenced = False

    def flush() -> None:
        if current:
            out.append(Paragraph(doc, start, " ".join(current)))
            current.clear()

    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            flush()
            continue
        if fenced or line.lstrip().startswith("|") or not line.strip() or line.startswith("#"):
            flush()
            continue
        if line.startswith("- ") or line.startswith("* "):
            flush()
        if not current:
            start = number
        current.append(line.strip())
    flush()
    return out


def all_paragraphs() -> list[Paragraph]:
    found = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        if doc == "CHANGELOG.md":
            text = _unreleased(text)
        found += paragraphs(doc, text)
    return found


def measured(text: str) -> list[str]:
    """The measured figures of a paragraph (numbers as written, units dropped; targets skipped)."""
    figures = []
    for match in FIGURE.finditer(text):
        if TARGET_BEFORE.search(text[max(0, match.start() - 12):match.start()]):
            continue
        figures += [d.lstrip("+-") for d in DECIMAL.findall(match.group(0))]
    return figures


def kept_text(stem: str) -> str | None:
    """Every kept file of that results stem, concatenated; None when none is kept."""
    files = [p for p in RESULTS.glob(f"{stem}.*") if p.suffix in (".md", ".json", ".txt")]
    return "\n".join(p.read_text() for p in files) if files else None


def appears(figure: str, text: str) -> bool:
    forms = {figure, figure.replace(",", "")}
    return any(re.search(rf"(?<![\d.]){re.escape(f)}(?![\d])", text) for f in forms)


def ratio_pairs(markdown: str) -> list[tuple[str, str]]:
    """(cross-engine, same-engine) ratio pairs of every table that has both columns."""
    pairs = []
    lines = markdown.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("|") or "cross-engine" not in line or "same engine" not in line:
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        cross = next(j for j, c in enumerate(cells) if "cross-engine" in c)
        same = next(j for j, c in enumerate(cells) if "same engine" in c)
        for row in lines[i + 2:]:
            if not row.startswith("|"):
                break
            values = [c.strip().strip("*") for c in row.strip("|").split("|")]
            if max(cross, same) < len(values) and all(
                    re.fullmatch(r"\d+\.\d+", values[k]) for k in (cross, same)):
                pairs.append((values[cross], values[same]))
    return pairs


def kinder_ratios(stem: str) -> dict[str, set[str]]:
    """Ratios the file shows only as the better side of a pair (lower is better), each with
    the worse sides it is paired with."""
    path = RESULTS / f"{stem}.md"
    if not path.exists():
        return {}
    pairs = ratio_pairs(path.read_text())
    worse = {max(p, key=float) for p in pairs}
    kinder: dict[str, set[str]] = {}
    for pair in pairs:
        low, high = sorted(pair, key=float)
        if low != high and low not in worse:
            kinder.setdefault(low, set()).add(high)
    return kinder


def problems(paragraph: Paragraph) -> list[str]:
    """What is wrong with the figures quoted in one paragraph (empty: nothing)."""
    where = f"{paragraph.doc}:{paragraph.line}"
    text = paragraph.text
    stems = sorted(set(FILE.findall(text)))
    figures = measured(text)
    found: list[str] = []
    if figures and not stems:
        return [f"{where}: {figures} quoted with no results file named"]
    if not stems:
        return []
    kept = {stem: kept_text(stem) for stem in stems}
    for stem, body in kept.items():
        if body is None:
            found.append(f"{where}: names results/{stem}.* but no such file is kept")
    bodies = [b for b in kept.values() if b is not None]
    for figure in figures + COUNT.findall(text):
        if not any(appears(figure, body) for body in bodies):
            found.append(f"{where}: {figure} is in none of {stems}")
    kinder: dict[str, set[str]] = {}
    for stem in stems:
        for low, highs in kinder_ratios(stem).items():
            kinder.setdefault(low, set()).update(highs)
    quoted = {m.group(1) for m in RATIO.finditer(text)}
    for match in RATIO.finditer(text):
        low = match.group(1)
        if low in kinder and not kinder[low] & quoted and not TARGET_BEFORE.search(
                text[max(0, match.start() - 12):match.start()]):
            found.append(f"{where}: {low}x is the kinder ratio of its pair ({sorted(kinder[low])}); "
                         "quote the worse (the kinder one only beside it)")
    for pair in AGAINST.finditer(text):
        before = list(RATIO.finditer(text[max(0, pair.start() - 80):pair.start()]))
        if before:
            quoted, a, b = float(before[-1].group(1)), float(pair.group(1)), float(pair.group(2))
            if abs(round(a / b, 2) - quoted) > 0.011:
                found.append(f"{where}: {quoted}x next to {a} against {b} ms, which is {a / b:.2f}x")
    return found


def test_every_quoted_figure_is_in_the_kept_file_it_names() -> None:
    found = [p for paragraph in all_paragraphs() for p in problems(paragraph)]
    assert not found, "\n".join(found)


# The checks themselves, on made-up paragraphs against the kept e2e_ttft file.

def _one(text: str) -> list[str]:
    return problems(Paragraph("doc", 1, text))


@pytest.mark.skipif(not (RESULTS / "e2e_ttft.md").exists(), reason="no kept e2e_ttft run")
def test_the_checks_catch_each_kind_of_drift() -> None:
    e2e = "(`benchmarks/results/e2e_ttft.md`)"
    pairs = kinder_ratios("e2e_ttft")
    assert pairs, "the kept e2e_ttft file has no cross/same-engine pair"
    kinder, worse = next((low, min(highs, key=float)) for low, highs in pairs.items())
    assert _one(f"A hit took {worse}x the floor at worst {e2e}.") == []
    assert "kinder" in " ".join(_one(f"A hit took {kinder}x the floor {e2e}."))
    assert _one(f"A hit took {worse}x the floor at worst ({kinder}x cross-engine) {e2e}.") == []
    assert "no results file" in " ".join(_one(f"A hit took {worse}x the floor."))
    assert "in none of" in " ".join(_one(f"A hit took 917.3 ms {e2e}."))
    assert "in none of" in " ".join(_one(f"It hit 9,999 tokens {e2e}."))
    assert "no such file" in " ".join(_one("It took 1.00x (`benchmarks/results/nothing_kept.md`)."))
    # A ratio beside two times must be their ratio.
    assert "which is" in " ".join(_one(f"{worse}x at worst (39.5 against 34.9 ms) {e2e}."))
    # Targets are not quotes.
    assert _one("A hit must take <= 1.3x the floor, at least 0.8x of raw.") == []


def test_paragraphs_split_bullets_and_skip_code_and_tables() -> None:
    text = "intro 1.50x\n\n- one 2.50x\n  more\n- two\n```\n3.50x\n```\n| 4.50x |\n"
    got = [(p.line, p.text) for p in paragraphs("d", text)]
    assert got == [(1, "intro 1.50x"), (3, "- one 2.50x more"), (5, "- two")]
    assert measured("took 39.5 against 34.9 ms, then 1.19x; limit <= 1.3x") == ["39.5", "34.9", "1.19"]
