"""Where each figure in the prose comes from: every number with a unit or an "x" in the lessons'
markdown, README.md and docs/ (but this report), traced to a stored output or a JSON key.

    python tools/provenance.py [docs/provenance.md]

A figure (a number followed by a unit such as GB/s, tokens/s, ms, s, GB, %, or by "x") is traced when
- it appears in a stored cell output of the same notebook (or of the notebook its passage names:
  "notebook 06"), or
- its passage names a JSON file (`name.json`, under docs/benchmarks/ or anywhere in the repository)
  that holds the value at the precision written (a fraction may be written as a percentage, seconds
  as ms or us, bytes as GB), under a key the passage names in backticks where it names one (lists of
  over 64 numbers, traces, are not searched: any figure is somewhere in them), or
- it is arithmetic on traced figures of its passage (2.47 GB / 4,281 GB/s = 0.58 ms), or
- it is a ratio (x) or a share (%) of two figures of its passage, or a default of the command-line
  option named beside it (miniinfer/cli.py), or
- its passage says it is not a measurement ("not measured", "datasheet", "nominal", "estimate",
  "by construction", "by definition") or that it was measured and not stored ("not stored"): the
  report lists these apart, as figures to measure again into a JSON.
A passage is a paragraph or a list item; where it cites nothing, the cell (or the section of a
markdown file) around it is searched. Phrases that promise work ("to come", "not yet", "not built",
...) are listed with the sentence they stand in: the list is stored in docs/provenance.md, so a new
one, or one that went away, changes the report and must be read again. `make test` fails when a
figure is not traced or the stored report is out of date (tests/test_provenance.py).
"""

from __future__ import annotations

import bisect
import json
import math
import re
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "notebooks").glob("*.ipynb")) + [ROOT / "README.md"] + sorted(
    p for p in (ROOT / "docs").rglob("*.md") if p.name not in ("provenance.md", "mutants.md"))  # generated reports

UNITS = (r"x\b|×|%|\s?(?:GB/s|TB/s|MB/s|GiB/s|tokens?/s|tok/s|requests?/s|steps?/s|ms\b|us\b|µs\b|ns\b|s\b|"
         r"seconds?\b|minutes?\b|min\b|hours?\b|GB\b|GiB\b|MB\b|MiB\b|KB\b|KiB\b|TB\b|bytes\b|TFLOP/s|GFLOP/s)")
NUMBER = r"\d[\d,]*(?:\.\d+)?k?"
FIGURE = re.compile(rf"(?<![\w.,/-])({NUMBER})(?:\s?(?:-|–|to)\s?({NUMBER}))?({UNITS})")
ANY_NUMBER = re.compile(rf"(?<![\w.])({NUMBER})(?![\w])")
JSON_NAME = re.compile(r"[\w./-]+\.json\b")
NOTEBOOK_NAME = re.compile(r"\bnotebooks? (\d\d)\b")
KEY = re.compile(r"`([^`\s]+)`")
NOT_MEASURED = re.compile(r"not\s+measured|not\s+stored|not\s+a\s+measurement|not\s+in\s+a\s+JSON|no\s+current\s+JSON|"
                          r"datasheet|nominal|estimate|by\s+construction|by\s+definition|computed\s+from\s+the\s+JSON|"
                          r"computed\s+from\s+`", re.I)
PROMISES = re.compile(r"to come\b|not yet\b|not built\b|nothing uses it yet|will be built|later issue", re.I)
SCALES = (1, 100, 1e-2, 1e3, 1e-3, 1e6, 1e-6, 1e9, 1e-9, 1e12, 2 ** -30, 2 ** -20, 2 ** 30)


@dataclass
class Figure:
    where: str     # file and cell or section
    number: str    # as written: "4,281"
    unit: str      # "GB/s"
    source: str    # how it was traced ("" when it was not)

    @property
    def text(self) -> str:
        return f"{self.number} {self.unit}" if self.unit[0].isalpha() else self.number + self.unit


