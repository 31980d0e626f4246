"""Build the course model's corpus: Python source from the standard library and a pinned list of
permissively licensed packages, deduplicated, with validation held out by package.

Hand-written tool. Needs pip access to PyPI (the wheels below) and writes, under --out:
    train.jsonl.xz, val.jsonl.xz  one {"source": ..., "path": ..., "text": ...} per line
    manifest.json                 packages, versions, licenses (declared and from the wheel's
                                  metadata), files and characters kept, sha256 of the outputs

    python tools/course_corpus.py --out corpus          # the shipped corpus (about 150 MB of wheels)
    python tools/course_corpus.py --out /tmp/c --only click attrs   # a small one, for a look

The standard library is the running interpreter's (its version goes into the manifest). Wheels are
fixed by name and version, so the same interpreter rebuilds the same corpus byte for byte.
"""

from __future__ import annotations

import argparse
import email.parser
import hashlib
import json
import lzma
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

# (name, version, license): pure- or mostly-Python projects under MIT, BSD, Apache or PSF-style terms.
PACKAGES = [
    ("django", "5.2.19", "BSD-3-Clause"),
    ("sympy", "1.14.0", "BSD-3-Clause"),
    ("transformers", "5.23.0", "Apache-2.0"),
    ("sqlalchemy", "2.1.9", "MIT"),
    ("networkx", "3.6.1", "BSD-3-Clause"),
    ("pandas", "3.1.1", "BSD-3-Clause"),
    ("scikit-learn", "1.9.1", "BSD-3-Clause"),
    ("scipy", "1.17.1", "BSD-3-Clause"),
    ("numpy", "2.4.6", "BSD-3-Clause"),
    ("matplotlib", "3.11.2", "Matplotlib (PSF-style)"),
    ("astropy", "8.0.2", "BSD-3-Clause"),
    ("twisted", "26.10.0", "MIT"),
    ("tornado", "6.6.1", "Apache-2.0"),
    ("pygments", "2.21.0", "BSD-2-Clause"),
    ("sphinx", "9.0.4", "BSD-2-Clause"),
    ("mypy", "2.4.1", "MIT"),
    ("black", "26.10.1", "MIT"),
    ("pip", "26.3", "MIT"),
    ("setuptools", "84.2.1", "MIT"),
    ("pytest", "9.2.0", "MIT"),
    ("rich", "15.0.0", "MIT"),
    ("jinja2", "3.1.6", "BSD-3-Clause"),
    ("werkzeug", "3.1.9", "BSD-3-Clause"),
    # Held out (validation): neither the old model (standard library only) nor the new one saw them.
    ("flask", "3.1.3", "BSD-3-Clause"),
    ("click", "8.5.1", "BSD-3-Clause"),
    ("requests", "2.34.2", "Apache-2.0"),
    ("attrs", "26.1.0", "MIT"),
]
HELD_OUT = {"flask", "click", "requests", "attrs"}
MAX_FILE_CHARS = 300_000  # larger files are generated tables, not code anyone writes
MAX_LINE_CHARS = 1_000    # so are files with such lines (embedded data, minified literals)
EOS = "<|endoftext|>"


def keep(text: str) -> bool:
    """Whether a source file belongs in the corpus: not empty, not generated, no EOS marker."""
    return (bool(text.strip()) and len(text) <= MAX_FILE_CHARS and EOS not in text
            and max(map(len, text.splitlines()), default=0) <= MAX_LINE_CHARS)


def stdlib_files() -> list[tuple[str, str]]:
    """(path, text) of the running interpreter's standard library, tests included, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if {"site-packages", "dist-packages", "__pycache__"} & set(rel.parts):
            continue
        try:
            out.append((str(rel), path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue  # a few test fixtures are deliberately mis-encoded
    return out


def wheel_files(wheel: Path) -> tuple[list[tuple[str, str]], str]:
    """(path, text) of a wheel's .py files, sorted, and the license its metadata states."""
    with zipfile.ZipFile(wheel) as z:
        names = sorted(n for n in z.namelist() if n.endswith(".py"))
        files = []
        for n in names:
            try:
                files.append((n, z.read(n).decode("utf-8")))
            except UnicodeDecodeError:
                continue
        meta_name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(z.read(meta_name).decode("utf-8"))
    license_ = meta.get("License-Expression") or (meta.get("License") or "").splitlines()[0:1] or \
        [c for c in meta.get_all("Classifier", []) if c.startswith("License ::")]
    return files, license_ if isinstance(license_, str) else "; ".join(license_)


def download(name: str, version: str, dest: Path) -> Path:
    # The wheel for this interpreter and platform; where a package ships compiled wheels, their .py
    # files are the same on every platform.
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--dest", str(dest), f"{name}=={version}"], check=True)
    stem = name.replace("-", "_").lower()
    return next(p for p in dest.glob("*.whl") if p.name.lower().startswith(f"{stem}-{version}"))


def build(out: Path, only: list[str] | None = None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()  # sha256 of every text kept: the first copy wins (stdlib first)
    manifest = {"python": sys.version.split()[0], "platform": sysconfig.get_platform(),
                "max_file_chars": MAX_FILE_CHARS,
                "max_line_chars": MAX_LINE_CHARS, "sources": []}
    writers = {split: lzma.open(out / f"{split}.jsonl.xz", "wt", encoding="utf-8", preset=9)
               for split in ("train", "val")}

    def add(source: str, files: list[tuple[str, str]], split: str, **info) -> None:
        kept = chars = dupes = 0
        for path, text in files:
            digest = hashlib.sha256(text.encode()).hexdigest()
            if not keep(text):
                continue
            if digest in seen:
                dupes += 1
                continue
            seen.add(digest)
            writers[split].write(json.dumps({"source": source, "path": path, "text": text}) + "\n")
            kept, chars = kept + 1, chars + len(text)
        manifest["sources"].append({"source": source, "split": split, "files": kept, "chars": chars,
                                    "duplicates_dropped": dupes, **info})
        print(f"{source:14} {split:5} {kept:6} files {chars / 1e6:7.1f}M chars", flush=True)

    if not only:
        add("stdlib", stdlib_files(), "train", version=manifest["python"], license="PSF-2.0")
    with tempfile.TemporaryDirectory() as tmp:
        for name, version, license_ in PACKAGES:
            if only and name not in only:
                continue
            files, meta_license = wheel_files(download(name, version, Path(tmp)))
            add(name, files, "val" if name in HELD_OUT else "train", version=version, license=license_,
                license_in_metadata=meta_license)
    for w in writers.values():
        w.close()
    for split in writers:
        manifest[f"{split}_sha256"] = hashlib.sha256((out / f"{split}.jsonl.xz").read_bytes()).hexdigest()
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def read_split(folder: Path, split: str) -> list[dict]:
    """The documents of one split, in corpus order."""
    with lzma.open(folder / f"{split}.jsonl.xz", "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", nargs="*", help="just these packages (no standard library)")
    args = ap.parse_args()
    build(args.out, args.only)
