"""The checks of problem set 02 (static kv cache): each answer against the reference, on random inputs.

Hand-written module (chapter 02)."""

from __future__ import annotations

from typing import Callable

import torch

from miniinfer.course.checks.harness import check, check_tokens, exercise, named, randint, show, your_answers
from miniinfer.course.static_cache import left_pad, static_batch_waste, write_kv
from miniinfer.model.transformer import causal_attention


@exercise("02", 1, "write_kv")
def check_write_kv(fn: Callable) -> None:
    """fn(k_cache, v_cache, k, v, start) -> (k_cache, v_cache) with k, v written at slots start..."""
    def inputs(gen, case):
        B, L, Hk, D = randint(gen, 1, 3), randint(gen, 2, 40), randint(gen, 1, 3), randint(gen, 1, 16)
        T = randint(gen, 1, L)
        start = randint(gen, 1 if case == 0 else 0, L - T)
        caches = [torch.randn(B, L, Hk, D, generator=gen) for _ in range(2)]
        return (*caches, torch.randn(B, T, Hk, D, generator=gen), torch.randn(B, T, Hk, D, generator=gen), start)
    check("write_kv", fn, write_kv, inputs)


def _cached_attention(q, k_cache, v_cache, length, scale):
    return causal_attention(q, k_cache[:, :length], v_cache[:, :length], scale, q_start=length - 1)


@exercise("02", 2, "cached_attention")
def check_cached_attention(fn: Callable) -> None:
    """fn(q [B, 1, Hq, D], k_cache, v_cache [B, max_len, Hk, D], length, scale) -> [B, 1, Hq, D]:
    the newest token (in slot length-1) attends over slots 0..length-1 only."""
    def inputs(gen, case):
        B, L, Hk, D = randint(gen, 1, 3), randint(gen, 2, 50), randint(gen, 1, 3), randint(gen, 2, 33)
        Hq = Hk * randint(gen, 2 if case == 0 else 1, 4)
        k_cache, v_cache = (torch.randn(B, L, Hk, D, generator=gen) for _ in range(2))
        length = randint(gen, 1, L - 1) if case < 4 else randint(gen, 1, L)  # stale slots after length
        return torch.randn(B, 1, Hq, D, generator=gen), k_cache, v_cache, length, D ** -0.5
    check("cached attention", fn, _cached_attention, inputs)


@exercise("02", 3, "left_pad")
def check_left_pad(fn: Callable) -> None:
    """fn(prompts: list[list[int]], pad_id) -> ids [B, L], real [B, L] bool, positions [B, L]."""
    def inputs(gen, case):
        prompts = [torch.randint(1, 1000, (randint(gen, 1, 12),), generator=gen).tolist()
                   for _ in range(randint(gen, 2 if case == 0 else 1, 5))]
        return prompts, randint(gen, 0, 3)
    check("left_pad", fn, left_pad, inputs)


@exercise("02", 4, "static_batch_waste")
def check_static_batch_waste(fn: Callable) -> None:
    """fn(output_lens: list[int], batch_size) -> fraction of decode slots spent on finished rows."""
    def inputs(gen, case):
        lens = torch.randint(1, 300, (randint(gen, 1, 40),), generator=gen).tolist()
        return lens, randint(gen, 1, 12)
    as_tensor = lambda f: lambda *a: torch.tensor(float(f(*a)), dtype=torch.float64)  # noqa: E731
    check("static_batch_waste", as_tensor(fn), as_tensor(static_batch_waste), inputs)


PROMPTS = ["def fibonacci(n):\n", "class Stack:\n"]


@exercise("02", 5, "your_generate")
def check_cached_decoding(generate: Callable) -> None:
    """The last part: generate(model, prompt_ids, params) (the notebook's one-token-a-forward loop over
    the student's cache write and cached attention) gives `generate_cached`'s greedy tokens."""
    __tracebackhide__ = True
    import miniinfer as mi
    model, tok = mi.load_model(), mi.load_tokenizer()
    prompts = [tok(text).input_ids for text in PROMPTS]
    params = mi.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [mi.generate_cached(model, p, params) for p in prompts]
    with your_answers("02"), torch.no_grad():
        got = [list(generate(model, p, params)) for p in prompts]
    show(tok, [p + g for p, g in zip(prompts, got)])
    check_tokens(named(PROMPTS, "greedy"),
                 expected, got)
    print(f"passed: the greedy tokens of the package's static cache on {len(PROMPTS)} prompts")
