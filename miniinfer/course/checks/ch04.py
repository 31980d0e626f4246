"""The checks of problem set 04 (triton rmsnorm rope): each answer against the reference, on random inputs.

Hand-written module (chapter 04)."""

from __future__ import annotations

from typing import Callable

import torch

from miniinfer.course.checks.harness import DTYPES, check, device, exercise, randint, rope_inputs
from miniinfer.model.transformer import apply_rope, rms_norm


def kernel_dtypes() -> tuple[torch.dtype, ...]:
    """Triton's interpreter computes bfloat16 wrongly (NaN from a product of two), so on the CPU
    the kernels are checked in float32 and float16 only."""
    return DTYPES if torch.cuda.is_available() else DTYPES[:2]


def _in_float32(op: Callable) -> Callable:
    """op computed in float32 on the inputs as given, each output rounded once to the input dtype:
    what a kernel that computes in float32 registers stores."""
    def run(*args):
        dtype = next(a.dtype for a in args if isinstance(a, torch.Tensor))
        out = op(*[a.float() if isinstance(a, torch.Tensor) else a for a in args])
        return out.to(dtype) if isinstance(out, torch.Tensor) else tuple(o.to(dtype) for o in out)
    return run


@exercise("04", 1, "rms_norm_kernel", argument="rms_norm")
def check_rms_norm_kernel(fn: Callable) -> None:
    """fn(x, weight, eps) launching the kernel: rows of odd widths in float32, float16 (values large
    enough that x**2 overflows it) and, on a GPU, bfloat16; on the GPU when there is one."""
    dtypes = kernel_dtypes()

    def inputs(gen, case):
        dtype = dtypes[case % len(dtypes)]
        rows, cols = randint(gen, 1, 12), randint(gen, 3, 300)
        scale = 1000.0 if dtype == torch.float16 and case > 2 else 1e-3 if case == 4 else 3.0  # eps matters
        return ((torch.randn(rows, cols, generator=gen) * scale).to(dtype),
                torch.randn(cols, generator=gen).to(dtype), 1e-5)
    check("rms_norm kernel", fn, rms_norm, inputs, cases=6, device=device())


@exercise("04", 2, "rope_kernel", argument="apply_rope")
def check_rope_kernel(fn: Callable) -> None:
    """fn(q [T, Hq, D], k [T, Hk, D], cos, sin [T, D/2] float32) launching the kernel: float32,
    float16 and, on a GPU, bfloat16 heads of odd counts and widths; on the GPU when there is one."""
    dtypes = kernel_dtypes()
    check("rope kernel", fn, _in_float32(apply_rope), lambda gen, case: rope_inputs(gen, case, dtypes),
          cases=6, device=device())
