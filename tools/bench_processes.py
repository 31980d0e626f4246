"""How long the engine's processes take to start on a machine without a GPU: each process a fresh
interpreter (spawn) against a fork from a server that imported the engine once (chapter 08's
`process_context`, the default there). The course model, float32; the median of `repeat` starts.

    python tools/bench_processes.py run docs/benchmarks/processes_cpu_2core.json [REPEAT]
"""

import multiprocessing
import statistics
import time
from typing import Callable

from benchlib import Results, commands

import miniinfer as mi
from miniinfer.engine import core_client, multiprocess, processes

CONFIGS = {"two tensor ranks": mi.EngineConfig(tensor_parallel_size=2),
           "two replicas": mi.EngineConfig(data_parallel_size=2)}


def started(config: mi.EngineConfig) -> float:
    """Seconds from asking for the engine until it can serve (every process up, its model loaded)."""
    t0 = time.perf_counter()
    engine = mi.ReplicatedEngine(config) if config.data_parallel_size > 1 else mi.LLMEngine(config)
    seconds = time.perf_counter() - t0
    engine.close()
    return seconds


def with_context(context: Callable) -> None:
    """The context the engine's process (replicas) and its ranks (tensor parallel) are started from."""
    core_client.process_context = multiprocess.process_context = context


def run(out: str, repeat: str = "3") -> None:
    results = Results(out)
    fork_server = processes.process_context
    for method, context in (("spawn", lambda: multiprocessing.get_context("spawn")), ("forkserver", fork_server)):
        with_context(context)
        for name, config in CONFIGS.items():
            times = [started(config) for _ in range(int(repeat))]
            results.save(f"{method}: {name}", {"seconds": times, "median_s": statistics.median(times)})
            print(f"{method}, {name}: {statistics.median(times):.2f} s to start (median of {repeat})", flush=True)


if __name__ == "__main__":
    commands(run=run)
