"""A student's path through the course in a real browser: tools/browser_test.py under pytest.

It starts `make lab` on a temporary workspace, opens the landing page in Debian's headless
Chromium, answers exercise 1 of problem set 01 through the cell editor and runs its check, moves the
ipywidgets slider of lesson 03, and stops JupyterLab. Without a Chromium it skips, except under CI
(CI=true), where .ci/run installs one: there a missing browser fails.
"""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import browser_test  # noqa: E402

NO_CHROMIUM = ("no Chromium installed: the browser test did not run; install Debian's chromium and "
               "chromium-driver (apt-get install chromium chromium-driver)")


def test_a_student_in_jupyterlab(tmp_path, capsys):
    chromium = browser_test.find_chromium()
    if chromium is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(NO_CHROMIUM + " (CI=true: .ci/run installs it)")
        pytest.skip(NO_CHROMIUM)
    lines = []

    def log(line):  # straight to the terminal, so each step shows in `make test`'s log (xdist too)
        lines.append(line)
        with capsys.disabled():
            sys.stderr.write(f"\n{line}")
            sys.stderr.flush()

    ok = browser_test.run(tmp_path / "screenshots", chromium, log)
    with capsys.disabled():
        sys.stderr.write("\n")
    assert ok, "\n".join(lines)