def value(text: str) -> tuple[float, int]:
    """A written number's value and decimals: '4,281' -> (4281, 0); '1.7' -> (1.7, 1); '42k' -> (42000, -3)."""
    thousands = text.endswith("k")
    text = text.rstrip("k").replace(",", "")
    decimals = len(text.split(".")[1]) if "." in text else 0
    return float(text) * (1000 if thousands else 1), decimals - 3 * thousands


def matches(x: float, target: float, decimals: int) -> bool:
    """x rounds to target at the precision written (half a unit of the last digit either way)."""
    return abs(x - target) <= 0.5 * 10 ** -decimals + 1e-9 * abs(target)


LONG = 64  # a list longer than this is a trace or a profile's lanes: thousands of numbers, any figure among them


def leaves(obj, path: str = "", long: bool = False) -> list[tuple[str, float, bool]]:
    """Every number of a JSON document with its key path, and whether it sits in a long list."""
    if isinstance(obj, dict):
        return [leaf for k, v in obj.items() for leaf in leaves(v, f"{path}.{k}" if path else str(k), long)]
    if isinstance(obj, list):
        return [leaf for i, v in enumerate(obj) for leaf in leaves(v, f"{path}[{i}]", long or len(obj) > LONG)]
    if isinstance(obj, (int, float)) and not isinstance(obj, bool) and math.isfinite(obj):
        return [(path, float(obj), long)]
    return []


@cache
def json_leaves(name: str) -> list[tuple[str, float, bool]] | None:
    path = ROOT / "docs/benchmarks" / Path(name).name
    if not path.exists():  # elsewhere in the checkout: a walk of the whole tree, so only when needed
        path = next((p for p in sorted(ROOT.glob(f"**/{Path(name).name}")) if ".venv" not in p.parts), None)
    return leaves(json.loads(path.read_text())) if path else None


@cache
def json_pools(name: str, keys: frozenset[str]) -> tuple[list[tuple[str, float]], ...]:
    """A JSON document's numbers to search for a passage's figure, in order: those under a key the
    passage names (a long list, a trace, is searched only so), then every number outside long lists."""
    found = json_leaves(name) or []
    return ([(p, x) for p, x, _ in found if any(k in p for k in keys)],
            [(p, x) for p, x, long in found if not long])


