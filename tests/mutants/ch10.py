"""Wrong answers to problem set 10 that its checks must reject: each named (or documented) for its mistake."""


import torch
import triton
import triton.language as tl

from miniinfer.course import checks as testing
from miniinfer.layers.quantization import QuantKernels


def fake_quantize_floor(w, bits, symmetric):  # rounds down (toward -inf), not to nearest: up to a step off
    return testing._fake_quantize_ref(w, bits, symmetric, torch.floor)


def fake_quantize_always_symmetric(w, bits, symmetric):
    """Ignores symmetric=False: always scales by the largest magnitude, never by the range with a zero point."""
    return testing._fake_quantize_ref(w, bits, True)


def pack_without_offset(codes):
    """Stores each code's low 4 bits (two's complement) instead of code + 8: every nibble's top bit is flipped."""
    shifts = torch.arange(8, dtype=torch.int32) * 4
    return ((codes.to(torch.int32) & 15).reshape(codes.shape[0], -1, 8) << shifts).sum(-1, dtype=torch.int32)


def pack_first_code_highest(codes):
    """Puts the first code in the word's highest 4 bits, not the lowest."""
    shifts = 28 - torch.arange(8, dtype=torch.int32) * 4
    return ((codes.to(torch.int32) + 8).reshape(codes.shape[0], -1, 8) << shifts).sum(-1, dtype=torch.int32)


