"""The checks of problem set 12 (sampling and structure): each answer against the reference, on random inputs.

Hand-written module (chapter 12)."""

from __future__ import annotations

from typing import Callable

import torch

from miniinfer.course.checks.harness import check, exercise, randint


def _histories(gen, case):
    """Random logits [B, V], each row's output-token counts and prompt tokens (as a mask)."""
    B, V = randint(gen, 1, 6), randint(gen, 5, 40)
    logits = torch.randn(B, V, generator=gen) * 3
    counts = torch.randint(0, 4, (B, V), generator=gen, dtype=torch.int32) * (torch.rand(B, V, generator=gen) < 0.3)
    in_prompt = torch.rand(B, V, generator=gen) < 0.2
    return logits, counts.int(), in_prompt


@exercise("12", 1, "openai_penalties")
def check_openai_penalties(fn: Callable) -> None:
    """fn(logits [B, V], counts [B, V] int32, presence [B], frequency [B]) -> logits after OpenAI's
    presence and frequency penalties, each row with its own: l - frequency x count - presence x (count > 0)."""
    from miniinfer.worker.logits_processors import penalize

    def inputs(gen, case):
        logits, counts, in_prompt = _histories(gen, case)
        B = logits.shape[0]
        return logits, counts, torch.rand(B, generator=gen) * 4 - 2, torch.rand(B, generator=gen) * 4 - 2

    def ref(logits, counts, presence, frequency):
        none = torch.zeros_like(counts, dtype=torch.bool)
        return penalize(logits, counts, none, presence, frequency, torch.ones_like(presence))
    check("openai_penalties", fn, ref, inputs, cases=12)


@exercise("12", 2, "repetition_penalty")
def check_repetition_penalty(fn: Callable) -> None:
    """fn(logits [B, V], counts [B, V], in_prompt [B, V] bool, penalty [B]) -> logits after transformers'
    repetition penalty: a token seen in the prompt or the output has its logit divided by the row's
    penalty if positive, multiplied if not."""
    from miniinfer.worker.logits_processors import penalize

    def inputs(gen, case):
        logits, counts, in_prompt = _histories(gen, case)
        return logits, counts, in_prompt, torch.rand(logits.shape[0], generator=gen) * 1.8 + 0.1

    def ref(logits, counts, in_prompt, penalty):
        zero = torch.zeros_like(penalty)
        return penalize(logits, counts, in_prompt, zero, zero, penalty)
    check("repetition_penalty", fn, ref, inputs, cases=12)


@exercise("12", 3, "min_p_filter")
def check_min_p_filter(fn: Callable) -> None:
    """fn(logits [B, V], min_p [B], temperature [B]) -> logits with -inf for each token whose probability
    at the row's temperature is below min_p times the row's top token's (the others unchanged)."""
    from miniinfer.worker.logits_processors import min_p_mask

    def inputs(gen, case):
        logits = torch.randn(randint(gen, 1, 6), randint(gen, 5, 40), generator=gen) * 3
        B = logits.shape[0]
        return logits, torch.rand(B, generator=gen), torch.rand(B, generator=gen) * 2 + 0.1
    check("min_p_filter", fn, min_p_mask, inputs, cases=12)


@exercise("12", 4, "top_logprobs")
def check_top_logprobs(fn: Callable) -> None:
    """fn(logits [R, V], tokens [R], k) -> (the token's log-probability [R] float32, its rank [R] int64
    (1: the most likely), the k best log-probabilities [R, k] float32 and their token ids [R, k] int64).
    From case 9 on, each row's token shares its logit with another token below the k best: its rank
    counts only the tokens strictly more likely than it (logits [1, 1, 0, -1], token 1: rank 1)."""
    from miniinfer.worker.logits_processors import top_logprobs

    def inputs(gen, case):
        logits = torch.randn(randint(gen, 1, 6), randint(gen, 8, 40), generator=gen) * 3
        tokens = torch.randint(0, logits.shape[1], (logits.shape[0],), generator=gen)
        k = randint(gen, 1, 5)
        if case >= 8:  # ties, placed where the k best stay unambiguous
            for row, order in enumerate(logits.argsort(-1, descending=True)):
                pick = torch.randperm(len(order) - k, generator=gen)[:2] + k
                twin, token = order[pick[0]], order[pick[1]]
                logits[row, twin], tokens[row] = logits[row, token], token
        return logits, tokens, k
    check("top_logprobs", fn, top_logprobs, inputs, cases=12)


@exercise("12", 5, "apply_bitmask")
def check_apply_bitmask(fn: Callable) -> None:
    """fn(logits [R, V], bitmask [R, ceil(V / 32)] int32) -> logits with -inf where a token's bit is 0."""
    from miniinfer.worker.logits_processors import apply_bitmask

    def inputs(gen, case):
        V = (33, 64, 95)[case] if case < 3 else randint(gen, 1, 200)  # a last word part used; all 32 bits
        R = randint(gen, 1, 5)
        bitmask = torch.randint(-2 ** 31, 2 ** 31, (R, -(-V // 32)), generator=gen, dtype=torch.int64).to(torch.int32)
        return torch.randn(R, V, generator=gen), bitmask
    check("apply_bitmask", fn, apply_bitmask, inputs, cases=12)
