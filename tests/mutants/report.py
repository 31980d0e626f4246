"""The kill report: every wrong answer of tests/mutants/ run against its check, and the case that rejects it.

    python tests/mutants/report.py [docs/mutants.md]

Writes a table per chapter: the exercise, the wrong answer (its name, and its docstring's first line or
the comment on its first line: why it is wrong), and the first line of the check's message (which case
of how many rejected it). A mutant that passes is listed as NOT REJECTED and the command fails; the
test suite (tests/test_checks.py) fails on it too.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # the mutants, as the test suite imports them

from miniinfer.course import checks  # noqa: E402


def why(wrong) -> str:
    """The mutant's docstring's first line, or the comment on the line that defines it."""
    wrong = getattr(wrong, "fn", wrong)  # a @triton.jit function: the Python function it wraps
    own = wrong.__dict__.get("__doc__") if isinstance(wrong, type) else wrong.__doc__  # not a base class's
    doc = inspect.cleandoc(own or "").split("\n")[0]
    if doc:
        return doc
    first = inspect.getsource(wrong).split("\n")[0]
    return first.split("#", 1)[1].strip() if "#" in first else ""


def rows() -> list[tuple[str, str, str, str]]:
    """(exercise id, mutant name, why, what rejected it) for every mutant, in chapter order."""
    import importlib
    ids = {e.check: e.id for e in checks.EXERCISES.values()}
    out = []
    for chapter in sorted({e.chapter for e in checks.EXERCISES.values()}):
        module = importlib.import_module(f"mutants.ch{chapter}")
        for check, wrong in module.MUTANTS:
            try:
                check(wrong)
                verdict = "NOT REJECTED"
            except AssertionError as err:
                verdict = str(err).split("\n")[0]
            out.append((ids[check], wrong.__name__, why(wrong), verdict))
    return out


def report(table: list[tuple[str, str, str, str]]) -> str:
    lines = ["# Mutants: the wrong answers each check rejects", "",
             "Written by `python tests/mutants/report.py` from `tests/mutants/` (the test suite runs them too). Each "
             "row: a plausible wrong answer, why it is wrong, and the first line of the check's message "
             "on it: the case that rejected it.", ""]
    for chapter in dict.fromkeys(i.split(".")[0] for i, *_ in table):
        lines += [f"## Problem set {chapter}", "", "| exercise | wrong answer | why | rejected by |",
                  "|---|---|---|---|"]
        lines += [f"| `{i}` | `{name}` | {w} | {v} |" for i, name, w, v in table if i.startswith(chapter + ".")]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "mutants.md"
    table = rows()
    out.write_text(report(table))
    survivors = [r for r in table if r[3] == "NOT REJECTED"]
    print(f"{len(table)} mutants, {len(table) - len(survivors)} rejected; report in {out}")
    sys.exit(1 if survivors else 0)
