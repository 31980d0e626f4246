"""`miniinfer grade`: run students' problem-set notebooks and record every exercise's status.

Hand-written module. Each notebook runs top to bottom in a fresh kernel (nbclient) within a time
limit. Exercises are found by the ids their cells carry in their metadata (`miniinfer.check`), not by
position, and every check cell is replaced by the canonical check before it runs, so an edited check
cell grades the same as the original. An exercise whose check cell is gone is checked at the end.
Statuses: passed, failed (a wrong result), error (the code raised, the function is missing, the
kernel died, the file is not a notebook), unanswered, timeout.

This runs the students' code: do it in a container or a throw-away account.
"""

from __future__ import annotations

import csv
import os
import re
import subprocess
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Callable, Iterable

from miniinfer.course.checks import EXERCISES, Exercise, problem_set

STATUSES = ("passed", "failed", "error", "unanswered", "timeout")
COLUMNS = ("notebook", "chapter", "exercise", "status", "message")
SHORT = {"passed": "ok", "failed": "FAIL", "error": "ERR", "unanswered": "-", "timeout": "TIME"}
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class Row:
    notebook: str
    chapter: str
    exercise: str  # the exercise id, e.g. "01.rms_norm"
    status: str
    message: str


def find_notebooks(paths: Iterable[str | Path]) -> list[Path]:
    """The notebooks named, and those under the folders named (checkpoints skipped)."""
    found = []
    for p in map(Path, paths):
        if p.is_dir():
            found += sorted(q for q in p.rglob("*.ipynb") if ".ipynb_checkpoints" not in q.parts)
        elif p.exists():
            found.append(p)
        else:
            raise FileNotFoundError(f"no such file or folder: {p}")
    return found


def chapter_of(nb, path: Path) -> str | None:
    """The chapter most of the notebook's exercise ids name; else the file name's leading number."""
    ids = [c.metadata.get("miniinfer", {}).get("check") for c in nb.cells] if nb is not None else []
    chapters = Counter(EXERCISES[i].chapter for i in ids if i in EXERCISES)
    if chapters:
        return chapters.most_common(1)[0][0]
    m = re.match(r"(\d\d)(?!\d)", path.name)
    return m.group(1) if m else None


def check_source(ex: Exercise) -> str:
    """The canonical check cell: its own import, in case the student's code rebound `mi`."""
    return f"import miniinfer.course.checks as _grading\n_grading.EXERCISES[{ex.id!r}].check({ex.argument})"


def outcome(ex: Exercise, outputs: list) -> tuple[str, str]:
    """A check cell's (status, message) from its outputs."""
    for out in outputs:
        if out.get("output_type") == "error":
            name, value = out["ename"], ANSI.sub("", out["evalue"])
            if name == "AssertionError":
                return "failed", value
            if name == "NotAnswered":
                return "unanswered", value
            if name == "NameError":
                return "error", (f"{value}: the check calls `{ex.argument}`, as the exercise names it "
                                 "(renamed? its cell deleted, or moved below the check?)")
            return "error", value if name == "AnswerError" else f"{name}: {value}"
    text = "".join(out.get("text", "") for out in outputs if out.get("output_type") == "stream")
    passed = [line for line in text.splitlines() if line.startswith("passed:")]
    return ("passed", passed[-1]) if passed else ("error", "the check printed no result")


def first_line(source: str) -> str:
    return next((line.strip() for line in source.splitlines() if line.strip()), "")[:60]


