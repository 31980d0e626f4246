"""The checks of problem set 10 (quantization): each answer against the reference, on random inputs.

Hand-written module (chapter 10)."""

from __future__ import annotations

from typing import Callable

import torch

from miniinfer.course.checks.harness import check, exercise, randint


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


def _dequant_matmul_ref(x, packed, scale):
    from miniinfer.layers.quantization import dequantize
    return x @ dequantize(packed, scale, 4).T


@exercise("10", 4, "dequant_matmul")
def check_dequant_matmul(fn: Callable) -> None:
    """fn(x [M, K], packed int32 [N, K/8], scale [N, K/group]) -> x @ W^T [M, N], W the int4 weight
    that the packed codes and their group scales stand for."""
    from miniinfer.layers.quantization import pack, quantize_int

    def inputs(gen, case):
        g = (8, 16, 32)[case % 3]
        codes, scale = quantize_int(_weights(gen, case, g), 4, g)
        return torch.randn(randint(gen, 1, 5), codes.shape[1], generator=gen), pack(codes, 4), scale
    check("dequant_matmul", fn, _dequant_matmul_ref, inputs, cases=18)


@exercise("10", 5, "fp8_quantize")
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
