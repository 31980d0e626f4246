"""The course as a student meets it: `make lab`, then JupyterLab in a real (headless) Chromium.

    python tools/browser_test.py [--screenshots DIR] [--chromium PATH]

Steps, each printed as one line (ok or FAIL, what was checked, how long it took):
  1. `make lab LAB_ARGS="--no-browser --port=N --IdentityProvider.token=T"` (the README's command)
     on a temporary workspace (MINIINFER_WORKSPACE), never the student's; wait until it answers.
  2. Open the address `make lab` prints (/lab) in Debian's Chromium, driven by Playwright: the
     landing page (docs/start.md) must be open there, its links to the problem sets visible.
  3. Click the problem set of chapter 01, type an answer to the first exercise (rms_norm) through
     the cell's editor with real key presses, run the import cell, the exercise and its check with
     Shift+Enter, and read `passed` in the check's output.
  4-6. Open each lesson with a slider (03, 06, 07) from the landing page, find the cell with
     `widgets.interact`, run it and the cells above it, press the right arrow key on its first
     slider three times, and check that the figure under it changed each time, within a second of
     the key press (the times are printed).
  7. Stop JupyterLab through its REST API; no kernel may be left running, and the course's own
     notebooks must be unchanged.
A screenshot of each stage goes into --screenshots (default: a new temporary folder), with
JupyterLab's log (lab.log). Exits 1 when a step fails. tests/test_browser.py runs it under pytest.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
# What Chromium needs to run headless as root on a closed network: without the
# background-networking flags its connections to Google's hosts are refused, many at a time.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
RMS_NORM = """\
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)"""
WIDGET_LIMIT_S = 1.0  # the slider's figure must follow a key press within this
WIDGET_LESSONS = ["03_paged_blocks", "06_continuous_batching", "07_prefix_caching"]  # each lesson with a slider
COURSE_FILES = ["notebooks", "exercises", "solutions"]


def find_chromium() -> str | None:
    """Debian's Chromium (/usr/bin/chromium), or any `chromium` on PATH; None without one."""
    for path in ("/usr/bin/chromium", shutil.which("chromium"), shutil.which("chromium-browser")):
        if path and os.access(path, os.X_OK):
            return path
    return None


class StepFailed(Exception):
    pass


