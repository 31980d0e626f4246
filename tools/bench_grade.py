"""The grader's speed items on the reference solutions, and on deliberately slow variants of them.

    python tools/bench_grade.py run OUT.json [13 ...]  # measure (those problem sets only), then draw OUT.png
    python tools/bench_grade.py plot OUT.json   # draw OUT.png again from the JSON

Each problem set with speed items runs its solution notebook's code (check cells left out) into one
namespace, as a student's kernel holds it; every speed item is then measured on the solution's answer
and on a slow variant where there is one (a launcher that upcasts to float32 around the kernel, a
GEMV without split-K, host code that waits 50 ms a step, an align step that loops over the experts,
an engine that serves one request at a time), as `miniinfer grade` would. The JSON holds each item's
printed line, status and ratio, with the machine and versions. On the GPU the reference solutions
must reach full marks and the slow variants less (docs/benchmarks/grade_speed_*.json).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import platform
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
import build  # noqa: E402
from benchlib import commands, header  # noqa: E402

from miniinfer.course import checks  # noqa: E402


def upcast(launch):
    """The launcher handed float32 copies and its result cast back: three more passes over memory
    around the kernel (a student's mistake: upcasting in the launcher instead of in the kernel)."""
    def run(*args):
        out = launch(*(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args))
        dtype = args[0].dtype
        return tuple(o.to(dtype) for o in out) if isinstance(out, tuple) else out.to(dtype)
    return run


def align_by_loop(ids: torch.Tensor, num_experts: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The align step as a loop over experts that reads each one's count back to the host (a student's
    first version: right, but one wait for the device per expert, and no CUDA graph can hold it)."""
    flat = ids.flatten()
    n = flat.numel()
    size = -(-(n + num_experts * (block - 1)) // block) * block
    pairs = torch.full((size,), n, dtype=torch.int32, device=ids.device)
    expert = torch.full((size // block,), -1, dtype=torch.int32, device=ids.device)
    start = 0
    for e in range(num_experts):
        mine = (flat == e).nonzero().flatten()
        if len(mine):
            pairs[start:start + len(mine)] = mine.to(torch.int32)
            expert[start // block:(start + len(mine) + block - 1) // block] = e
            start += -(-len(mine) // block) * block
    return pairs, expert


def slow_variants(chapter: str, ns: dict) -> dict:
    """{speed item id: {a name of the solution's namespace: its slow stand-in}}."""
    if chapter == "04":
        return {"04.rms_norm_kernel.speed": {"rms_norm": upcast(ns["rms_norm"])},
                "04.rope_kernel.speed": {"apply_rope": upcast(ns["apply_rope"])}}
    if chapter == "10":  # K in one piece: 112 programs for 132 multiprocessors, each walking all of K
        return {"10.int4_gemv_kernel.speed": {"int4_gemv": functools.partial(ns["int4_gemv"], split=1)}}
    if chapter == "13":
        return {"13.experts_kernel.speed": {"align_pairs": align_by_loop}}
    if chapter == "99":  # one request at a time: the step's fixed cost paid by each request alone
        return {"99.your_engine.speed": {"your_engine": lambda config: ns["mi"].LLMEngine(
            dataclasses.replace(config, max_num_seqs=1))}}
    if chapter == "14":  # the cache read in float32: twice the bytes, and no tensor cores
        return {"14.latent_decode_kernel.speed": {"latent_decode": upcast(ns["latent_decode"])}}
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


SPEED_CHAPTERS = ("04", "05", "06", "09", "10", "13", "14", "99")  # the problem sets with speed items


def main(out: str, *chapters: str) -> None:
    result = header(machine=torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor(),
                    items={})
    for chapter in chapters or SPEED_CHAPTERS:
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
    plot(Path(out))


def plot(path: Path) -> None:
    """Each item's ratio for the reference solution and its slow variant, with full marks' line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    result = json.loads(path.read_text())
    items = list(result["items"])
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for k, (kind, colour) in enumerate((("reference solution", "#43a047"), ("slow variant", "#f9a825"))):
        ratios = [result["items"][i].get(kind, {}).get("ratio") or 0 for i in items]
        bars = ax.bar([i + (k - 0.5) * 0.38 for i in range(len(items))], ratios, 0.38, color=colour, label=kind)
        ax.bar_label(bars, [f"{r:.2f}" if r else "" for r in ratios], fontsize=8)
    ax.axhline(checks.speed.FULL, color="#333", ls="--", lw=1, label=f"full marks ({checks.speed.FULL:.2f})")
    ax.set_xticks(range(len(items)), [i.removesuffix(".speed") for i in items], fontsize=8)
    ax.set_ylabel("reference's time / yours")
    ax.set_title(f"miniinfer grade, speed items: {result['machine']}, torch {result['torch']}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    commands(run=main, plot=lambda out: plot(Path(out)))
