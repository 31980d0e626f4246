"""The checks of problem set 04 (triton rmsnorm rope): each answer against the reference, on random inputs.

Hand-written module (chapter 04)."""

from __future__ import annotations

from typing import Callable

import torch

from miniinfer.course.checks.harness import (
    DTYPES,
    check,
    check_tokens,
    device,
    exercise,
    named,
    randint,
    rope_inputs,
    show,
    your_answers,
)
from miniinfer.course.checks.speed import kernel_ratio, needs_gpu, speed_item
from miniinfer.model.transformer import apply_rope, rms_norm, rope_cos_sin, rope_inv_freq


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


PROMPTS = ["def fibonacci(n):\n", "class Stack:\n"]


@exercise("04", 3, "your_kernels", argument="rms_norm, apply_rope")
def check_kernel_model(rms_norm_launcher: Callable, rope_launcher: Callable) -> None:
    """The last part: the course model with its RMSNorm (the residual add's too) and RoPE launched on
    the student's kernels gives the greedy tokens of the package's ops; on the GPU when there is one."""
    __tracebackhide__ = True
    import miniinfer as mi
    from miniinfer.model.transformer import Ops
    model, tok = mi.load_model(device=device()), mi.load_tokenizer()
    prompts = [tok(text).input_ids for text in PROMPTS]
    params = mi.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [mi.generate_cached(model, p, params) for p in prompts]
    ops = Ops()
    ops.rms_norm, ops.apply_rope = rms_norm_launcher, rope_launcher
    ops.add_rms_norm = lambda x, residual, weight, eps: (rms_norm_launcher(x + residual, weight, eps), x + residual)
    model.ops = ops
    with your_answers("04"):
        got = [mi.generate_cached(model, p, params) for p in prompts]
    show(tok, [p + g for p, g in zip(prompts, got)])
    check_tokens(named(PROMPTS, "greedy"),
                 expected, got)
    print(f"passed: the greedy tokens of the package's ops on {len(PROMPTS)} prompts")


@speed_item("04", 1, "rms_norm_kernel", argument="rms_norm")
def speed_rms_norm_kernel(fn: Callable):
    """fn (exercise 1's launcher) on 8,192 rows of 4,096 bfloat16 values against the package's kernel:
    each value read once and written once."""
    if not torch.cuda.is_available():
        return needs_gpu("the RMSNorm kernel")
    from miniinfer.kernels.norm_rope import rms_norm as package
    gen = torch.Generator("cuda").manual_seed(0)
    x, w = (torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16) for shape in ((8192, 4096), (4096,)))
    return kernel_ratio("rms_norm on 8,192 x 4,096 bfloat16", fn, package, (x, w, 1e-5), 2 * x.numel() * 2)


@speed_item("04", 2, "rope_kernel", argument="apply_rope")
def speed_rope_kernel(fn: Callable):
    """fn (exercise 2's launcher) on 8,192 tokens of 32 query and 8 key heads of 128 bfloat16 values
    against the package's kernel (one launch for q and k): each value read and written once."""
    if not torch.cuda.is_available():
        return needs_gpu("the RoPE kernel")
    from miniinfer.kernels.norm_rope import apply_rope as package
    gen = torch.Generator("cuda").manual_seed(0)
    T, D = 8192, 128
    q, k = (torch.randn(T, h, D, generator=gen, device="cuda").to(torch.bfloat16) for h in (32, 8))
    cos, sin = rope_cos_sin(torch.arange(T, device="cuda"), rope_inv_freq(D, 500000.0))
    nbytes = 2 * (q.numel() + k.numel()) * 2 + 2 * cos.numel() * 4
    return kernel_ratio("apply_rope on 8,192 tokens x (32 + 8) heads x 128 bfloat16", fn, package,
                        (q, k, cos, sin), nbytes)
