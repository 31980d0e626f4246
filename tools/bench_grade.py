"""The grader's speed items on the reference solutions, and on deliberately slow variants of them.

    python tools/bench_grade.py OUT.json

Each problem set with speed items runs its solution notebook's code (check cells left out) into one
namespace, as a student's kernel holds it; every speed item is then measured on the solution's answer
and on a slow variant (the same kernel launched with one warp per program, or tiles too small to
stream the weight; host code that waits 50 ms a step), as `miniinfer grade` would. The JSON holds each
item's printed line, status and ratio, with the machine and versions. On the GPU the reference
solutions must reach full marks and the slow variants less (docs/benchmarks/grade_speed_*.json).
"""

from __future__ import annotations

import contextlib
import io
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import build  # noqa: E402

from miniinfer.course import checks  # noqa: E402


def one_warp(kernel, **launch):
    """The kernel launched with one warp a program (and launch's other values): the same code, with
    a quarter or less of the threads the default gives it to hide memory latency with."""
    class Launch:
        def __getitem__(self, grid):
            return lambda *args, **kw: kernel[grid](*args, **{**kw, **launch, "num_warps": 1})
    return Launch()


def slow_variants(chapter: str, ns: dict) -> dict:
    """{speed item id: the namespace's name -> its slow stand-in}, the solution's code otherwise."""
    if chapter == "04":
        return {"04.rms_norm_kernel.speed": {"rms_norm_kernel": one_warp(ns["rms_norm_kernel"])},
                "04.rope_kernel.speed": {"rope_kernel": one_warp(ns["rope_kernel"])}}
    if chapter == "05":
        return {"05.merge_kernel.speed": {"merge_kernel": one_warp(ns["merge_kernel"])}}
    if chapter == "10":  # one int32 word (8 inputs) per row of the tile a step: short loads, and few
        return {"10.int4_gemv_kernel.speed": {"int4_gemv_kernel": one_warp(ns["int4_gemv_kernel"], WORDS=1)}}
    if chapter == "06":
        metadata = ns["varlen_metadata"]

        def waiting(*args):
            time.sleep(0.05)
            return metadata(*args)
        return {"06.YourRunner.speed": {"varlen_metadata": waiting}}
    return {}


def measure(ex, ns: dict) -> dict:
    printed = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(printed):
        ex.check(*eval(f"({ex.argument},)", ns))
    line = printed.getvalue().strip().splitlines()[-1]
    ratio = line.split("speed ", 1)[1].split(" ", 1)[0] if line.startswith(("passed", "slow")) else None
    return {"line": line, "status": line.split(":")[0], "ratio": float(ratio) if ratio else None,
            "seconds": round(time.perf_counter() - t0, 1)}


def main(out: str) -> None:
    result: dict = {"machine": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor(),
                    "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "items": {}}
    try:
        import triton
        result["triton"] = triton.__version__
    except ImportError:
        pass
    for chapter in ("04", "05", "06", "09", "10"):
        ns = build.solution_globals(chapter)
        slow = slow_variants(chapter, ns)
        for ex in (e for e in checks.problem_set(chapter) if e.speed):
            entry = {"reference solution": measure(ex, ns)}
            if ex.id in slow:
                saved = {name: ns[name] for name in slow[ex.id]}
                ns.update(slow[ex.id])
                try:
                    entry["slow variant"] = measure(ex, ns)
                finally:
                    ns.update(saved)
            result["items"][ex.id] = entry
            print(ex.id, json.dumps(entry), flush=True)
    Path(out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
