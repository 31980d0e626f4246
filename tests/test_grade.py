"""`miniinfer grade` over a class folder in one run: a correct, a wrong (with its check cell rewritten
to print "passed"), an unanswered, a looping, a kernel-killing, a cell-deleting, a renaming, a
reordered, an unreadable notebook and one that is JSON but no notebook: each gets the right status."""

import copy
import csv
import io
import json
import re
from contextlib import redirect_stdout
from pathlib import Path

import torch

from miniinfer import cli
from miniinfer.course import grade

ROOT = Path(__file__).resolve().parent.parent
IDS = ["01.rms_norm", "01.apply_rope", "01.causal_attention", "01.top_p_filter", "01.your_generate"]


def solution() -> dict:
    """Problem set 01 answered (its last part, exercise 5, runs the course model on the four answers)."""
    return json.loads((ROOT / "solutions" / "01_naive_decoding.ipynb").read_text())


def cell(nb: dict, kind: str, id: str) -> dict:
    return next(c for c in nb["cells"] if c["metadata"].get("miniinfer", {}).get(kind) == id)


def source(c: dict) -> str:
    return "".join(c["source"])


def class_folder(tmp: Path) -> None:
    def save(name: str, nb: dict) -> None:
        (tmp / f"{name}.ipynb").write_text(json.dumps(nb))

    save("correct", solution())

    wrong = solution()  # the mean over every dimension, not each row's, and a check cell that claims success
    cell(wrong, "exercise", "01.rms_norm")["source"] = (
        "def rms_norm(x, weight, eps):\n    return weight * x * torch.rsqrt(x.pow(2).mean() + eps)\n")
    cell(wrong, "check", "01.rms_norm")["source"] = 'print("passed: rms_norm")'
    save("wrong", wrong)

    unanswered = json.loads((ROOT / "exercises" / "01_naive_decoding.ipynb").read_text())
    unanswered["cells"] = unanswered["cells"][:len(solution()["cells"])]
    save("unanswered", unanswered)

    loop = solution()
    # Waiting, not spinning: the timeout is the same, and the test beside this one keeps its core.
    cell(loop, "exercise", "01.apply_rope")["source"] = "while True:\n    __import__('time').sleep(0.5)\n"
    save("loop", loop)

    killer = solution()
    cell(killer, "exercise", "01.causal_attention")["source"] = "import os\nos._exit(1)\n"
    save("killer", killer)

    deleting = solution()  # exercise 1's check cell and exercise 4's answer are gone
    gone = [cell(deleting, "check", "01.rms_norm"), cell(deleting, "exercise", "01.top_p_filter")]
    deleting["cells"] = [c for c in deleting["cells"] if all(c is not g for g in gone)]
    save("deleting", deleting)

    renaming = solution()
    answer = cell(renaming, "exercise", "01.apply_rope")
    answer["source"] = source(answer).replace("def apply_rope(", "def my_rope(")
    save("renaming", renaming)

    reordered = solution()  # exercise 4's answer and check moved to the top, the cells' order reversed
    moved = [cell(reordered, "exercise", "01.top_p_filter"), cell(reordered, "check", "01.top_p_filter")]
    rest = [c for c in reordered["cells"] if all(c is not m for m in moved)]
    reordered["cells"] = rest[:2] + copy.deepcopy(moved) + rest[2:]
    save("reordered", reordered)

    (tmp / "01_unreadable.ipynb").write_text('{"cells": [')
    (tmp / "01_not_a_notebook.ipynb").write_text('{"cells": 3}')


EXPECTED = {
    "correct": ["passed"] * 5,
    "wrong": ["failed", "passed", "passed", "passed", "failed"],  # the last part fails on a wrong piece too
    "unanswered": ["unanswered"] * 5,
    "loop": ["passed", "timeout", "timeout", "timeout", "timeout"],
    "killer": ["passed", "passed", "error", "error", "error"],
    "deleting": ["passed", "passed", "passed", "error", "error"],
    "renaming": ["passed", "error", "passed", "passed", "error"],
    "reordered": ["passed"] * 5,
    "01_unreadable": ["error"] * 5,
    "01_not_a_notebook": ["error"] * 5,
}


