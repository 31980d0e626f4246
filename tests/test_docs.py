"""The course's documents are its own: every link of its markdown (files and notebooks' markdown cells)
reaches a file inside the repository, no file names a design document the repository does not hold,
and the README stays a landing page."""

import json
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")
# Spelled in two pieces, so that this file does not name it either.
OUTSIDE_NAMES = ("COURSE" + ".md", "../" + "shared/")


def tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / line for line in out.splitlines()]


def markdown_of(path: Path) -> str:
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return path.read_text()


def test_no_file_names_a_document_outside_the_repository():
    named = []
    for path in tracked():
        if not path.is_file() or path.suffix in (".safetensors", ".png", ".whl"):
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        named += [f"{path.relative_to(ROOT)}: {name}" for name in OUTSIDE_NAMES if name.lower() in text.lower()]
    assert not named, named


def test_every_relative_link_reaches_a_file_of_the_repository():
    broken = []
    for path in tracked():
        if path.suffix not in (".md", ".ipynb") or not path.is_file():
            continue
        for target in LINK.findall(markdown_of(path)):
            if re.match(r"[a-z]+:|#", target):  # a web address, mail, or a heading of the same page
                continue
            where = (path.parent / target.split("#")[0]).resolve()
            if not where.is_relative_to(ROOT) or not where.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_the_readme_is_a_landing_page():
    """At most 1,200 words, and every figure it quotes names the JSON that holds it (the provenance
    report traces each one: tests/test_provenance.py)."""
    text = (ROOT / "README.md").read_text()
    assert len(re.sub(r"```.*?```", "", text, flags=re.S).split()) <= 1200
    for row in (line for line in text.splitlines() if line.startswith("| ") and re.search(r"\d", line)):
        if re.search(r"tokens/s|%|\dx\b", row):
            assert ".json" in row, row
