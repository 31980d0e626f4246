"""A step's cost on the CPU when a prompt joins 100 decoders, against a decode-only step (issue 22).

    python tools/bench_cpu_step.py [--out docs/benchmarks/cpu_step.json]

The course model, float32, 2 threads: 100 requests decode; every fifth step a new 130-token
prompt joins. Reports the median time of decode-only steps and of steps that carry a prompt.
"""

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
from benchlib import header

import miniinfer as mi


def measure(steps: int = 60) -> dict:
    torch.set_num_threads(2)
    rng = random.Random(0)
    engine = mi.LLMEngine(mi.EngineConfig(max_num_seqs=128))
    params = mi.SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    for _ in range(100):
        engine.add_request([rng.randrange(1, 4000) for _ in range(16)], params)
    engine.step()  # the 100 prompts
    times = {"decode": [], "with_prompt": []}
    for i in range(steps):
        joins = i % 5 == 4
        if joins:
            engine.add_request([rng.randrange(1, 4000) for _ in range(130)], mi.SamplingParams(max_tokens=8))
        t0 = time.perf_counter()
        engine.step()
        times["with_prompt" if joins else "decode"].append(time.perf_counter() - t0)
        assert sum(engine.stats.scheduled.values()) == len(engine.stats.scheduled) + 129 * joins
    decode, mixed = statistics.median(times["decode"]), statistics.median(times["with_prompt"])
    return {"decode_step_ms": 1e3 * decode, "step_with_prompt_ms": 1e3 * mixed, "ratio": mixed / decode,
            "decode_steps": len(times["decode"]), "steps_with_prompt": len(times["with_prompt"]),
            **header(threads=torch.get_num_threads())}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    res = measure()
    print(f"decode-only step {res['decode_step_ms']:.0f} ms; with a 130-token prompt "
          f"{res['step_with_prompt_ms']:.0f} ms ({res['ratio']:.2f}x)")
    args = ap.parse_args()
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
