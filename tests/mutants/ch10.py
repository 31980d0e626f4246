"""Wrong answers to problem set 10 that its checks must reject: each named (or documented) for its mistake."""


import torch

from miniinfer.course import checks as testing


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


def dequant_without_offset(x, packed, scale):
    """Reads the nibbles as 0..15 without subtracting 8: every weight is 8 scales too large."""
    codes = (packed[..., None] >> (torch.arange(8, dtype=torch.int32) * 4)) & 15
    N, G = scale.shape
    return x @ (codes.reshape(N, G, -1) * scale[..., None]).reshape(N, -1).T


def dequant_first_scale_only(x, packed, scale):
    """Applies each row's first group scale to all its groups: right only with one group per row."""
    codes = ((packed[..., None] >> (torch.arange(8, dtype=torch.int32) * 4)) & 15) - 8
    return x @ (codes.reshape(packed.shape[0], -1) * scale[:, :1]).T


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


def dequant_codes_in_reverse(x, packed, scale):  # the first code read from the word's top nibble
    codes = ((packed[..., None] >> (28 - torch.arange(8, dtype=torch.int32) * 4)) & 15) - 8
    N, G = scale.shape
    return x @ (codes.reshape(N, G, -1) * scale[..., None]).reshape(N, -1).T


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
    (testing.check_dequant_matmul, dequant_without_offset),
    (testing.check_dequant_matmul, dequant_first_scale_only),
    (testing.check_fp8_quantize, fp8_with_fnuz_range),
    (testing.check_fp8_quantize, fp8_one_scale_for_all),
    (testing.check_fake_quantize, fake_quantize_asymmetric_without_zero_point),
    (testing.check_pack_int4, pack_codes_unmasked),
    (testing.check_group_scales, scales_of_the_signed_max),
    (testing.check_dequant_matmul, dequant_codes_in_reverse),
    (testing.check_fp8_quantize, fp8_scale_per_column),
]
