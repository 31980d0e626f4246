"""The capstone's checks: the student's engine on one workload, its greedy tokens against the package
engine's, and its speed against that engine's in the same run (the class's leaderboard).

Hand-written module (the capstone)."""

from __future__ import annotations

from typing import Callable

import torch

from miniinfer.course.checks.harness import (
    blocks_back,
    check_tokens,
    device,
    exercise,
    named,
    run_answer,
)
from miniinfer.course.checks.speed import faster_of, speed_item, wall_seconds

# Sixteen requests of the course model, each a shared file header and its own first line of code.
HEADER = "# utilities for parsing and formatting numbers\nimport math\n\n"
FIRST_LINES = ["def mean(xs):", "def median(xs):", "class Stack:", "def fibonacci(n):", "def is_prime(n):",
               "def gcd(a, b):", "def clamp(x, lo, hi):", "class Queue:"]


def workload() -> tuple:
    """The capstone's workload: (the package engine's config, the prompts, their sampling). On a GPU 64
    requests of 64 tokens, on a CPU 16 of 24; greedy, every request its full length. The config is the
    engine as the package builds it by default, kept small: 4 requests at a time, prompts in pieces of 32
    tokens, no prefix cache, a pool of 1,024 blocks."""
    import miniinfer as mi
    gpu = torch.cuda.is_available()
    prompts = [HEADER + line for line in FIRST_LINES] * (8 if gpu else 2)
    params = mi.SamplingParams(temperature=0, max_tokens=64 if gpu else 24, ignore_eos=True)
    # A pool of its own size, not a share of the device's memory: the check holds two engines at once
    config = mi.EngineConfig(device=device(), max_num_seqs=4, max_num_batched_tokens=32, enable_chunked_prefill=True,
                             enable_prefix_caching=False, num_blocks=1024)
    return config, prompts, params


def _engine(build: Callable, config):
    """build(config) -> an engine, or AnswerError naming what went wrong."""
    __tracebackhide__ = True
    engine = run_answer(build, (config,), "your_engine(the workload's config)")
    if not callable(getattr(engine, "generate", None)):
        raise AssertionError(f"your_engine returned {type(engine).__name__}: an engine (mi.LLMEngine or one "
                             "built of its seams) has a generate method")
    return engine


@exercise("99", 1, "your_engine")
def check_capstone(build: Callable) -> None:
    """build(config) -> an engine: on the workload, the package engine's greedy tokens for every request,
    every block back."""
    __tracebackhide__ = True
    import miniinfer as mi
    config, prompts, params = workload()
    expected = [o.token_ids for o in mi.LLMEngine(config).generate(prompts, params, use_tqdm=False)]
    engine = _engine(build, config)
    got = [o.token_ids for o in run_answer(lambda: engine.generate(prompts, params, use_tqdm=False), (),
                                           "your engine's generate on the workload")]
    check_tokens(named(prompts, "greedy, the workload"), expected, got)
    if isinstance(getattr(engine, "block_manager", None), mi.BlockManager):
        blocks_back(engine.block_manager, f"the workload's {len(prompts)} requests")
    print(f"passed: the package engine's greedy tokens on the workload's {len(prompts)} requests")


@speed_item("99", 1, "your_engine", full=1.0)
def speed_capstone(build: Callable):
    """The workload's wall time on your engine against the package engine's (the workload's config), in
    turns, each after a first run (compiles, graphs, caches): the ratio is the leaderboard's."""
    import miniinfer as mi
    config, prompts, params = workload()
    package = mi.LLMEngine(config)
    yours = _engine(build, config)
    runs = [lambda: yours.generate(prompts, params, use_tqdm=False),
            lambda: package.generate(prompts, params, use_tqdm=False)]
    got, expected = ([o.token_ids for o in run()] for run in runs)  # a first run each: caches, graphs
    check_tokens(named(prompts, "greedy, the timed workload (a wrong answer is not timed)"), expected, got)
    mine, theirs = faster_of(runs[0], runs[1], wall_seconds, rounds=3)
    tokens = len(prompts) * params.max_tokens
    return theirs / mine, (f"{tokens / mine:,.0f} against {tokens / theirs:,.0f} output tokens/s, {len(prompts)} "
                           f"requests x {params.max_tokens} tokens")
