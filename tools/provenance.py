"""Where each figure in the prose comes from: every number with a unit or an "x" in the lessons'
markdown, README.md and docs/benchmarks/LEDGER.md, traced to a stored output or a JSON key.

    python tools/provenance.py [docs/provenance.md]

A figure (a number followed by a unit such as GB/s, tokens/s, ms, s, GB, %, or by "x") is traced when
- it appears in a stored cell output of the same notebook (or of the notebook its passage names:
  "notebook 06"), or
- its passage names a JSON file (`name.json`, under docs/benchmarks/ or anywhere in the repository)
  that holds the value at the precision written (a fraction may be written as a percentage, seconds
  as ms or us, bytes as GB), under a key the passage names in backticks where it names one, or
- it is a ratio (x) or a share (%) of two figures of its passage, or
- its passage says it is not a measurement ("not measured", "datasheet", "nominal", "estimate",
  "by construction", "by definition").
A passage is a paragraph or a list item; where it cites nothing, the cell (or the section of a
markdown file) around it is searched. Phrases that promise work ("to come", "not yet", "not built",
...) are listed with the sentence they stand in: the list is stored in docs/provenance.md, so a new
one, or one that went away, changes the report and must be read again. `make test` fails when a
figure is not traced or the stored report is out of date (tests/test_provenance.py).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "notebooks").glob("*.ipynb")) + [ROOT / "README.md", ROOT / "docs/benchmarks/LEDGER.md"]

UNITS = (r"x\b|×|%|\s?(?:GB/s|TB/s|MB/s|GiB/s|tokens?/s|tok/s|requests?/s|steps?/s|ms\b|us\b|µs\b|ns\b|s\b|"
         r"seconds?\b|minutes?\b|min\b|hours?\b|GB\b|GiB\b|MB\b|MiB\b|KB\b|KiB\b|TB\b|bytes\b|TFLOP/s|GFLOP/s)")
NUMBER = r"\d[\d,]*(?:\.\d+)?k?"
FIGURE = re.compile(rf"(?<![\w.,/-])({NUMBER})(?:\s?(?:-|–|to)\s?({NUMBER}))?({UNITS})")
ANY_NUMBER = re.compile(rf"(?<![\w.])({NUMBER})(?![\w])")
JSON_NAME = re.compile(r"[\w./-]+\.json\b")
NOTEBOOK_NAME = re.compile(r"\bnotebooks? (\d\d)\b")
KEY = re.compile(r"`([^`\s]+)`")
NOT_MEASURED = re.compile(r"not measured|datasheet|nominal|estimate|by construction|by definition", re.I)
PROMISES = re.compile(r"to come\b|not yet\b|not built\b|nothing uses it yet|will be built|later issue", re.I)
SCALES = (1, 100, 1e-2, 1e3, 1e-3, 1e6, 1e-6, 1e9, 1e-9, 1e12, 2 ** -30, 2 ** -20, 2 ** 30)


@dataclass
class Figure:
    where: str     # file and cell or line
    text: str      # as written
    source: str    # how it was traced ("" when it was not)


def value(text: str) -> tuple[float, int]:
    """A written number's value and decimals: '4,281' -> (4281, 0); '1.7' -> (1.7, 1); '42k' -> (42000, -3)."""
    thousands = text.endswith("k")
    text = text.rstrip("k").replace(",", "")
    decimals = len(text.split(".")[1]) if "." in text else 0
    return float(text) * (1000 if thousands else 1), decimals - 3 * thousands


def matches(x: float, target: float, decimals: int) -> bool:
    """x rounds to target at the precision written (half a unit of the last digit either way)."""
    return abs(x - target) <= 0.5 * 10 ** -decimals + 1e-9 * abs(target)


def leaves(obj, path: str = "") -> list[tuple[str, float]]:
    if isinstance(obj, dict):
        return [leaf for k, v in obj.items() for leaf in leaves(v, f"{path}.{k}" if path else str(k))]
    if isinstance(obj, list):
        return [leaf for i, v in enumerate(obj) for leaf in leaves(v, f"{path}[{i}]")]
    if isinstance(obj, (int, float)) and not isinstance(obj, bool) and math.isfinite(obj):
        return [(path, float(obj))]
    return []


@cache
def json_leaves(name: str) -> list[tuple[str, float]] | None:
    hits = [ROOT / "docs/benchmarks" / Path(name).name] + sorted(ROOT.glob(f"**/{Path(name).name}"))
    path = next((p for p in hits if p.exists() and ".venv" not in p.parts), None)
    return leaves(json.loads(path.read_text())) if path else None


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


def traced_in_json(text: str, passage: str) -> str | None:
    target, decimals = value(text)
    keys = set(KEY.findall(passage))
    for name in dict.fromkeys(JSON_NAME.findall(passage)):
        found = json_leaves(name)
        if not found:
            continue
        named = [(p, x) for p, x in found if any(k in p.split(".") or p.startswith(k) or k in p for k in keys)]
        for pool in (named, found):
            for path, x in pool:
                if any(matches(x * s, target, decimals) for s in SCALES):
                    return f"{Path(name).name}: {path}"
    return None


def traced_as_ratio(text: str, passage: str) -> str | None:
    """A ratio or a share of two other numbers of the passage (as written there)."""
    target, decimals = value(text)
    numbers = [value(m)[0] for m in ANY_NUMBER.findall(passage) if m != text]
    numbers = [n for n in numbers if n]
    for a in numbers:
        for b in numbers:
            if a is not b and any(matches(r, target, decimals) for r in (a / b, 100 * a / b, 100 * (a / b - 1))):
                return f"{a:g} / {b:g}"
    return None


def passages(markdown: str) -> list[str]:
    """Paragraphs and list items, code left out."""
    markdown = re.sub(r"```.*?```", "", markdown, flags=re.S)
    return [p for block in re.split(r"\n\s*\n", markdown) for p in re.split(r"\n(?=\s*[-*] |\s*\d+\. )", block)]


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
        return "marked as not a measurement"
    return ""


def figures_of(path: Path) -> tuple[list[Figure], list[tuple[str, str]]]:
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        units = [(f"{path.name} cell {i}", "".join(c["source"])) for i, c in enumerate(cells)
                 if c["cell_type"] == "markdown"]
        notebook: Path | None = path
    else:
        text = path.read_text()
        units = [(f"{path.name} section {i}", s) for i, s in enumerate(re.split(r"\n(?=#+ )", text))]
        notebook = None
    figures, promises = [], []
    for where, unit in units:
        for passage in passages(unit):
            plain = re.sub(r"`[^`]*`", lambda m: m.group(0) if ".json" in m.group(0) else "``", passage)
            for m in FIGURE.finditer(plain):
                for text in filter(None, (m.group(1), m.group(2))):
                    figures.append(Figure(where, text + m.group(3).strip(),
                                          trace(text, m.group(3).strip(), passage, unit, notebook)))
            for sentence in re.split(r"(?<=[.!?])\s+", passage):
                if PROMISES.search(sentence):
                    promises.append((where, " ".join(sentence.split())))
    return figures, promises


def audit() -> tuple[list[Figure], list[tuple[str, str]]]:
    figures, promises = [], []
    for path in SOURCES:
        f, p = figures_of(path)
        figures += f
        promises += p
    return figures, promises


if __name__ == "__main__":
    figs, proms = audit()
    bad = [f for f in figs if not f.source]
    for f in bad:
        print(f"UNTRACED {f.where}: {f.text}")
    print(f"{len(figs)} figures, {len(bad)} untraced; {len(proms)} promises")
    for w, s in proms:
        print("PROMISE", w, s[:150])