def scales_per_row(w, group_size):
    """One scale per row (its largest magnitude / 7), repeated for each group, not one per group."""
    return (w.abs().amax(1, keepdim=True) / 7).clamp(min=1e-10).expand(-1, w.shape[1] // group_size)


def scales_over_8(w, group_size):
    """Divides the group's largest magnitude by 8, not 7: a largest positive value needs code 8, past int4's 7."""
    return (w.reshape(w.shape[0], -1, group_size).abs().amax(-1) / 8).clamp(min=1e-10)


def gptq_without_spreading(W, U, bits, group_size):  # each column rounded alone: round to nearest's codes
    return _gptq(W, U, bits, group_size, spread=False)


def gptq_error_not_divided(W, U, bits, group_size):
    """Spreads the rounding error itself, w - q * s, not divided by U[k, k]: the later columns move too little."""
    return _gptq(W, U, bits, group_size, divide=False)


def gptq_scales_from_the_start(W, U, bits, group_size):
    """Takes every group's scales from W as given, before the earlier columns' errors moved it."""
    return _gptq(W, U, bits, group_size, late_scales=False)


def _gptq(W, U, bits, group_size, spread=True, divide=True, late_scales=True):
    W, first = W.clone(), W.clone()
    N, K = W.shape
    top = 2 ** (bits - 1) - 1
    codes, scales = torch.zeros(N, K, dtype=torch.int8), torch.zeros(N, K // group_size)
    for k in range(K):
        g = k // group_size
        if k % group_size == 0:
            scales[:, g] = ((W if late_scales else first)[:, k:k + group_size].abs().amax(1) / top).clamp(min=1e-10)
        q = torch.round(W[:, k] / scales[:, g]).clamp(-top - 1, top)
        codes[:, k] = q.to(torch.int8)
        err = (W[:, k] - q * scales[:, g]) / (U[k, k] if divide else 1)
        if spread:
            W[:, k + 1:] -= err[:, None] * U[k, k + 1:]
    return codes, scales


@triton.jit
def _gemv(x_ptr, w_ptr, s_ptr, out_ptr, N, K, K_CHUNK, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
          WORDS: tl.constexpr, OFFSET: tl.constexpr, ONE_SCALE: tl.constexpr, TOP_FIRST: tl.constexpr):
    """An int4 GEMV with each mistake behind a switch (all off: a right answer, for the last part's tests)."""
    row, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(pid_k * K_CHUNK, (pid_k + 1) * K_CHUNK, WORDS * 8):
        wk = k0 // 8 + tl.arange(0, WORDS)
        words = tl.load(w_ptr + wk[:, None] * N + rn[None, :], mask=rn[None, :] < N, other=0)
        part = tl.zeros([WORDS, BLOCK_N], tl.float32)
        for j in tl.static_range(8):
            codes = ((words >> (4 * (7 - j) if TOP_FIRST else 4 * j)) & 15) - OFFSET
            part += tl.load(x_ptr + row * K + wk * 8 + j)[:, None] * codes.to(tl.float32)
        scale = tl.load(s_ptr + (0 if ONE_SCALE else k0 // GROUP) * N + rn, mask=rn < N, other=0.0)
        acc += tl.sum(part, 0) * scale
    tl.atomic_add(out_ptr + row * N + rn, acc, mask=rn < N)


def gemv(x, packed, scale, offset=8, one_scale=False, top_first=False):
    """_gemv launched as the problem set's wrapper launches the student's kernel on a CPU (K in one piece)."""
    M, K = x.shape
    N, group = packed.shape[1], K // scale.shape[0]
    block_n = 128 if x.is_cuda else triton.next_power_of_2(N)
    out = torch.zeros(M, N, device=x.device, dtype=torch.float32)
    _gemv[(M, triton.cdiv(N, block_n), 1)](x.contiguous(), packed, scale, out, N, K, K, GROUP=group, BLOCK_N=block_n,
                                           WORDS=min(16, group // 8), OFFSET=offset, ONE_SCALE=one_scale,
                                           TOP_FIRST=top_first)
    return out


def gemv_without_offset(x, packed, scale):  # reads the nibbles as 0..15: every weight 8 scales too large
    return gemv(x, packed, scale, offset=0)


def gemv_first_group_scale_only(x, packed, scale):
    """Multiplies every tile by the first group's scales: right only with one group per row."""
    return gemv(x, packed, scale, one_scale=True)


def gemv_codes_top_first(x, packed, scale):  # the first input's code read from the word's top nibble
    return gemv(x, packed, scale, top_first=True)


class KernelsOn(QuantKernels):
    """The problem set's YourKernels, on a GEMV given (a mutant's, or the right `gemv`)."""

    def __init__(self, launch=gemv):
        self.launch = launch

    def int_linear(self, x, packed, scale, bits, bias):
        rows = x.reshape(-1, x.shape[-1])
        if bits != 4 or rows.shape[0] > 4:
            return super().int_linear(x, packed, scale, bits, bias)
        out = self.launch(rows, packed, scale).to(x.dtype)
        return (out if bias is None else out + bias).view(*x.shape[:-1], -1)


def fp8_with_fnuz_range(x):  # 240 is the largest e4m3fnuz value, another FP8 flavour
    scale = x.abs().amax(1, keepdim=True).float().clamp(min=1e-12) / 240
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


def fp8_one_scale_for_all(x):
    """One scale for the whole tensor, not one per row: rows smaller than the largest lose precision."""
    scale = x.abs().amax().float().clamp(min=1e-12) / 448 * torch.ones(x.shape[0], 1)
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


def fake_quantize_asymmetric_without_zero_point(w, bits, symmetric):  # the range's width, but no offset
    levels = 2 ** bits - 1
    scale = ((w.amax(1, keepdim=True) - w.amin(1, keepdim=True)) / levels).clamp(min=1e-10)
    return torch.round(w / scale).clamp(-(levels + 1) // 2, levels // 2) * scale


def pack_codes_unmasked(codes):  # a negative code's sign bits spill into the codes above it
    shifts = torch.arange(8, dtype=torch.int32) * 4
    return (codes.to(torch.int32).reshape(codes.shape[0], -1, 8) << shifts).sum(-1, dtype=torch.int32)


def scales_of_the_signed_max(w, group_size):  # the largest value, not the largest magnitude
    return (w.reshape(w.shape[0], -1, group_size).amax(-1) / 7).clamp(min=1e-10)


def fp8_scale_per_column(x):  # per input channel: a token's activations need one scale per row
    scale = x.abs().amax(0, keepdim=True).float().clamp(min=1e-12) / 448
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


# (the check, the wrong answer)
MUTANTS = [
    (testing.check_fake_quantize, fake_quantize_floor),
    (testing.check_fake_quantize, fake_quantize_always_symmetric),
    (testing.check_pack_int4, pack_without_offset),
    (testing.check_pack_int4, pack_first_code_highest),
    (testing.check_group_scales, scales_per_row),
    (testing.check_group_scales, scales_over_8),
    (testing.check_gptq_columns, gptq_without_spreading),
    (testing.check_gptq_columns, gptq_error_not_divided),
    (testing.check_gptq_columns, gptq_scales_from_the_start),
    (testing.check_int4_gemv, gemv_without_offset),
    (testing.check_int4_gemv, gemv_first_group_scale_only),
    (testing.check_fp8_quantize, fp8_with_fnuz_range),
    (testing.check_fp8_quantize, fp8_one_scale_for_all),
    (testing.check_fake_quantize, fake_quantize_asymmetric_without_zero_point),
    (testing.check_pack_int4, pack_codes_unmasked),
    (testing.check_group_scales, scales_of_the_signed_max),
    (testing.check_int4_gemv, gemv_codes_top_first),
    (testing.check_fp8_quantize, fp8_scale_per_column),
]
