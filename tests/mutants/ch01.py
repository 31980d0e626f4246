"""Wrong answers to problem set 01 that its checks must reject: each named (or documented) for its mistake."""

import math

import torch

import miniinfer as mi
from miniinfer.course import checks as testing
from miniinfer.model.transformer import apply_rope, causal_attention


def attention_softmax_without_max(q, k, v, scale):
    """Right for small scores; exp overflows to inf (and inf / inf is NaN) once scores pass ~88."""
    T, group = q.shape[1], q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    e = torch.einsum("bthd,bshd->bhts", q, k).mul(scale).exp() * torch.ones(T, T).tril()
    return torch.einsum("bhts,bshd->bthd", e / e.sum(-1, keepdim=True), v)


def rms_norm_without_upcast(x, weight, eps):
    """Squares in x's dtype, not float32: float16 values past ~256 overflow x**2 to inf and the row comes out 0."""
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm_eps_outside_the_root(x, weight, eps):
    """Adds eps after the square root, not under it: off for rows whose mean square is near eps (values ~1e-3)."""
    xf = x.float()
    return weight * (xf / (xf.pow(2).mean(-1, keepdim=True).sqrt() + eps)).to(x.dtype)


def rms_norm_over_the_whole_tensor(x, weight, eps):
    """One mean square over the whole tensor, not one per row: right only when there is a single row."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean() + eps)).to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_interleaved(q, k, cos, sin):
    """Rotates adjacent pairs (0, 1), (2, 3), ... (GPT-J style), not dimension i with i + D/2 (rotate-half)."""
    def rot(x):
        x1, x2 = x[..., 0::2], x[..., 1::2]
        c, s = cos[..., None, :], sin[..., None, :]
        return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), -1).flatten(-2).to(x.dtype)
    return rot(q), rot(k)


def rope_turning_backwards(q, k, cos, sin):
    """Subtracts rotate_half(x) * sin instead of adding it: rotates every pair by minus its angle."""
    c, s = torch.cat((cos, cos), -1)[..., None, :], torch.cat((sin, sin), -1)[..., None, :]
    return ((q * c - rotate_half(q) * s).to(q.dtype), (k * c - rotate_half(k) * s).to(k.dtype))


def rope_on_queries_only(q, k, cos, sin):
    """Rotates the queries but returns the keys unrotated."""
    return apply_rope(q, k, cos, sin)[0], k


def attention_without_mask(q, k, v, scale):
    """No causal mask: each token also attends to the tokens after it; only the last one is right."""
    group = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(group, 2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def attention_mask_off_by_one(q, k, v, scale):
    """Masks the diagonal too: no token attends to itself, and the first one, left with no key, is NaN."""
    group, T = q.shape[2] // k.shape[2], q.shape[1]
    k, v = (t.repeat_interleave(group, 2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    future = torch.ones(T, T, dtype=torch.bool).triu(0)  # hides each token from itself too
    return torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(future, -math.inf).softmax(-1), v)


def attention_heads_tiled_not_interleaved(q, k, v, scale):
    """Repeats the KV heads as a block: query head h reads KV head h % Hk instead of h // group."""
    group = q.shape[2] // k.shape[2]
    k, v = (t.repeat(1, 1, group, 1) for t in (k, v))  # query head h reads kv head h % Hk, not h // group
    return causal_attention(q, k, v, scale)


def attention_without_scale(q, k, v, scale):
    """Leaves the scores unscaled (scale 1, not 1/sqrt(D)): the softmax comes out too sharp."""
    return causal_attention(q, k, v, 1.0)


def top_p_excluding_the_crossing_token(logits, top_p):
    """Drops the token that takes the total past top_p: the kept mass falls short, all -inf if top_p < p_max."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    drop = sorted_logits.softmax(-1).cumsum(-1) > top_p
    return logits.masked_fill(drop.scatter(-1, order, drop), -math.inf)


def top_p_without_sorting(logits, top_p):
    """Sums probabilities in vocabulary order, not from the likeliest down: keeps the lowest ids, not the nucleus."""
    probs = logits.softmax(-1)
    return logits.masked_fill(probs.cumsum(-1) - probs >= top_p, -math.inf)


def top_p_zeroing_instead_of_minus_inf(logits, top_p):
    """Sets dropped logits to 0, not -inf: the dropped tokens can still be sampled."""
    kept = mi.core.sampling_params.top_p_filter(logits, top_p)
    return kept.masked_fill(kept.isinf(), 0.0)


# (the check, the wrong answer)
MUTANTS = [
    (testing.check_rms_norm, rms_norm_without_upcast),
    (testing.check_rms_norm, rms_norm_eps_outside_the_root),
    (testing.check_rms_norm, rms_norm_over_the_whole_tensor),
    (testing.check_rope, rope_interleaved),
    (testing.check_rope, rope_turning_backwards),
    (testing.check_rope, rope_on_queries_only),
    (testing.check_attention, attention_without_mask),
    (testing.check_attention, attention_mask_off_by_one),
    (testing.check_attention, attention_heads_tiled_not_interleaved),
    (testing.check_attention, attention_without_scale),
    (testing.check_attention, attention_softmax_without_max),
    (testing.check_top_p, top_p_excluding_the_crossing_token),
    (testing.check_top_p, top_p_without_sorting),
    (testing.check_top_p, top_p_zeroing_instead_of_minus_inf),
]