def grade_notebook(path: Path, timeout: float = 600, name: str | None = None) -> list[Row]:
    """One row per exercise of the notebook's problem set (or one row saying why there are none)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    name = name or str(path)
    broken: str | None = None
    try:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
    except Exception as err:  # not JSON, or JSON that is not a notebook
        nb, broken = None, f"not a readable notebook ({type(err).__name__}: {str(err)[:200]})"
    chapter = chapter_of(nb, path) or ""
    exercises = problem_set(chapter) if chapter else []
    if not exercises:
        why = broken or "no exercise of the course found (no check ids in its cells, no chapter number in its name)"
        return [Row(name, chapter, "", "error", why)]
    if broken:
        return [Row(name, chapter, ex.id, "error", broken) for ex in exercises]

    results: dict[str, tuple[str, str]] = {}
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(path.parent.resolve())}})
    deadline = time.monotonic() + timeout

    def run(cell, index: int, graded: Exercise | None = None) -> str | None:
        """Execute a cell; why grading of this notebook must stop, or None. A check cell is named by
        its exercise (its source is the grader's own line), any other by its first line."""
        client.timeout = max(1, int(deadline - time.monotonic()))
        where = f"cell {index + 1}, the check of {graded.label}" if graded else \
            f"cell {index + 1}: {first_line(cell.source)}"
        try:
            client.execute_cell(cell, index)
        except CellTimeoutError:
            return f"timeout: the notebook ran over {timeout:g} s (in {where})"
        except DeadKernelError:
            return f"error: the kernel died in {where}; nothing after it ran"
        return None

    stop = None
    with client.setup_kernel(stderr=subprocess.DEVNULL):  # the kernel's warnings; its deaths are reported
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            ex = EXERCISES.get(cell.metadata.get("miniinfer", {}).get("check"))
            graded = ex if ex is not None and ex.chapter == chapter and ex.id not in results else None
            if graded:
                cell.source = check_source(graded)
            if stop := run(cell, index, graded):
                break
            if graded:
                results[graded.id] = outcome(graded, cell.outputs)
        for ex in exercises:
            if stop or ex.id in results:
                continue
            cell = nbformat.v4.new_code_cell(check_source(ex))
            nb.cells.append(cell)
            if stop := run(cell, len(nb.cells) - 1, ex):
                break
            status, message = outcome(ex, cell.outputs)
            results[ex.id] = status, f"(its check cell is missing: checked at the end) {message}"
    status, _, message = (stop or "").partition(": ")
    return [Row(name, chapter, ex.id, *results.get(ex.id, (status, message))) for ex in exercises]


def grade(paths: Iterable[str | Path], timeout: float = 600, jobs: int = 1,
          progress: Callable[[Path, list[Row], float], None] | None = None) -> list[Row]:
    """Grade every notebook found under paths, `jobs` at a time; rows in the order of the notebooks."""
    notebooks = find_notebooks(paths)
    if jobs > 1:  # each kernel's PyTorch would otherwise start a thread per core
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // jobs)))

    def one(path: Path) -> list[Row]:
        t0 = time.perf_counter()
        rows = grade_notebook(path, timeout)
        if progress:
            progress(path, rows, time.perf_counter() - t0)
        return rows

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        return [row for rows in pool.map(one, notebooks) for row in rows]


def write_csv(rows: list[Row], out: str | Path) -> None:
    with open(out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        w.writerows(astuple(r) for r in rows)


def summary(rows: list[Row]) -> str:
    """A table per chapter: a line per notebook, a column per exercise, and the count passed."""
    lines = []
    for chapter in sorted({r.chapter for r in rows}):
        mine = [r for r in rows if r.chapter == chapter]
        numbers = {e.id: str(e.number) for e in problem_set(chapter)}
        width = max(len("notebook"), *(len(r.notebook) for r in mine))
        lines.append(f"chapter {chapter or '?'}")
        lines.append(f"{'notebook':<{width}}  " + "".join(f"{n:>5}" for n in numbers.values()) + "  passed")
        for nbname in dict.fromkeys(r.notebook for r in mine):
            status = {r.exercise: r.status for r in mine if r.notebook == nbname}
            cells = "".join(f"{SHORT.get(status.get(i, ''), '?'):>5}" for i in numbers)
            passed = sum(s == "passed" for s in status.values())
            lines.append(f"{nbname:<{width}}  {cells}  {passed}/{len(numbers)}")
        lines.append("")
    legend = ", ".join(f"{v} {k}" for k, v in SHORT.items())
    return "\n".join(lines + [legend, f"{len(rows)} rows: " + ", ".join(
        f"{n} {s}" for s in STATUSES if (n := sum(r.status == s for r in rows)))])
