"""Chapter 11's CPU measurement: gloo's all-reduce latency by message size, and the engine's speed on
the course model at 1 and 2 ranks.

    python tools/bench_tp_cpu.py run docs/benchmarks/tp_cpu_2core.json

On a CPU both ranks share the machine's cores, so two ranks are not expected to be faster: the
numbers show what a collective costs next to a step (the alpha of chapter 11's model, on this
machine), not a speed-up.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from benchlib import commands, header

SIZES = [256, 4096, 65536, 1 << 20]  # float32 values: 1 KiB to 4 MiB
REPS = 50


def _all_reduce_rank(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    result = {}
    for n in SIZES:
        x = torch.ones(n)
        for _ in range(5):
            dist.all_reduce(x)
        rounds = []
        for _ in range(5):  # REPS calls back to back, as a model's layers make them; the best round
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(REPS):
                dist.all_reduce(x)
            rounds.append((time.perf_counter() - t0) / REPS)
        result[str(n * 4)] = min(rounds) * 1e6
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def all_reduce_us() -> dict:
    """Microseconds an all-reduce of each size (bytes) takes between two gloo processes, in a run of
    back-to-back calls (the best of five runs)."""
    folder = tempfile.mkdtemp()
    store, out = os.path.join(folder, "store"), os.path.join(folder, "out.json")
    mp.spawn(_all_reduce_rank, args=(store, out), nprocs=2)
    return json.loads(Path(out).read_text())


def engine_speed(ranks: int, requests: int = 4, tokens: int = 32) -> dict:
    import miniinfer as mi
    engine = mi.LLMEngine(mi.EngineConfig(tensor_parallel_size=ranks, num_blocks=128))
    prompts = ["def fibonacci(n):", "import os\n\n\ndef list_files(", "class Stack:\n", "for i in range(10):\n"]
    params = mi.SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    try:
        engine.generate(prompts[:requests], params, use_tqdm=False)  # a first round: warm
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            outs = engine.generate(prompts[:requests], params, use_tqdm=False)
            best = min(best, time.perf_counter() - t0)
        steps = tokens  # every request decodes together: one step per token after the prefill step
        return {"ranks": ranks, "requests": requests, "tokens_each": tokens, "seconds": best,
                "output_tokens_per_s": requests * tokens / best, "ms_per_step": 1e3 * best / steps,
                "tokens": [o.token_ids for o in outs]}
    finally:
        engine.close()


def main(out: str) -> None:
    result = header(machine=f"{platform.machine()}, {os.cpu_count()} cores", all_reduce_us_by_bytes=all_reduce_us())
    one, two = engine_speed(1), engine_speed(2)
    result["same_tokens"] = one.pop("tokens") == two.pop("tokens")
    result["engine"] = {"1 rank": one, "2 ranks": two}
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    commands(run=main)
