"""The checks of problem set 01 (naive decoding): each answer against the reference, on random inputs.

Hand-written module (chapter 01)."""

from __future__ import annotations

from typing import Callable

import torch

from miniinfer.core.sampling_params import top_p_filter
from miniinfer.course.checks.harness import (
    DTYPES,
    check,
    check_tokens,
    exercise,
    named,
    randint,
    rope_inputs,
    show,
    your_answers,
)
from miniinfer.model.transformer import apply_rope, causal_attention, rms_norm


@exercise("01", 1, "rms_norm")
def check_rms_norm(fn: Callable) -> None:
    """fn(x, weight, eps) -> RMSNorm of x over its last dimension, statistics in float32, in x's
    dtype (float32, float16 and bfloat16; float16 values large enough that x**2 overflows it, and
    float32 values small enough that eps counts)."""
    def inputs(gen, case):
        dtype = DTYPES[case % 3]
        shape = [randint(gen, 1, 5) for _ in range(randint(gen, 1, 3))] + [randint(gen, 3, 300)]
        scale = 1000.0 if dtype == torch.float16 and case % 2 else 1e-3 if case == 6 else 3.0  # eps matters
        x = (torch.randn(shape, generator=gen) * scale).to(dtype)
        return x, torch.randn(shape[-1], generator=gen).to(dtype), 1e-5
    check("rms_norm", fn, rms_norm, inputs, cases=9)


@exercise("01", 2, "apply_rope")
def check_rope(fn: Callable) -> None:
    """fn(q [..., T, Hq, D], k [..., T, Hk, D], cos, sin [..., T, D/2]) -> rotated (q, k), rotate-half."""
    check("apply_rope", fn, apply_rope, lambda gen, case: rope_inputs(gen, case, batch=True))


@exercise("01", 3, "causal_attention")
def check_attention(fn: Callable) -> None:
    """fn(q [B, T, Hq, D], k [B, T, Hk, D], v, scale) -> causal GQA attention [B, T, Hq, D]. The last
    two cases have scores in the hundreds, where a softmax that does not subtract its row's maximum
    overflows float32 (exp(89) is inf)."""
    def inputs(gen, case):
        B, T, Hk, D = randint(gen, 1, 3), randint(gen, 2, 33), randint(gen, 1, 3), randint(gen, 2, 40)
        Hq = Hk * randint(gen, 2 if case == 0 else 1, 4)
        q, k, v = (torch.randn(B, T, h, D, generator=gen) for h in (Hq, Hk, Hk))
        return q * (30 if case >= 6 else 1), k * (30 if case >= 6 else 1), v, D ** -0.5
    check("causal_attention", fn, causal_attention, inputs)


@exercise("01", 4, "top_p_filter")
def check_top_p(fn: Callable) -> None:
    """fn(logits [B, V], top_p) -> logits with every token outside the nucleus set to -inf."""
    def inputs(gen, case):
        B, V = randint(gen, 1, 4), randint(gen, 2, 500)
        top_p = float(torch.rand((), generator=gen) * 0.98 + 0.01)
        return torch.randn(B, V, generator=gen) * 2, top_p
    check("top_p_filter", fn, top_p_filter, inputs)


PROMPTS = ["def fibonacci(n):\n", "class Stack:\n"]


@exercise("01", 5, "your_generate")
def check_naive_decoding(generate: Callable) -> None:
    """The last part: generate(model, prompt_ids, params) (the notebook's loop over the four answers)
    gives `generate_naive`'s tokens on two prompts, sampled at temperature 0.8, top_p 0.9 with seeds."""
    __tracebackhide__ = True
    import miniinfer as mi
    tok = mi.load_tokenizer()
    prompts = [tok(text).input_ids for text in PROMPTS]
    params = [mi.SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    package = mi.load_model()
    expected = [mi.generate_naive(package, p, s) for p, s in zip(prompts, params)]
    with your_answers("01"), torch.no_grad():
        got = [list(generate(mi.load_model(), p, s)) for p, s in zip(prompts, params)]
    show(tok, [p + g for p, g in zip(prompts, got)])
    check_tokens([f"{name}, seed {i}" for i, name in enumerate(named(PROMPTS, "temperature 0.8, top_p 0.9"))],
                 expected, got)
    print(f"passed: the tokens of generate_naive on {len(PROMPTS)} prompts, sampled with seeds")
