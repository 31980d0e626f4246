"""Wrong answers to problem set 04 that its checks must reject: each named (or documented) for its mistake."""


import torch

from miniinfer.course import checks as testing
from miniinfer.model.transformer import apply_rope
from mutants.ch01 import rope_interleaved


def norm_kernel_in_input_dtype(x, weight, eps):
    """Squares in x's dtype, not float32: float16 values past ~256 overflow x**2 to inf and the row comes out 0."""
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def norm_kernel_mean_over_the_padded_block(x, weight, eps):
    """Divides the sum of squares by the padded power-of-two block, not the row width: wrong for other widths."""
    xf, block = x.float(), triton_block(x.shape[-1])
    return (weight.float() * xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) / block + eps)).to(x.dtype)


def norm_kernel_without_eps(x, weight, eps):
    """Leaves eps out of the root: off for rows whose mean square is near eps (values ~1e-3), NaN for a zero row."""
    xf = x.float()
    return (weight.float() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True))).to(x.dtype)


def triton_block(n: int) -> int:
    return 1 << (n - 1).bit_length()


def rope_kernel_interleaved(q, k, cos, sin):
    """Rotates adjacent pairs (0, 1), (2, 3), ... (GPT-J style), not dimension i with i + D/2 (rotate-half)."""
    return rope_interleaved(q, k, cos, sin)


def rope_kernel_first_position_only(q, k, cos, sin):
    """Rotates every token by the first token's angles: right only for the first token."""
    return testing._in_float32(apply_rope)(q, k, cos[:1].expand_as(cos), sin[:1].expand_as(sin))


def rope_kernel_on_the_first_kv_heads_of_q(q, k, cos, sin):  # a grid of Hk programs per token
    rq, rk = testing._in_float32(apply_rope)(q, k, cos, sin)
    return torch.cat((rq[:, :k.shape[1]], q[:, k.shape[1]:]), 1), rk


# (the check, the wrong answer)
MUTANTS = [
    (testing.check_rms_norm_kernel, norm_kernel_in_input_dtype),
    (testing.check_rms_norm_kernel, norm_kernel_mean_over_the_padded_block),
    (testing.check_rms_norm_kernel, norm_kernel_without_eps),
    (testing.check_rope_kernel, rope_kernel_interleaved),
    (testing.check_rope_kernel, rope_kernel_first_position_only),
    (testing.check_rope_kernel, rope_kernel_on_the_first_kv_heads_of_q),
]
