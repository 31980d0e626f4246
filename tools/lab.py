"""The student's workspace: their own copies of the lessons and problem sets, outside git's view.

    python tools/lab.py setup           copy every lesson and problem set not yet in workspace/
    python tools/lab.py reset NN        move the copies of chapter NN aside, copy them afresh
    python tools/lab.py start [ARGS]    setup, then JupyterLab on workspace/ (ARGS go to jupyter lab)

`make lab` serves workspace/, not the tracked notebooks: running and editing a notebook (and
JupyterLab's autosave) never touches the files nbval checks, and a `git pull` of course updates
never meets a student's edits. Copies are made once and never overwritten; a new chapter pulled
later is copied at the next `make lab`, and `make reset NB=NN` takes a chapter's updated version
(the old copies go to workspace/backup/, stamped with the time).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Another folder for tests (the browser test must not type into a student's own copies).
WORKSPACE = Path(os.environ.get("MINIINFER_WORKSPACE", ROOT / "workspace")).resolve()
FOLDERS = ("notebooks", "exercises")  # the same names as in the repository, so links work in both
LANDING = "docs/start.md"
# JupyterLab opens Markdown in its text editor by default; the landing page should read as a page.
# Nor should it ask, on a closed network, whether to fetch Jupyter's news.
SETTINGS = {"@jupyterlab/docmanager-extension/plugin.jupyterlab-settings":
            {"defaultViewers": {"markdown": "Markdown Preview"}},
            "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false"}}
# The layout JupyterLab restores at /lab, the address it prints with --no-browser: the landing page
# open. Written once; from then on JupyterLab keeps the student's own layout there.
_PAGE = f"markdownviewer-widget:{LANDING}"
LAYOUT = {"data": {"layout-restorer:data": {"main": {"dock": {"type": "tab-area", "currentIndex": 0,
                                                             "widgets": [_PAGE]}, "current": _PAGE}},
                   _PAGE: {"data": {"path": LANDING, "factory": "Markdown Preview"}}},
          "metadata": {"id": "default"}}
# jupyterlab_server names a workspace's file by its id and the start of the id's SHA-256.
LAYOUT_FILE = f"default-{hashlib.sha256(b'default').hexdigest()[:4]}.jupyterlab-workspace"


def setup(workspace: Path = WORKSPACE) -> list[Path]:
    """Create the workspace and copy what is missing from it; returns the files copied."""
    copied = []
    for folder in FOLDERS:
        (workspace / folder).mkdir(parents=True, exist_ok=True)
        for src in sorted((ROOT / folder).glob("[0-9]*.ipynb")):
            dst = workspace / folder / src.name
            if not dst.exists():
                shutil.copyfile(src, dst)
                copied.append(dst)
    docs = workspace / "docs"
    if not docs.is_symlink():
        docs.symlink_to(os.path.relpath(ROOT / "docs", workspace), target_is_directory=True)
    for name, settings in SETTINGS.items():
        path = workspace / ".lab" / "settings" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(settings, indent=1))
    layout = workspace / ".lab" / "workspaces" / LAYOUT_FILE
    if not layout.exists():
        layout.parent.mkdir(parents=True, exist_ok=True)
        layout.write_text(json.dumps(LAYOUT))
    return copied


def reset(chapter: str, workspace: Path = WORKSPACE) -> list[Path]:
    """Move the student's copies of one chapter to workspace/backup/ and copy the course's afresh."""
    sources = [src for folder in FOLDERS for src in sorted((ROOT / folder).glob(f"{chapter}_*.ipynb"))]
    if not sources:
        chapters = sorted({p.name[:2] for p in (ROOT / "notebooks").glob("[0-9]*.ipynb")})
        raise SystemExit(f"no chapter {chapter!r}: NB is one of {', '.join(chapters)}")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for src in sources:
        dst = workspace / src.parent.name / src.name
        if dst.exists():
            backup = workspace / "backup" / f"{src.parent.name}-{src.stem}-{stamp}.ipynb"
            backup.parent.mkdir(parents=True, exist_ok=True)
            dst.rename(backup)
            print(f"your {src.parent.name}/{src.name} is now {backup}")
    setup(workspace)
    return [workspace / src.parent.name / src.name for src in sources]


def start(args: list[str], workspace: Path = WORKSPACE) -> None:
    """Set up, then replace this process with JupyterLab rooted at the workspace, on the landing page."""
    for path in setup(workspace):
        print(f"copied {path}")
    jupyter = Path(sys.executable).parent / "jupyter"
    cmd = [str(jupyter), "lab", f"--ServerApp.root_dir={workspace}", str(workspace / LANDING), *args]
    if os.geteuid() == 0:  # containers and cloud notebooks run as root; Jupyter refuses unless told
        cmd.append("--allow-root")
    # Lab settings and layouts kept in the workspace: nothing of the student's home is changed.
    env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(workspace / ".lab" / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(workspace / ".lab" / "workspaces"))
    os.execve(cmd[0], cmd, env)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    sub.add_parser("setup")
    sub.add_parser("reset").add_argument("chapter", help="two digits, e.g. 05")
    sub.add_parser("start", help="ARGS after it go to jupyter lab")
    args, jupyter_args = ap.parse_known_args(argv)
    if jupyter_args and args.what != "start":
        ap.error(f"unrecognized arguments: {' '.join(jupyter_args)}")
    if args.what == "setup":
        for path in setup():
            print(f"copied {path}")
    elif args.what == "reset":
        reset(args.chapter.zfill(2))
    else:
        start(jupyter_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
