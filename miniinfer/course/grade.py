"""`miniinfer grade`: run students' problem-set notebooks and record every exercise's status.

Hand-written module. Each notebook runs top to bottom in a fresh kernel (nbclient) within a time
limit. Exercises are found by the ids their cells carry in their metadata (`miniinfer.check`), not by
position, and every check cell is replaced by the canonical check before it runs, so an edited check
cell grades the same as the original. An exercise whose check cell is gone is checked at the end.
Statuses: passed, failed (a wrong result), error (the code raised, the function is missing, the
kernel died, the file is not a notebook), unanswered, timeout; a speed item (`checks/speed.py`: the
answer timed against a reference in the same run) is passed, slow (below its full marks) or needs
GPU, and its `speed` column holds the ratio. `write_html` draws the class as grades.html: a table per
chapter and a bar chart per speed item.

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

STATUSES = ("passed", "slow", "failed", "error", "unanswered", "timeout", "needs GPU")
COLUMNS = ("notebook", "chapter", "exercise", "status", "message", "speed")
SHORT = {"passed": "ok", "slow": "SLOW", "failed": "FAIL", "error": "ERR", "unanswered": "-", "timeout": "TIME",
         "needs GPU": "GPU"}
SPEED = re.compile(r"speed (\d+\.\d+) of the reference's")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class Row:
    notebook: str
    chapter: str
    exercise: str  # the exercise id, e.g. "01.rms_norm"
    status: str
    message: str
    speed: str = ""  # a speed item's ratio to the package's time ("0.93"), else empty


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
    verdicts = ("passed:", "slow:", "needs GPU:") if ex.speed else ("passed:",)
    said = [line for line in text.splitlines() if line.startswith(verdicts)]
    return (said[-1].split(":")[0], said[-1]) if said else ("error", "the check printed no result")


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
    rows = [Row(name, chapter, ex.id, *results.get(ex.id, (status, message))) for ex in exercises]
    for row in rows:
        if (m := SPEED.search(row.message)) and row.status in ("passed", "slow"):
            row.speed = m.group(1)
    return rows


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
        numbers = {e.id: f"{e.number}{'s' if e.speed else ''}" for e in problem_set(chapter)}
        width = max(len("notebook"), *(len(r.notebook) for r in mine))
        lines.append(f"chapter {chapter or '?'}")
        lines.append(f"{'notebook':<{width}}  " + "".join(f"{n:>5}" for n in numbers.values()) + "  passed")
        for nbname in dict.fromkeys(r.notebook for r in mine):
            status = {r.exercise: r.status for r in mine if r.notebook == nbname}
            cells = "".join(f"{SHORT.get(status.get(i, ''), '?'):>5}" for i in numbers)
            passed = sum(s == "passed" for s in status.values())
            graded = sum(s != "needs GPU" for s in status.values())  # not held against the student
            lines.append(f"{nbname:<{width}}  {cells}  {passed}/{graded}")
        lines.append("")
    legend = ", ".join(f"{v} {k}" for k, v in SHORT.items()) + "; a column Ns: exercise N's speed"
    return "\n".join(lines + [legend, f"{len(rows)} rows: " + ", ".join(
        f"{n} {s}" for s in STATUSES if (n := sum(r.status == s for r in rows)))])


COLOURS = {"passed": "#c8e6c9", "slow": "#fff0a8", "failed": "#ffcdd2", "error": "#ffcdd2", "unanswered": "#eeeeee",
           "timeout": "#ffe0b2", "needs GPU": "#dcecfb"}
STYLE = """body { font: 14px sans-serif; margin: 24px; } table { border-collapse: collapse; margin-bottom: 24px; }
td, th { border: 1px solid #bbb; padding: 3px 8px; text-align: center; } td.name { text-align: left; }
.chart { width: 520px; margin-bottom: 28px; } .line { display: flex; align-items: center; margin: 2px 0; }
.who { width: 180px; overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
.track { position: relative; flex: 1; height: 16px; background: #f4f4f4; }
.bar { height: 16px; } .mark { position: absolute; top: -3px; bottom: -3px; border-left: 2px dashed #333; }
.value { width: 48px; text-align: right; }"""


def write_html(rows: list[Row], out: str | Path) -> None:
    """The class at a glance: per chapter a table (a line per notebook, a column per item, coloured by
    status, the message on hover), and per speed item a leaderboard: the ratios as bars, fastest
    first, with the full-marks line dashed."""
    from html import escape
    parts = [f"<!doctype html><meta charset='utf-8'><title>grades</title><style>{STYLE}</style><h1>Grades</h1>"]
    for chapter in sorted({r.chapter for r in rows}):
        mine = [r for r in rows if r.chapter == chapter]
        items = problem_set(chapter)
        head = "".join(f"<th title='{escape(e.id)}'>{e.number}{' speed' if e.speed else ''}<br>{escape(e.answer)}</th>"
                       for e in items)
        parts.append(f"<h2>Chapter {escape(chapter or '?')}</h2><table><tr><th>notebook</th>{head}</tr>")
        for nbname in dict.fromkeys(r.notebook for r in mine):
            got = {r.exercise: r for r in mine if r.notebook == nbname}
            cells = "".join(
                f"<td style='background:{COLOURS.get(r.status, '#fff')}' title='{escape(r.message)}'>"
                f"{escape(r.speed or SHORT.get(r.status, r.status))}</td>" if (r := got.get(e.id)) else "<td></td>"
                for e in items)
            parts.append(f"<tr><td class='name'>{escape(nbname)}</td>{cells}</tr>")
        parts.append("</table>")
        for e in (e for e in items if e.speed):
            timed = sorted(((float(r.speed), r.notebook) for r in mine if r.exercise == e.id and r.speed), reverse=True)
            if not timed:
                continue
            top = max(timed[0][0], (e.full or 1.0) * 1.25, 1.0)
            parts.append(f"<h3>{escape(e.label)}: the reference's time over the student's "
                         f"(full marks from {e.full:.2f})</h3><div class='chart'>")
            full = 100 * (e.full or 0) / top
            for ratio, nbname in timed:
                colour = "#66bb6a" if ratio >= (e.full or 0) else "#f9a825"
                parts.append(f"<div class='line'><span class='who' title='{escape(nbname)}'>{escape(nbname)}</span>"
                             f"<span class='track'><div class='bar' style='width:{100 * ratio / top:.1f}%;"
                             f"background:{colour}'></div><span class='mark' style='left:{full:.1f}%'></span></span>"
                             f"<span class='value'>{ratio:.2f}</span></div>")
            parts.append("</div>")
    Path(out).write_text("\n".join(parts) + "\n")
