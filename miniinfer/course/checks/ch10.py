"""The checks of problem set 10 (quantization): each answer against the reference, on random inputs.

Hand-written module (chapter 10)."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from miniinfer.course.checks.harness import check, check_tokens, device, exercise, randint, your_answers
from miniinfer.course.checks.speed import kernel_ratio, needs_gpu, speed_item


def _fake_quantize_ref(w, bits, symmetric, rounding=torch.round):
    """rounding: to nearest (a mutant of the tests passes another)."""
    if symmetric:
        top = 2 ** (bits - 1) - 1
        scale = (w.abs().amax(1, keepdim=True) / top).clamp(min=1e-10)
        return rounding(w / scale).clamp(-top - 1, top) * scale
    low, high = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    scale = ((high - low) / (2 ** bits - 1)).clamp(min=1e-10)
    zero = torch.round(-low / scale)
    return ((rounding(w / scale) + zero).clamp(0, 2 ** bits - 1) - zero) * scale


def _weights(gen, case, groups_of: int = 1):
    """A weight [N, K] of odd rows, with rows of very different sizes (and an all-zero row)."""
    N, K = randint(gen, 1, 9), groups_of * randint(gen, 1, 6) * (8 if groups_of == 1 else 1)
    w = torch.randn(N, K, generator=gen) * torch.rand(N, 1, generator=gen) * 4
    if case == 0:
        w[0] = 0.0
    return w


@exercise("10", 1, "fake_quantize")
def check_fake_quantize(fn: Callable) -> None:
    """fn(w [N, K], bits, symmetric) -> w rounded to `bits`-bit codes per row and back: symmetric with
    scale max|w| / (2^(bits-1) - 1), or asymmetric with scale (max - min) / (2^bits - 1) and a zero point."""
    def inputs(gen, case):
        return _weights(gen, case), (8, 4, 3)[case % 3], bool(case % 2)
    check("fake_quantize", fn, _fake_quantize_ref, inputs, cases=24)


@exercise("10", 2, "pack_int4")
def check_pack_int4(fn: Callable) -> None:
    """fn(codes [N, K] int8 in [-8, 7]) -> int32 [N, K/8]: eight codes to a word, the first in the
    lowest 4 bits, each plus 8 (compressed-tensors' pack-quantized layout)."""
    from miniinfer.layers.quantization import pack

    def inputs(gen, case):
        shape = (randint(gen, 1, 6), 8 * randint(gen, 1, 5))
        return (torch.randint(-8, 8, shape, generator=gen, dtype=torch.int8),)
    check("pack_int4", fn, lambda codes: pack(codes, 4), inputs, cases=20, rtol=0, atol=0)


def _group_scales_ref(w, group_size):
    groups = w.reshape(w.shape[0], -1, group_size)
    return (groups.abs().amax(-1) / 7).clamp(min=1e-10)


@exercise("10", 3, "group_scales")
def check_group_scales(fn: Callable) -> None:
    """fn(w [N, K], group_size) -> int4 scales [N, K / group_size]: each group's max|w| / 7."""
    def inputs(gen, case):
        g = (8, 16, 32)[case % 3]
        return _weights(gen, case, g), g
    check("group_scales", fn, _group_scales_ref, inputs, cases=18)


def _hessian(gen: torch.Generator, K: int, dead: bool) -> torch.Tensor:
    """sum of x^T x over correlated inputs x [T, K] (one input always zero when dead)."""
    x = torch.randn(4 * K, K, generator=gen) @ (torch.randn(K, K, generator=gen) * 0.5 + torch.eye(K))
    if dead:
        x[:, randint(gen, 0, K - 1)] = 0.0
    return x.T @ x


@exercise("10", 4, "gptq_columns")
def check_gptq_columns(fn: Callable) -> None:
    """fn(W [N, K] float32, U [K, K], bits, group_size) -> (codes [N, K] int8, scales [N, K/group]
    float32): GPTQ's loop over the columns, one at a time (the package's gptq_columns with one block)."""
    from miniinfer.layers.quantization import gptq_columns, gptq_inputs

    def inputs(gen, case):
        g = (8, 16, 32, 5)[case % 4]
        w = _weights(gen, case, g)
        W, U = gptq_inputs(w, _hessian(gen, w.shape[1], case % 3 == 1))
        return W, U, (4, 8, 3)[case % 3], g
    check("gptq_columns", fn, lambda W, U, bits, g: gptq_columns(W, U, bits, g, block=W.shape[1]), inputs,
          cases=24, rtol=1e-5, atol=0)


def int4_inputs(gen: torch.Generator, case: int) -> tuple:
    """x [M, K] and an int4 weight [N, K] in groups (8 to 128 inputs), stored as the engine stores it:
    packed codes [K/8, N] and scales [K/group, N]."""
    from miniinfer.layers.quantization import pack, quantize_int
    g = (8, 16, 32, 64, 128)[case % 5]
    N, M = randint(gen, 1, 70), randint(gen, 1, 4)
    w = torch.randn(N, g * randint(gen, 1, 3), generator=gen) * torch.rand(N, 1, generator=gen) * 4
    codes, scale = quantize_int(w, 4, g)
    return (torch.randn(M, w.shape[1], generator=gen) * (100 if case == 3 else 1), pack(codes, 4).t().contiguous(),
            scale.t().contiguous())


def _int4_matmul_ref(x, packed, scale):
    from miniinfer.layers.quantization import dequantize
    return x @ dequantize(packed.t(), scale.t(), 4).T


@exercise("10", 5, "int4_gemv_kernel", argument="int4_gemv")
def check_int4_gemv(fn: Callable) -> None:
    """fn(x [M, K], packed int32 [K/8, N], scale [K/group, N]) launching the kernel -> x @ W^T [M, N]
    float32, W the int4 weight the codes and their group scales stand for; on the GPU when there is one."""
    check("int4 GEMV kernel", fn, _int4_matmul_ref, int4_inputs, cases=10, rtol=1e-4, atol=1e-4, device=device())


@speed_item("10", 5, "int4_gemv_kernel", argument="int4_gemv")
def speed_int4_gemv(fn: Callable):
    """fn (exercise 5's launcher) at batch 1 on an int4 weight of 14,336 x 4,096 in groups of 128 (the
    Llama-3.1-8B MLP's up projection), x in bfloat16, against the package's GEMV: the weight's codes
    and scales read once."""
    if not torch.cuda.is_available():
        return needs_gpu("the int4 GEMV kernel")
    from miniinfer.kernels.quant import int_matmul
    from miniinfer.layers.quantization import pack, quantize_int
    gen = torch.Generator("cuda").manual_seed(0)
    N, K = 14336, 4096
    codes, scale = quantize_int(torch.randn(N, K, generator=gen, device="cuda"), 4, 128)
    packed, scale = pack(codes, 4).t().contiguous(), scale.t().contiguous().to(torch.bfloat16)
    x = torch.randn(1, K, generator=gen, device="cuda").to(torch.bfloat16)
    nbytes = packed.numel() * 4 + scale.numel() * 2 + x.numel() * 2 + N * 2
    return kernel_ratio("int4_gemv at batch 1 on 14,336 x 4,096", fn, lambda x, p, s: int_matmul(x, p, s, 4),
                        (x, packed, scale), nbytes)


@exercise("10", 6, "fp8_quantize")
def check_fp8_quantize(fn: Callable) -> None:
    """fn(x [M, K]) -> (values [M, K] float8_e4m3fn, scales [M, 1] float32): each row divided by its
    max|x| / 448 (e4m3's largest value), so that the row's largest value lands on 448."""
    from miniinfer.layers.quantization import quantize_fp8

    def inputs(gen, case):
        return (_weights(gen, case) * 100,)

    def as_float(f):
        def run(x):
            values, scale = f(x)
            assert values.dtype == torch.float8_e4m3fn, f"values must be float8_e4m3fn, got {values.dtype}"
            return values.float(), scale
        return run
    # rtol: a value on the edge between two e4m3 steps may round either way (one step is 1/16 to 1/8)
    check("fp8_quantize", as_float(fn), as_float(quantize_fp8), inputs, cases=16, rtol=0.13, atol=1e-3)


# GPTQ's calibration text for the last part: code like the course model's training data (a little).
CALIBRATION = ['import os\nimport sys\n\n\ndef main(argv):\n    """Print each file of argv with its size."""\n'
               '    for name in argv[1:]:\n        print(name, os.path.getsize(name))\n    return 0\n',
               'class Queue:\n    def __init__(self):\n        self.items = []\n\n    def put(self, item):\n'
               '        self.items.append(item)\n\n    def get(self):\n        return self.items.pop(0)\n',
               'def merge(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n'
               '        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n        else:\n'
               '            out.append(b[j])\n            j += 1\n    return out + a[i:] + b[j:]\n']
# One prompt, ten tokens: a decode step's 24 matmuls take 1.2 s in Triton's interpreter on two cores.
QUANT_PROMPTS = ['def is_prime(n):\n    """Return True if n is a prime number."""\n']
QUANT_TOKENS = 10


BLOCK = 128  # columns of GPTQ's loop at a time in the last part (the package's gptq's default)


def blockwise(columns: Callable, W: torch.Tensor, U: torch.Tensor, bits: int, group: int):
    """GPTQ as the package runs it, BLOCK columns at a time, with columns(W_b, U_b, bits, group) the
    loop over one block's columns: the block's rounding errors E then reach the later columns in one
    matmul. E is recovered from the block's codes: W_b - codes * scales = E U_b (U_b upper triangular)."""
    W = W.clone()
    parts = []
    for b0 in range(0, W.shape[1], BLOCK):
        b1 = min(b0 + BLOCK, W.shape[1])
        codes, scales = columns(W[:, b0:b1], U[b0:b1, b0:b1], bits, group)
        rounded = codes.float() * scales.float().repeat_interleave(group, 1)
        E = torch.linalg.solve_triangular(U[b0:b1, b0:b1], W[:, b0:b1] - rounded, upper=True, left=False)
        W[:, b1:] -= E @ U[b0:b1, b1:]
        parts.append((codes, scales))
    return torch.cat([c for c, _ in parts], 1), torch.cat([s for _, s in parts], 1)


def gptq_model(columns: Callable, kernels=None):
    """The course model with every projection quantized to int4 in groups of 128 by GPTQ (`blockwise`
    with columns): Hessians from the float model's forwards over CALIBRATION; its matmuls by kernels
    (None: the package's). On the GPU when there is one."""
    import miniinfer as mi
    from miniinfer.layers.quantization import IntLinear, gptq_inputs, input_hessians, quantized_layers
    model, tok = mi.load_model(device=device()), mi.load_tokenizer()
    batches = [torch.tensor([tok(text).input_ids], device=device()) for text in CALIBRATION]
    hessians = input_hessians(model, batches)
    for name in quantized_layers(model):
        layer = model.get_submodule(name)
        # GPTQ on the CPU, where the exercise runs it; the codes go to the model's device.
        W, U = gptq_inputs(layer.weight.detach().cpu(), hessians[name].cpu())
        codes, scales = blockwise(columns, W, U, 4, 128)
        model.set_submodule(name, IntLinear.from_codes(codes.to(device()), scales.to(device()), 4, layer.bias, kernels))
    return model


def _serve(model) -> tuple[list[list[int]], Any]:
    """QUANT_PROMPTS served greedily on model: the tokens, and the engine (for its blocks)."""
    import miniinfer as mi
    engine = mi.LLMEngine(mi.EngineConfig(num_blocks=64, device=device()), model=model, tokenizer=mi.load_tokenizer())
    greedy = mi.SamplingParams(temperature=0, max_tokens=QUANT_TOKENS)
    return [o.token_ids for o in engine.generate(QUANT_PROMPTS, greedy, use_tqdm=False)], engine


@functools.cache
def _package_tokens() -> list[list[int]]:
    """The last part's expected tokens: the course model quantized by the package's GPTQ loop, served
    on its kernels (once per process)."""
    from miniinfer.layers.quantization import gptq_columns
    return _serve(gptq_model(lambda W, U, bits, group: gptq_columns(W, U, bits, group, block=W.shape[1])))[0]


@exercise("10", 7, "YourKernels", "gptq_columns, YourKernels()")
def check_quantized_engine(columns: Callable, kernels) -> None:
    """The last part: the engine on the course model quantized to int4 by the student's GPTQ loop, its
    decode steps' matmuls on the student's kernel, gives the greedy tokens of the package's GPTQ and
    kernels; every block comes back."""
    __tracebackhide__ = True
    expected = _package_tokens()
    with your_answers("10"):
        got, engine = _serve(gptq_model(columns, kernels))
    check_tokens([f"prompt {i + 1} of {len(QUANT_PROMPTS)} ({p!r}), your int4 model's greedy tokens against the "
                  "package's" for i, p in enumerate(QUANT_PROMPTS)], expected, got)
    bm = engine.block_manager
    if bm.num_free_blocks != bm.num_blocks:
        raise AssertionError(f"{bm.num_blocks - bm.num_free_blocks} blocks were not given back")
    print(f"passed: the course model quantized by your GPTQ, on your kernel, gives the package's "
          f"{QUANT_TOKENS} greedy tokens; every block back")
