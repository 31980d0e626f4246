"""The student's workspace (`make lab`, `make reset`): their copies, never the tracked notebooks."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import lab  # noqa: E402


def test_setup_copies_every_lesson_and_problem_set_once(tmp_path):
    copied = lab.setup(tmp_path)
    names = sorted(p.relative_to(tmp_path).as_posix() for p in copied)
    expected = sorted(f"{d}/{p.name}" for d in lab.FOLDERS for p in (ROOT / d).glob("[0-9]*.ipynb"))
    assert names == expected and (tmp_path / lab.LANDING).is_file()
    mine = tmp_path / "exercises" / "01_naive_decoding.ipynb"
    mine.write_text("my work")
    assert lab.setup(tmp_path) == [] and mine.read_text() == "my work"  # never overwritten


def test_reset_keeps_the_old_copy_and_takes_the_course_version(tmp_path):
    lab.setup(tmp_path)
    mine = tmp_path / "exercises" / "05_paged_attention.ipynb"
    mine.write_text("my work")
    lab.reset("05", tmp_path)
    assert mine.read_bytes() == (ROOT / "exercises" / mine.name).read_bytes()
    assert [p.read_text() for p in (tmp_path / "backup").glob("exercises-05_*")] == ["my work"]
    with pytest.raises(SystemExit, match="NB is one of 01"):
        lab.reset("98", tmp_path)


def test_make_lab_serves_lessons_problem_sets_and_the_landing_page(tmp_path):
    """The README's command, as root too, answers for every file a student opens (REST API)."""
    from browser_test import Lab

    status = ["git", "status", "--porcelain", "notebooks", "exercises", "solutions"]
    before = subprocess.run(status, cwd=ROOT, capture_output=True, text=True).stdout
    server = Lab(tmp_path / "ws", tmp_path / "lab.log")
    try:
        server.wait(timeout=60)
        for path in [lab.LANDING, "notebooks/01_naive_decoding.ipynb", "exercises/08_serving.ipynb",
                     "docs/benchmarks"]:
            assert server.api(f"contents/{path}?content=0")["path"] == path
    finally:
        server.stop()
    assert subprocess.run(status, cwd=ROOT, capture_output=True, text=True).stdout == before