def test_grade_a_class_folder(tmp_path):
    folder = tmp_path / "class"
    folder.mkdir()
    class_folder(folder)
    out = tmp_path / "grades.csv"
    printed = io.StringIO()
    with redirect_stdout(printed):
        cli.main(["grade", str(folder), "--out", str(out), "--timeout", "60", "--jobs", "3"])

    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == grade.COLUMNS
    got = {}
    for r in rows:
        got.setdefault(Path(r["notebook"]).stem, []).append((r["exercise"], r["status"], r["message"]))
    assert {n: [s for _, s, _ in v] for n, v in got.items()} == EXPECTED
    assert all([e for e, _, _ in v] == IDS for v in got.values())
    assert all(r["chapter"] == "01" for r in rows)

    message = {n: [m for _, _, m in v] for n, v in got.items()}
    assert "case" in message["wrong"][0] and "values differ" in message["wrong"][0]
    assert "seed 0: the tokens differ from token" in message["wrong"][4]
    assert message["unanswered"][0].startswith("exercise 1 (rms_norm) is not answered yet")
    assert "ran over 60 s" in message["loop"][1] and "while True" in message["loop"][1]
    assert all("kernel died in cell" in m and "import os" in m for m in message["killer"][2:])
    assert "check cell is missing" in message["deleting"][0]
    assert "top_p_filter" in message["deleting"][3] and "not defined" in message["deleting"][3]
    assert "apply_rope" in message["renaming"][1] and "renamed" in message["renaming"][1]
    assert "not a readable notebook" in message["01_unreadable"][0]

    text = printed.getvalue()
    assert re.search(r"correct\.ipynb\s+ok\s+ok\s+ok\s+ok\s+ok\s+5/5", text), text
    assert re.search(r"loop\.ipynb\s+ok\s+TIME\s+TIME\s+TIME\s+TIME\s+1/5", text), text
    assert "50 rows" in text and "10 notebooks graded" in text


