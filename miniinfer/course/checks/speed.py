"""Speed items: an answer timed against a reference, in the same run and in turns.

Hand-written module. A speed item is registered like an exercise (id "NN.answer.speed") and prints
one line the grader reads:
- `passed: speed R of the reference's (...); full marks from F` when R >= F,
- `slow: speed R of the reference's (...); full marks from F` when R < F,
- `needs GPU: ...` where the item times a GPU kernel and there is no GPU (Triton's CPU interpreter
  says nothing about a kernel's speed).
R is the reference's time over the answer's (1.0: as fast; above: faster), so it is fair on any
machine. The reference is the package's kernel or runner, or the given code on the course's reference
answers (each item says which). A wrong result is not timed: it fails the item.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Callable

import torch

from miniinfer.course.checks.harness import EXERCISES, Exercise, differs, judged, run_answer

FULL = 0.8  # the speed ratio for full marks unless an item names its own


def speed_item(chapter: str, number: int, answer: str, argument: str | None = None, full: float = FULL):
    """Register a timing function as the speed item of exercise `number` of chapter's problem set."""
    def register(measure: Callable) -> Callable:
        @functools.wraps(measure)
        def timed(*args):
            ratio, detail = measure(*args)
            if ratio is not None:
                said = "passed" if ratio >= full else "slow"
                print(f"{said}: speed {ratio:.2f} of the reference's ({detail}); full marks from {full:.2f}")
        run = judged(f"exercise {number} ({answer})", timed)
        ex = Exercise(f"{chapter}.{answer}.speed", chapter, number, answer, argument or answer, run, True, full)
        EXERCISES[ex.id] = ex
        return run
    return register


def needs_gpu(what: str) -> tuple[None, str]:
    print(f"needs GPU: {what} is timed on a GPU (on the CPU Triton runs in its interpreter)")
    return None, ""


def gpu_seconds(fn: Callable) -> float:
    """The median time of one call of fn on the GPU."""
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=200, return_mode="median") / 1e3


def faster_of(yours: Callable, package: Callable, timer: Callable[[Callable], float], rounds: int = 2):
    """(the answer's best time, the package's best time), timed in turns so that a machine's drift
    (clocks, other work) falls on both."""
    best = [math.inf, math.inf]
    for _ in range(rounds):
        for i, fn in enumerate((yours, package)):
            best[i] = min(best[i], timer(fn))
    return best[0], best[1]


def wall_seconds(fn: Callable) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def kernel_ratio(name: str, fn: Callable, package: Callable, args: tuple, nbytes: int,
                 rtol: float = 2e-2, atol: float = 2e-2) -> tuple[float, str]:
    """A kernel's speed against the package's (the reference) on args, on the GPU: its result checked
    first, then both timed; nbytes is what one call must read and write, for GB/s."""
    __tracebackhide__ = True
    got, want = run_answer(fn, args, f"{name}, the timed call"), package(*args)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        if (wrong := differs(g.float(), w.float(), rtol, atol)) is not None:
            raise AssertionError(f"{name}, the timed call: the result is wrong, so it is not timed\n  {wrong}")
    yours, theirs = faster_of(lambda: fn(*args), lambda: package(*args), gpu_seconds)
    copy = copy_gbps(args[0].device)
    return theirs / yours, (f"{nbytes / yours / 1e9:,.0f} against {nbytes / theirs / 1e9:,.0f} GB/s; "
                            f"a copy moves {copy:,.0f} GB/s on this GPU")


def copy_gbps(device) -> float:
    """The bandwidth of a plain copy of 256 MiB, read and written: the roof for these kernels."""
    x = torch.empty(64 << 20, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    return 2 * x.numel() * 4 / gpu_seconds(lambda: y.copy_(x)) / 1e9
