"""What the bench scripts share: the header of a result (the machine and the versions it was measured
with), the result file itself (merged part by part and rewritten after each, so that a run cut short
keeps what it finished) and the GPU timer.

Hand-written tool, imported by the others in tools/.
"""

import datetime
import json
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

import torch


def version(package: str) -> str | None:
    """A package's installed version, without importing it (None: not installed)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def cpu_name() -> str:
    """The CPU's model where Linux names it, else the architecture."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
                platform.machine())


def header(**extra: Any) -> dict:
    """The machine and the versions a result comes from: the GPU's name (None on a CPU) and count, the
    CPU and its load when the run began (a lend's host is shared: host-bound rows move with it), torch,
    triton, transformers and Python, and the date; then `extra`, a script's own fields."""
    gpu = torch.cuda.is_available()
    return {"gpu": torch.cuda.get_device_name() if gpu else None, "gpus": torch.cuda.device_count() if gpu else 0,
            "cpu": f"{cpu_name()}, {os.cpu_count()} cores", "load_1min": round(os.getloadavg()[0], 2),
            "torch": torch.__version__,
            "triton": version("triton"), "transformers": version("transformers"),
            "python": platform.python_version(), "date": datetime.date.today().isoformat(), **extra}


class Results:
    """A result file: what it held already (a rerun of one part keeps the others), the header of this
    run, and each part as it finishes."""

    def __init__(self, path: str | os.PathLike, **extra: Any):
        self.path = Path(path)
        self.data: dict = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.data.update(header(**extra))

    def save(self, part: str, value: Any) -> Any:
        """value filed under part, the file rewritten; value returned."""
        self.data[part] = value
        self.write()
        return value

    def saver(self, part: str) -> Callable[[Any], Any]:
        """save for one part: for a part that saves what it has so far as it goes."""
        return lambda value: self.save(part, value)

    def write(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=1) + "\n")


def load_file(path: str) -> Any:
    """The Python module in the file at path (another commit's copy of a kernel, for an A/B in one run)."""
    import importlib.util
    import sys
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # where its dataclasses look up their own module while it runs
    spec.loader.exec_module(module)
    return module


def gpu_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100, runs: int = 1) -> float:
    """Milliseconds a call of fn takes on the GPU: the median of triton's do_bench (which flushes the L2
    cache before each call), the least of `runs` such medians where a machine's timings jump now and then."""
    from triton.testing import do_bench
    return min(do_bench(fn, warmup=warmup, rep=rep, return_mode="median") for _ in range(runs))


def graph_ms(calls: list[Callable[[], object]], rep: int = 200, runs: int = 1) -> float:
    """GPU milliseconds per call: the calls (each over its own copy of the data, or one call repeated)
    in a row, replayed from a CUDA graph by triton's do_bench_cudagraph, so the host's launch overhead
    stays out as in the engine's decode steps; the least of `runs` medians of about `rep` ms each."""
    from triton.testing import do_bench_cudagraph

    def in_a_row() -> None:
        for call in calls:
            call()
    return min(do_bench_cudagraph(in_a_row, rep=rep, return_mode="median") for _ in range(runs)) / len(calls)


def commands(**fns: Callable[..., object]) -> None:
    """A tool's command line, `python tools/TOOL.py COMMAND ARG...`: fns[COMMAND](*ARGs). Without a
    command it knows, the usage (each command with its parameters) and exit."""
    import inspect
    import sys
    name, args = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else ("", [])
    if name not in fns:
        usage = [f"  python {sys.argv[0]} {n} " + " ".join(
            ("[" + p.name.upper() + "...]") if p.kind is p.VAR_POSITIONAL else p.name.upper()
            for p in inspect.signature(fn).parameters.values()) for n, fn in fns.items()]
        raise SystemExit("\n".join([f"unknown command {name!r}; one of:" if name else "commands:", *usage]))
    fns[name](*args)