def check(condition, message: str) -> None:
    if not condition:
        raise StepFailed(message)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    """`make lab` in its own process group, on a temporary workspace and runtime folder."""

    def __init__(self, workspace: Path, log_path: Path):
        self.port, self.token = free_port(), secrets.token_hex(8)
        self.workspace = workspace
        self.runtime = workspace.parent / "runtime"  # kernels' connection files: who is still running
        self.log = open(log_path, "w")
        args = f"--no-browser --port={self.port} --IdentityProvider.token={self.token}"
        cmd = ["make", "-s", "lab", f"LAB_ARGS={args}"]
        if sys.prefix != sys.base_prefix:  # run from a venv: the same one serves the lab
            cmd.append(f"VENV={sys.prefix}")
        env = dict(os.environ, MINIINFER_WORKSPACE=str(workspace), JUPYTER_RUNTIME_DIR=str(self.runtime))
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def url(self, path: str) -> str:
        sep = "&" if "?" in path else "?"
        return f"http://127.0.0.1:{self.port}/{path}{sep}token={self.token}"

    def api(self, path: str, method: str = "GET"):
        req = urllib.request.Request(self.url(f"api/{path}"), method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            check(self.proc.poll() is None, f"make lab exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                self.api("status")
                return
            except OSError:
                time.sleep(0.25)
        raise StepFailed(f"make lab did not answer within {timeout:.0f} s: {self.log_tail()}")

    def log_tail(self, lines: int = 5) -> str:
        self.log.flush()
        text = Path(self.log.name).read_text(errors="replace").strip().splitlines()
        return " | ".join(text[-lines:]) or "nothing in lab.log"

    def kernel_pids(self) -> list[int]:
        """Processes started with a connection file of this lab's runtime folder (its kernels)."""
        pids = []
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                try:
                    cmdline = (proc / "cmdline").read_bytes()
                except OSError:
                    continue
                if str(self.runtime).encode() in cmdline and b"kernel" in cmdline:
                    pids.append(int(proc.name))
        return pids

    def stop(self) -> list[int]:
        """Shut the server down as Jupyter does (kernels first); returns kernels still running."""
        if self.proc.poll() is None:
            try:
                self.api("shutdown", method="POST")
                self.proc.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait()
        self.log.close()
        deadline = time.monotonic() + 10
        while (left := self.kernel_pids()) and time.monotonic() < deadline:
            time.sleep(0.25)
        for pid in left:  # ours, found by our runtime folder: never leave them behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return left


# In the page: the time of the next key press, and of the first <img> under the cell's output that
# differs from the one shown now and has loaded (the widget's output is cleared, then redrawn).
WATCH_JS = """(cell, oldSrc) => {
  window.__keyAt = null; window.__figAt = null;
  document.addEventListener('keydown', () => { window.__keyAt = performance.now(); },
                            {capture: true, once: true});
  const seen = () => {
    if (window.__figAt !== null) return;
    for (const img of cell.querySelectorAll('.jp-OutputArea-output img')) {
      if (img.src && img.src !== oldSrc) {
        if (img.complete) { window.__figAt = performance.now(); return; }
        img.addEventListener('load', () => { window.__figAt = window.__figAt ?? performance.now(); });
      }
    }
  };
  if (window.__watch) window.__watch.disconnect();
  window.__watch = new MutationObserver(seen);
  window.__watch.observe(cell, {subtree: true, childList: true, attributes: true});
}"""


class Student:
    """What a student does in JupyterLab, with Playwright's mouse and keyboard."""

    def __init__(self, page, lab: Lab, shots: Path):
        self.page, self.lab, self.shots = page, lab, shots

    def shot(self, name: str, locator=None) -> str:
        path = self.shots / f"{name}.png"
        (locator or self.page).screenshot(path=str(path))
        return path.name

    def notebook(self):
        return self.page.locator(".jp-NotebookPanel:visible")

    def code_cell(self, text: str):
        """The code cell of the open notebook whose source contains text. Should JupyterLab not
        have rendered it (far down a long notebook), the notebook's search box finds it, as a
        student would."""
        from playwright.sync_api import Error as PlaywrightError

        cells = self.notebook().locator(".jp-CodeCell").filter(
            has=self.page.locator(".jp-InputArea-editor", has_text=text))
        try:
            cells.first.wait_for(timeout=5_000)
        except PlaywrightError:
            self.notebook().locator(".jp-Notebook").first.click(position={"x": 5, "y": 5})
            self.page.keyboard.press("Escape")
            self.page.keyboard.press("Control+f")
            box = self.page.locator(".jp-DocumentSearch-input:visible")
            box.fill(text)
            self.page.keyboard.press("Enter")
            cells.first.wait_for(timeout=10_000)
            self.page.keyboard.press("Escape")
        check(cells.count() == 1, f"{cells.count()} code cells contain {text!r}, expected one")
        return cells.first

    def select(self, cell) -> None:
        """Select a cell in command mode (click its prompt), so that Shift+Enter runs it."""
        cell.scroll_into_view_if_needed()
        cell.locator(".jp-InputPrompt").click()
        self.page.keyboard.press("Escape")

    def run(self, cell) -> None:
        self.select(cell)
        self.page.keyboard.press("Shift+Enter")

    def type_into(self, cell, text: str) -> str:
        """Replace a cell's source by typing it, key by key; returns what the editor then holds.

        After each Enter the editor indents the new line itself; Shift+Home selects that
        indentation, so the line's own indentation is typed over it (brackets are typed out
        too: with auto-closing on, the editor steps over the closer it inserted)."""
        editor = cell.locator(".cm-content")
        editor.click()
        self.page.keyboard.press("Control+a")
        for i, line in enumerate(text.split("\n")):
            if i:
                self.page.keyboard.press("Enter")
                self.page.keyboard.press("Shift+Home")
            self.page.keyboard.type(line)
        lines = "e => Array.from(e.querySelectorAll('.cm-line')).map(l => l.textContent).join('\\n')"
        return editor.evaluate(lines)

    def output_text(self, cell, timeout: float) -> str:
        """The cell's output once it has run (its prompt shows an execution count, not [*])."""
        done = cell.locator(".jp-InputPrompt").filter(has_text=re.compile(r"\[\d+\]"))
        done.wait_for(timeout=timeout * 1000)
        return "\n".join(cell.locator(".jp-OutputArea-output").all_inner_texts())


# A class of four as `miniinfer grade` records it: the speed of exercise 1's kernel on a GPU.
CLASS_SPEEDS = {"ana.ipynb": "1.03", "ben.ipynb": "0.91", "chloe.ipynb": "0.42"}


def write_grades(path: Path) -> None:
    """grades.html of a class of four graded on problem set 04, one of them without a GPU: the table,
    and the leaderboard of exercise 1's speed (exercise 2's speed timed for no one)."""
    from miniinfer.course import grade
    rows = []
    for name in [*CLASS_SPEEDS, "dan.ipynb"]:
        for ex in grade.problem_set("04"):
            speed = CLASS_SPEEDS.get(name, "") if ex.id == "04.rms_norm_kernel.speed" else ""
            status = "passed" if not ex.speed or (speed and float(speed) >= (ex.full or 0)) else \
                "slow" if speed else "needs GPU"
            rows.append(grade.Row(name, "04", ex.id, status, f"{status}: as graded", speed))
    grade.write_html(rows, path)


def run(shots: Path, chromium: str, log: Callable[[str], None] = print) -> bool:
    """All the steps; returns True when every one passed. Lines go to log."""
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    shots.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="miniinfer-browser-"))
    status = ["git", "status", "--porcelain", "--", *COURSE_FILES]
    git_before = subprocess.run(status, cwd=ROOT, capture_output=True, text=True).stdout
    t_all = time.monotonic()
    ok = True
    lab = student = None

    def step(n: int, what: str, fn: Callable[[], str]) -> None:
        nonlocal ok
        t0 = time.monotonic()
        try:
            detail = fn()
        except Exception as e:  # noqa: BLE001  a step fails, JupyterLab is still stopped
            ok = False
            msg = str(e).strip() if isinstance(e, StepFailed) else f"{type(e).__name__}: {e}".splitlines()[0]
            extra = ""
            if student is not None:
                try:
                    extra = f"; screenshot {student.shot(f'{n}_FAILED')}"
                except PlaywrightError:
                    pass
            log(f"browser test: step {n} FAIL  {what}: {msg} ({time.monotonic() - t0:.1f} s){extra}")
            raise StepFailed(msg) from e
        log(f"browser test: step {n} ok    {what}: {detail} ({time.monotonic() - t0:.1f} s)")

    log(f"browser test: Chromium {chromium}, screenshots and lab.log in {shots}")
    try:
        lab = Lab(tmp / "workspace", shots / "lab.log")

        def start_lab():
            lab.wait(timeout=180)
            return f"`make lab` on the temporary workspace {lab.workspace} answers on port {lab.port}"
        step(1, "start JupyterLab", start_lab)

        with sync_playwright() as pw:
            browser = pw.chromium.launch_persistent_context(
                str(tmp / "chromium-profile"), executable_path=chromium, headless=True,
                args=CHROMIUM_FLAGS, viewport={"width": 1400, "height": 1000})
            browser.set_default_timeout(30_000)
            page = browser.pages[0] if browser.pages else browser.new_page()
            student = Student(page, lab, shots)
            try:
                def landing():
                    # The address `make lab` prints (with --no-browser: /lab, which restores the
                    # workspace's layout); without --no-browser it opens /lab/tree/docs/start.md.
                    page.goto(lab.url("lab"))
                    link = page.locator(".jp-RenderedMarkdown a[href*='exercises/01_naive_decoding.ipynb']")
                    link.wait_for(state="visible", timeout=90_000)
                    n = page.locator(".jp-RenderedMarkdown a[href*='exercises/']").count()
                    check(not page.get_by_text("Jupyter news").is_visible(),
                          "JupyterLab asks about fetching its news (the workspace's settings say no)")
                    return f"docs/start.md rendered, {n} problem-set links visible; {student.shot('1_landing')}"
                step(2, "landing page", landing)

                def current_tab(name: str) -> None:
                    # The tab, not the address: JupyterLab does not always put the document in the URL.
                    page.locator(".lm-TabBar-tab.lm-mod-current", has_text=name).wait_for(timeout=30_000)

                def problem_set():
                    page.locator(".jp-RenderedMarkdown a[href*='exercises/01_naive_decoding.ipynb']").click()
                    page.locator(".jp-NotebookPanel:visible .jp-CodeCell").first.wait_for()
                    current_tab("01_naive_decoding.ipynb")
                    imports = student.code_cell("import miniinfer")
                    exercise = student.code_cell("def rms_norm")
                    checker = student.code_cell("check_rms_norm(")
                    t0 = time.monotonic()
                    typed = student.type_into(exercise, RMS_NORM)
                    t_typed = time.monotonic() - t0
                    check(typed.replace("\xa0", " ") == RMS_NORM,
                          f"the editor holds {typed!r}, not the answer typed")
                    first = student.shot("2_exercise_typed")
                    t0 = time.monotonic()
                    student.run(imports)
                    student.run(exercise)
                    student.run(checker)
                    text = student.output_text(checker, timeout=90)
                    t_run = time.monotonic() - t0
                    second = student.shot("3_exercise_checked")
                    said = [line for line in text.strip().splitlines() if line.strip()]
                    check(said and said[0].startswith("passed"),
                          f"the check printed {' | '.join(said[-3:])!r}")
                    return (f"typed rms_norm into exercise 1 ({len(RMS_NORM)} keys, {t_typed:.1f} s), ran "
                            f"imports + exercise + check: {text.strip().splitlines()[0]!r} {t_run:.1f} s "
                            f"after Shift+Enter; {first}, {second}")
                step(3, "problem set 01: answer exercise 1, run its check", problem_set)

                def widget(lesson: str, n: int) -> str:
                    page.locator(".lm-TabBar-tab", has_text="start.md").click()
                    page.locator(f".jp-RenderedMarkdown a[href*='notebooks/{lesson}.ipynb']").click()
                    page.locator(".jp-NotebookPanel:visible .jp-CodeCell").first.wait_for()
                    current_tab(f"{lesson}.ipynb")
                    cell = student.code_cell("widgets.interact")
                    student.select(cell)
                    t0 = time.monotonic()
                    page.locator(".lm-MenuBar-itemLabel").get_by_text("Run", exact=True).click()
                    page.get_by_role("menuitem", name="Run All Above Selected Cell").click()
                    student.run(cell)
                    handle = cell.locator(".jp-OutputArea-output .noUi-handle").first
                    handle.wait_for(timeout=300_000)
                    img = cell.locator(".jp-OutputArea-output img")
                    img.first.wait_for(timeout=60_000)
                    t_run = time.monotonic() - t0
                    handle.scroll_into_view_if_needed()
                    before = student.shot(f"{n}_widget_before", cell)
                    readout = cell.locator(".widget-readout").first
                    handle.click()  # focus the slider's handle, as a student clicks it (no move)
                    values, times = [readout.inner_text().strip()], []
                    for _ in range(3):
                        src = img.first.get_attribute("src")
                        cell.evaluate(WATCH_JS, src)
                        page.keyboard.press("ArrowRight")
                        try:
                            page.wait_for_function("window.__figAt !== null", timeout=10_000)
                        except PlaywrightError as err:
                            raise StepFailed(f"no new figure within 10 s of the key press (slider at "
                                             f"{readout.inner_text().strip()})") from err
                        times.append(page.evaluate("window.__figAt - window.__keyAt") / 1000)
                        values.append(readout.inner_text().strip())
                    after = student.shot(f"{n}_widget_after", cell)
                    check(len(set(values)) == 4, f"the slider read {' -> '.join(values)}: not three moves")
                    moves = ", ".join(f"{t * 1000:.0f} ms" for t in times)
                    check(max(times) < WIDGET_LIMIT_S, f"the figure took {moves} after each key press "
                                                       f"(limit {WIDGET_LIMIT_S:.0f} s)")
                    return (f"ran the cells up to `widgets.interact` ({t_run:.1f} s), slider "
                            f"{' -> '.join(values)} by the right arrow key, the figure changed each time, "
                            f"key press to new figure: {moves}; {before}, {after}")
                for n, lesson in enumerate(WIDGET_LESSONS, start=4):
                    step(n, f"lesson {lesson[:2]}: move the ipywidgets slider",
                         lambda lesson=lesson, n=n: widget(lesson, n))

                def grades_page(n: int) -> str:
                    write_grades(tmp / "grades.html")
                    page.goto((tmp / "grades.html").resolve().as_uri())
                    bars = page.locator(".bar")
                    bars.first.wait_for(timeout=10_000)
                    widths = [bars.nth(i).bounding_box()["width"] for i in range(bars.count())]
                    mark = page.locator(".mark").first.bounding_box()
                    shot = student.shot(f"{n}_grades")
                    check(len(widths) == len(CLASS_SPEEDS),
                          f"{len(widths)} bars for {len(CLASS_SPEEDS)} timed students")
                    check(widths == sorted(widths, reverse=True) and widths[-1] > 0,
                          f"the bars are not drawn fastest first: widths {widths}")
                    check(mark is not None and mark["height"] > 0, "no full-marks line drawn")
                    cells = page.locator("td").count()
                    return (f"grades.html: a table of {cells} cells, {len(widths)} bars "
                            f"({', '.join(f'{w:.0f}' for w in widths)} px) and the full-marks line; {shot}")
                step(4 + len(WIDGET_LESSONS), "the grader's grades.html", lambda: grades_page(4 + len(WIDGET_LESSONS)))
            finally:
                browser.close()
    except StepFailed:
        pass
    finally:
        if lab is not None:
            def stop():
                try:
                    kernels = len(lab.api("kernels"))
                except OSError:
                    kernels = None
                found = len(lab.kernel_pids())
                left = lab.stop()
                check(not left, f"kernels still running after JupyterLab stopped: {left} (killed)")
                check(kernels is None or found == kernels,
                      f"JupyterLab ran {kernels} kernels, {found} kernel processes found")
                git_after = subprocess.run(status, cwd=ROOT, capture_output=True, text=True).stdout
                check(git_after == git_before, f"the course's notebooks changed: {git_after}")
                return (f"JupyterLab shut down through its REST API, with its {found} kernel(s); none left "
                        f"running, the course's notebooks unchanged")
            try:
                step(5 + len(WIDGET_LESSONS), "stop JupyterLab and its kernels", stop)
            except StepFailed:
                pass
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"browser test: {'passed' if ok else 'FAILED'} in {time.monotonic() - t_all:.1f} s")
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--screenshots", type=Path,
                    help="folder for the screenshots and lab.log (default: a new temporary one)")
    ap.add_argument("--chromium", default=find_chromium(),
                    help="the browser (default: Debian's /usr/bin/chromium)")
    args = ap.parse_args(argv)
    if not args.chromium:
        print("no Chromium installed: apt-get install chromium chromium-driver", file=sys.stderr)
        return 2
    shots = args.screenshots or Path(tempfile.mkdtemp(prefix="miniinfer-screenshots-"))
    return 0 if run(shots, args.chromium, lambda line: print(line, flush=True)) else 1


if __name__ == "__main__":
    sys.exit(main())
