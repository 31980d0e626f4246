"""Draws docs/architecture.png: the package's floors (each folder and its modules, read from the
package itself, so the picture cannot fall behind a move) and one request's path through them.

Hand-written tool: `python tools/draw_architecture.py draw [docs/architecture.png]`."""

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from benchlib import commands  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

PACKAGE = Path(__file__).resolve().parent.parent / "miniinfer"
# Top floor first; each floor's folders, and the root modules it holds (the command line over all floors).
FLOORS = [(("course",), "#f9d3a5", ()), (("serving",), "#c6dbef", ("cli",)), (("engine",), "#9ecae1", ()),
          (("worker", "kernels"), "#c7e9c0", ()), (("core", "layers", "distributed"), "#e5f5e0", ()),
          (("model",), "#f0f0f0", ())]
# Old names kept so that workspaces copied before a move still run (their docstrings say so): not drawn.
MOVED = {"worker/logits_processors", "worker/sampler"}
# What a reader looks for first, beside the module that has it.
NOTES = {"server": "HTTP in", "llm_engine": "LLMEngine.step", "core": "loop", "model_runner": "CUDA graphs",
         "scheduler": "token budget"}
PATH = [("HTTP request", "serving/server.py"), ("body -> SamplingParams", "serving/openai/params.py"),
        ("AddRequest to the engine's process", "engine/async_engine.py, core_client.py"),
        ("run_engine -> LLMEngine.step", "engine/core.py, llm_engine.py"),
        ("Scheduler.schedule -> SchedulerOutput", "core/scheduler.py"),
        ("Executor.launch", "engine/executor.py | multiprocess.py"), ("Worker -> ModelRunner", "worker/"),
        ("forward: kv_cache + kernels, sample", "worker/, kernels/"),
        ("ModelRunnerOutput -> update_from_output", "core/"), ("RequestOutput -> text, SSE", "engine/ -> serving/")]


def modules(folder: str) -> list[str]:
    """The folder's modules and subpackages, as a reader finds them (subpackage/ with its modules)."""
    out = []
    for path in sorted((PACKAGE / folder).iterdir()):
        if path.suffix == ".py" and path.stem != "__init__" and f"{folder}/{path.stem}" not in MOVED:
            out.append(f"{path.stem} ({NOTES[path.stem]})" if path.stem in NOTES else path.stem)
        elif path.is_dir() and (path / "__init__.py").exists():
            inner = sorted(p.stem for p in path.glob("*.py") if p.stem != "__init__")
            shown = inner if len(inner) <= 6 else [inner[0], "...", inner[-1]]
            out.append(f"{path.name}/{{{', '.join(shown)}}}")
    return out


def draw(out: str = str(PACKAGE.parent / "docs" / "architecture.png")) -> None:
    fig, ax = plt.subplots(figsize=(16, 8.5))
    ax.set_xlim(0, 16.3)
    ax.set_ylim(0, 8.5)
    ax.axis("off")
    for i, (folders, color, roots) in enumerate(FLOORS):
        y = 7.3 - i * 1.2
        ax.add_patch(FancyBboxPatch((0.2, y), 10.0, 1.0, boxstyle="round,pad=0.02", fc=color, ec="#444"))
        title = "  ·  ".join(f"{f}/" for f in folders) + "".join(f"   (+ {r}.py)" for r in roots)
        lines = textwrap.wrap("  |  ".join(" · ".join(modules(f)) for f in folders), 160)
        one = len(lines) == 1  # else smaller lines under a raised title
        ax.text(0.4, y + (0.68 if one else 0.8), title, fontsize=13, weight="bold", va="center")
        for k, line in enumerate(lines):
            ax.text(0.4, y + (0.28 if one else 0.5 - 0.17 * k), line, fontsize=8.2 if one else 6.6, va="center")
    ax.text(5.0, 0.05, "each floor imports only itself and the floors below (tests/test_layers.py)",
            fontsize=9, style="italic", ha="center")
    ax.text(13.3, 8.3, "one request's path", fontsize=12, weight="bold", ha="center")
    step = 7.9 / len(PATH)
    for i, (what, where) in enumerate(PATH):
        y = 8.0 - (i + 1) * step
        ax.add_patch(FancyBboxPatch((10.6, y), 5.4, step * 0.62, boxstyle="round,pad=0.02", fc="white", ec="#2166ac"))
        ax.text(13.3, y + step * 0.31, f"{what}  ({where})", fontsize=7.6, ha="center", va="center")
        if i:
            arrow = dict(arrowstyle="->", color="#2166ac")
            ax.annotate("", (13.3, y + step * 0.62), (13.3, y + step), arrowprops=arrow)
    fig.savefig(out, dpi=100, bbox_inches="tight")


if __name__ == "__main__":
    commands(draw=draw)