def test_a_notebook_of_no_chapter_is_one_error_row(tmp_path):
    path = tmp_path / "notes.ipynb"
    path.write_text(json.dumps({"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    [row] = grade.grade_notebook(path)
    assert (row.chapter, row.exercise, row.status) == ("", "", "error")
    assert "no exercise of the course" in row.message


def test_a_check_that_runs_over_the_time_names_its_exercise(tmp_path):
    """The row of a check cell that times out names the exercise, not the grader's own line."""
    nb = solution()
    answer = cell(nb, "exercise", "01.rms_norm")
    answer["source"] = "def rms_norm(x, weight, eps):\n    while True:\n        pass\n"
    keep = [c for c in nb["cells"] if c["cell_type"] == "code" and not c["metadata"].get("miniinfer")][:1]
    nb["cells"] = keep + [answer, cell(nb, "check", "01.rms_norm")]
    path = tmp_path / "01_slow.ipynb"
    path.write_text(json.dumps(nb))
    rows = grade.grade_notebook(path, timeout=20)
    assert [r.status for r in rows] == ["timeout"] * 5
    assert "the check of exercise 1 (rms_norm)" in rows[0].message and "_grading" not in rows[0].message


def test_speed_items_are_graded_against_the_package(tmp_path):
    """A speed item's row holds the ratio to the package's time: problem set 06 answered, and answered
    with host code slowed down on purpose (each step about four times as long), graded in one class; a
    GPU-only item on a machine without a GPU says `needs GPU`; grades.html draws the class."""
    nb = json.loads((ROOT / "solutions" / "06_continuous_batching.ipynb").read_text())
    (tmp_path / "fast.ipynb").write_text(json.dumps(nb))
    answer = cell(nb, "exercise", "06.varlen_metadata")
    # Slow by construction on any machine: each call sleeps three times what the rest of the step took
    # (from its last return to this call), so a step takes about four of the answer's own, however fast
    # or loaded the machine. A fixed 50 ms a step measured 0.44 of the reference once on a slow machine.
    # The first call of a run waits at most 1 s: its gap spans the other runner's whole run.
    slowed = ("### BEGIN SOLUTION\n    time.sleep(min(3 * (time.perf_counter() - _returned[0]), 1.0))\n"
              "    _returned[0] = time.perf_counter()\n")
    answer["source"] = ("import time\n\n_returned = [time.perf_counter()]\n\n"
                        + source(answer).replace("### BEGIN SOLUTION\n", slowed))
    (tmp_path / "slow.ipynb").write_text(json.dumps(nb))
    (tmp_path / "04_gpu.ipynb").write_text((ROOT / "solutions" / "04_triton_rmsnorm_rope.ipynb").read_text())
    rows = grade.grade([tmp_path], timeout=300, jobs=2)
    got = {(Path(r.notebook).stem, r.exercise): r for r in rows}
    fast, slow = got["fast", "06.YourRunner.speed"], got["slow", "06.YourRunner.speed"]
    # Timed beside the other notebook and the test suite's other worker on two cores: the right answer
    # may be slowed too, so only the order is certain; the slow one keeps about 0.25 of its own speed.
    assert slow.status == "slow" and float(slow.speed) < 0.4, slow
    assert fast.status in ("passed", "slow") and float(fast.speed) > 1.5 * float(slow.speed), (fast, slow)
    assert all(r.status == "passed" for (n, e), r in got.items() if not e.endswith(".speed"))
    if not torch.cuda.is_available():
        assert [got["04_gpu", e].status for e in ("04.rms_norm_kernel.speed", "04.rope_kernel.speed")] == \
            ["needs GPU"] * 2
    grade.write_html(rows, tmp_path / "grades.html")
    page = (tmp_path / "grades.html").read_text()
    assert page.count("class='bar'") == 2 and "needs GPU" in page


def test_the_capstone_grades_a_class_of_four(tmp_path):
    """The capstone graded end to end: correct and fast (the solution), correct and slow (its steps slowed
    on purpose, each about four times its own length on any machine), wrong (int8 weights: other tokens)
    and unanswered; each row's status, and a leaderboard that ranks the two timed ones, fastest first."""
    solution = (ROOT / "solutions" / "99_capstone.ipynb").read_text()
    (tmp_path / "fast.ipynb").write_text(solution)
    for name, body in (("slow", "return Slowed(config)"),
                       ("wrong", "return mi.LLMEngine(dataclasses.replace(config, quantization='int8'))")):
        nb = json.loads(solution)
        answer = cell(nb, "exercise", "99.your_engine")
        answer["source"] = (
            "import time\n\n\nclass Slowed(mi.LLMEngine):\n    def step(self):\n        t0 = time.perf_counter()\n"
            "        out = super().step()\n        time.sleep(3 * (time.perf_counter() - t0))\n        return out\n\n\n"
            f"def your_engine(config):\n    {body}\n")
        (tmp_path / f"{name}.ipynb").write_text(json.dumps(nb))
    (tmp_path / "unanswered.ipynb").write_text((ROOT / "exercises" / "99_capstone.ipynb").read_text())
    rows = grade.grade([tmp_path], timeout=300, jobs=2)
    got = {(Path(r.notebook).stem, r.exercise): r for r in rows}
    status = {(n, e.removeprefix("99.your_engine") or "check"): r.status for (n, e), r in got.items()}
    assert status == {("fast", "check"): "passed", ("fast", ".speed"): status["fast", ".speed"],
                      ("slow", "check"): "passed", ("slow", ".speed"): "slow",
                      ("wrong", "check"): "failed", ("wrong", ".speed"): "failed",
                      ("unanswered", "check"): "unanswered", ("unanswered", ".speed"): "unanswered"}, status
    fast, slow = got["fast", "99.your_engine.speed"], got["slow", "99.your_engine.speed"]
    assert fast.status in ("passed", "slow") and float(fast.speed) > 1.5 * float(slow.speed), (fast, slow)
    assert "the tokens differ" in got["wrong", "99.your_engine"].message
    grade.write_html(rows, tmp_path / "grades.html")
    page = (tmp_path / "grades.html").read_text()
    board = page[page.index("the reference's time over the student's"):]
    assert board.count("class='bar'") == 2 and board.index("fast.ipynb") < board.index("slow.ipynb")