@cache
def outputs(notebook: Path) -> str:
    """The stored outputs' text, thousands separators dropped."""
    cells = json.loads(notebook.read_text())["cells"]
    texts = []
    for c in cells:
        for o in c.get("outputs", []):
            texts.append("".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", "")))
    return "\n".join(texts).replace(",", "")


def in_outputs(text: str, notebook: Path) -> bool:
    digits = text.rstrip("k").replace(",", "")
    return re.search(rf"(?<![\d.]){re.escape(digits)}(?![\d])", outputs(notebook)) is not None


@cache
def sorted_pools(name: str, keys: frozenset[str]) -> tuple[tuple[list[float], list[int]], ...]:
    """Each of json_pools' lists as its numbers in increasing order and their places in the list: the
    numbers near a figure are then found by bisection, not by comparing every one."""
    out = []
    for pool in json_pools(name, keys):
        order = sorted(range(len(pool)), key=lambda i: pool[i][1])
        out.append(([pool[i][1] for i in order], order))
    return tuple(out)


def traced_in_json(text: str, passage: str) -> str | None:
    """The first number of the passage's JSON documents (in json_pools' order) that rounds to the
    figure at one of SCALES."""
    target, decimals = value(text)
    keys = frozenset(KEY.findall(passage))
    near = 1.0 * 10 ** -decimals + 2e-9 * abs(target)  # twice matches' tolerance: it has the last word
    for name in dict.fromkeys(JSON_NAME.findall(passage)):
        for pool, (xs, order) in zip(json_pools(name, keys), sorted_pools(name, keys)):
            spans = [(s, bisect.bisect_left(xs, (target - near) / s), bisect.bisect_right(xs, (target + near) / s))
                     for s in SCALES]
            hits = [order[j] for s, lo, hi in spans for j in range(lo, hi) if matches(xs[j] * s, target, decimals)]
            if hits:
                return f"{Path(name).name}: {pool[min(hits)][0]}"
    return None


def traced_as_ratio(text: str, passage: str) -> str | None:
    """A ratio or a share of two other numbers of the passage (as written there)."""
    target, decimals = value(text)
    numbers = [value(m) for m in ANY_NUMBER.findall(passage) if m != text]
    numbers = [(n, d) for n, d in numbers if n]
    for a, da in numbers:
        for b, db in numbers:
            # The operands are rounded too: their last digits move the ratio by this much.
            slack = 0.5 * 10 ** -da / a + 0.5 * 10 ** -db / b
            for r in (a / b, 100 * a / b, 100 * (a / b - 1)):
                if (a, da) is not (b, db) and abs(r - target) <= 0.5 * 10 ** -decimals + abs(r) * slack:
                    return f"{a:g} / {b:g}"
    return None


def traced_as_arithmetic(text: str, traced: list[str]) -> str | None:
    """A product, quotient or difference of two traced figures of the passage (or the reciprocal of
    one), in any unit of the same kind: 2.47 GB / 4,281 GB/s = 0.58 ms."""
    target, decimals = value(text)
    figures = [value(t)[0] for t in traced if t != text]
    for a in figures:
        for b in figures:
            candidates = {"/": a / b if b else math.nan, "*": a * b, "-": a - b, "1/": 1 / a if a else math.nan}
            for op, r in candidates.items():
                if any(matches(r * s, target, decimals) for s in SCALES):
                    return f"{a:g} {op} {b:g}" if op != "1/" else f"1 / {a:g}"
    return None


@cache
def cli_defaults() -> dict[str, float]:
    """Each command-line option's default, as miniinfer/cli.py declares it."""
    text = (ROOT / "miniinfer/cli.py").read_text()
    return {flag: float(v) for flag, v in re.findall(r'"(--[\w-]+)",[^\n]*?default=([\d.]+)', text)}


def a_default(text: str, near: str) -> str | None:
    """A figure next to a backticked `--option` whose default it is."""
    target, decimals = value(text)
    for flag in re.findall(r"`(--[\w-]+)`", near):
        if flag in cli_defaults() and matches(cli_defaults()[flag], target, decimals):
            return f"the default of {flag} (miniinfer/cli.py)"
    return None


def passages(markdown: str) -> list[str]:
    """Paragraphs, list items and table rows (each row names its own source), code left out."""
    markdown = re.sub(r"```.*?```", "", markdown, flags=re.S)
    return [p for block in re.split(r"\n\s*\n", markdown) for p in re.split(r"\n(?=\s*[-*] |\s*\d+\. |\|)", block)]


def trace(text: str, unit: str, passage: str, around: str, notebook: Path | None) -> str:
    cited_notebooks = [p for n in NOTEBOOK_NAME.findall(passage + around)
                       for p in (ROOT / "notebooks").glob(f"{n}_*.ipynb")]
    for nb in ([notebook] if notebook else []) + cited_notebooks:
        if in_outputs(text, nb):
            return f"stored output of {nb.name}"
    for scope in (passage, around):
        if hit := traced_in_json(text, scope):
            return hit
    if unit in ("x", "×", "%") and (hit := traced_as_ratio(text, passage)):
        return f"ratio of {hit} in its passage"
    if NOT_MEASURED.search(passage):
        return "marked as not a stored measurement"
    return ""


def figures_of(path: Path) -> tuple[list[Figure], list[tuple[str, str]]]:
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        sources = ["".join(c["source"]) for c in cells]
        # A cell's surroundings: it and the three cells before it (a code cell that loads the JSON it
        # plots names it there).
        units = [(f"{path.name} cell {i}", sources[i], "\n".join(sources[max(0, i - 3):i + 1]))
                 for i, c in enumerate(cells) if c["cell_type"] == "markdown"]
        notebook: Path | None = path
    else:
        text = path.read_text()
        units = [(f"{path.relative_to(ROOT)} section {i}", s, s) for i, s in enumerate(re.split(r"\n(?=#+ )", text))]
        notebook = None
    figures, promises = [], []
    for where, unit, around in units:
        for passage in passages(unit):
            plain = re.sub(r"`[^`]*`", lambda m: m.group(0) if ".json" in m.group(0) else "``", passage)
            found, parts = [], []
            for m in FIGURE.finditer(plain):
                inside = re.match(r"\s*\(([^)]*)\)", plain[m.end():])
                at = re.search(rf"(?<![\d.]){re.escape(m.group(0))}", passage)
                near = passage[max(0, at.start() - 40):at.end() + 40] if at else ""
                for number in filter(None, m.group(1, 2)):
                    found.append(Figure(where, number, m.group(3).strip(), a_default(number, near)
                                        or trace(number, m.group(3).strip(), passage, around, notebook)))
                    parts.append(ANY_NUMBER.findall(inside.group(1)) if inside else [])
            traced = [f.number for f in found if f.source]
            for f, its in zip(found, parts):  # then arithmetic on the passage's traced figures
                if f.source:
                    continue
                if hit := traced_as_arithmetic(f.number, traced):
                    f.source = f"{hit} (traced figures of its passage)"
                elif len(its) > 1 and abs(sum(value(n)[0] for n in its) - value(f.number)[0]) <= \
                        0.5 * 10 ** -value(f.number)[1] * (len(its) + 1):  # each part rounded too
                    f.source = f"the sum of its parts, {' + '.join(its)}"  # given in parentheses after it
            figures += found
            for sentence in re.split(r"(?<=[.!?])\s+|\n(?=\|)", passage):  # sentences, table rows
                if PROMISES.search(sentence):
                    promises.append((where, " ".join(sentence.split())))
    return figures, promises


@cache
def audit() -> tuple[list[Figure], list[tuple[str, str]]]:
    figures, promises = [], []
    for path in SOURCES:
        f, p = figures_of(path)
        figures += f
        promises += p
    return figures, promises


def report() -> str:
    """docs/provenance.md: the count of figures by how they were traced, those the prose says are not
    stored measurements (to measure again into a JSON), the untraced ones, and every promise."""
    figures, promises = audit()
    kinds = {"a stored cell output": "stored output", "a JSON key": ".json: ", "arithmetic or a sum": " (",
             "a ratio of its passage": "ratio of", "a command-line default": "the default of",
             "declared not stored or not measured": "marked as"}
    lines = ["# Where the prose's figures come from", "",
             "Written by `python tools/provenance.py` (and checked by `make test`: tests/test_provenance.py) "
             "from the lessons' markdown, README.md and docs/benchmarks/LEDGER.md. Each number with a unit or "
             "an x is traced to a stored cell output, a JSON key, arithmetic on traced figures of its passage, "
             "or a command-line default; or its passage says it is not a stored measurement.", "",
             "| traced by | figures |", "| --- | --- |"]
    for kind, mark in kinds.items():
        lines.append(f"| {kind} | {sum(mark in f.source for f in figures)} |")
    untraced = [f for f in figures if not f.source]
    lines += [f"| **not traced** | {len(untraced)} |", "", "## Declared not stored, or not measurements",
              "To measure again into a JSON where they are measurements:", ""]
    lines += [f"- {f.where}: {f.text}" for f in figures if f.source.startswith("marked as")]
    if untraced:
        lines += ["", "## Not traced", ""] + [f"- {f.where}: {f.text}" for f in untraced]
    lines += ["", "## Promises", "Sentences that say something is not built or not yet so, to read again "
              "whenever this list changes:", ""]
    lines += [f"- {where}: {sentence}" for where, sentence in promises]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs/provenance.md"
    out.write_text(report())
    figs, _ = audit()
    bad = [f for f in figs if not f.source]
    for f in bad:
        print(f"not traced: {f.where}: {f.text}")
    print(f"{len(figs)} figures, {len(bad)} not traced; wrote {out}")
    sys.exit(1 if bad else 0)
