"""Wrong answers to problem set 12 that its checks must reject: each named (or documented) for its mistake."""


import numpy as np
import torch

import miniinfer as mi
from miniinfer.course import checks as testing
from miniinfer.course.checks import ch12 as checks12
from miniinfer.worker.sample import logprobs, processors


def penalize_openai_first(logits, counts, in_prompt, presence, frequency, repetition):  # the order swapped
    logits = logits - counts * frequency[:, None] - (counts > 0) * presence[:, None]
    return processors.penalize(logits, counts, in_prompt, presence * 0, frequency * 0, repetition)


def penalize_swapping_presence_and_frequency(logits, counts, in_prompt, presence, frequency, repetition):
    """Passes presence as frequency and frequency as presence."""
    return processors.penalize(logits, counts, in_prompt, frequency, presence, repetition)


def penalize_always_dividing(logits, counts, in_prompt, presence, frequency, repetition):
    """Divides a seen token's negative logit by the penalty too: raises it toward 0 instead of lowering it."""
    seen = in_prompt | (counts > 0)
    logits = torch.where(seen, logits / repetition[:, None], logits)
    return processors.penalize(logits, counts, in_prompt, presence, frequency, torch.ones_like(repetition))


def penalize_output_only(logits, counts, in_prompt, presence, frequency, repetition):
    """Ignores in_prompt: a token seen only in the prompt escapes the repetition penalty."""
    return processors.penalize(logits, counts, torch.zeros_like(in_prompt), presence, frequency, repetition)


def prompt_rows_from_the_chunk_start(num_computed, num_new, num_prompt):  # scores token c, not c + 1 first
    b, t, rows = logprobs.prompt_rows(num_computed, num_new, num_prompt)
    return b, t - 1, rows


def prompt_rows_past_the_prompt(num_computed, num_new, num_prompt):  # the first generated token as well
    return logprobs.prompt_rows(num_computed, num_new, [p + 1 for p in num_prompt])


def prompt_rows_each_request_from_row_0(num_computed, num_new, num_prompt):
    """Counts each request's rows from 0, not after the rows of the requests before it: right for the first only."""
    b, t, rows = logprobs.prompt_rows(num_computed, num_new, num_prompt)
    return b, t, t - 1 - np.asarray(num_computed, np.int64)[b]


def prompt_rows_by_position(num_computed, num_new, num_prompt):  # as if every chunk started the prompt
    b, t, rows = logprobs.prompt_rows(num_computed, num_new, num_prompt)
    return b, t, rows + np.asarray(num_computed, np.int64)[b]


class MatcherWithoutEnd(checks12.ToyMatcher):  # the end token never allowed
    def fill_next_token_bitmask(self, bitmask, n):
        super().fill_next_token_bitmask(bitmask, n)
        for e in self.eos:
            bitmask[n, e // 32] &= ~(1 << (e % 32)) if e % 32 < 31 else 0x7FFFFFFF


class MatcherFirstCharOnly(checks12.ToyMatcher):  # a token allowed when its first character is
    def walk(self, text):
        return super().walk(text[:1]) if text else self.state


class MatcherEndByItsText(checks12.ToyMatcher):  # the end token judged by its text, as any other
    def fill_next_token_bitmask(self, bitmask, n):
        eos, self.eos = self.eos, set()
        super().fill_next_token_bitmask(bitmask, n)
        self.eos = eos


class MatcherNeverEnding(checks12.ToyMatcher):
    """is_terminated is always False: it never reports the end after an end token is taken."""

    def is_terminated(self):
        return False


def logprobs_of_the_raw_logits(logits, tokens, k):  # no log-softmax
    top, ids = logits.topk(k, dim=-1)
    own = logits.gather(-1, tokens[:, None])[:, 0]
    return own, (logits > own[:, None]).sum(-1) + 1, top, ids


def rank_counting_ties_as_ahead(logits, tokens, k):
    """`>=` counts the token itself and every token tied with it: logits [1, 1, 0, -1], token 1 -> 2."""
    own, _, top, ids = mi.worker.sample.logprobs.top_logprobs(logits, tokens, k)
    logprobs = logits.float().log_softmax(-1)
    return own, (logprobs >= own[:, None]).sum(-1), top, ids


def rank_from_zero(logits, tokens, k):
    """Ranks from 0, not 1: the most likely token gets rank 0."""
    own, rank, top, ids = mi.worker.sample.logprobs.top_logprobs(logits, tokens, k)
    return own, rank - 1, top, ids


def bitmask_most_significant_first(logits, bitmask):
    """Reads each word's bits from bit 31 down: token 32w is bit 31, not bit 0."""
    bits = (bitmask[:, :, None] >> (31 - torch.arange(32, dtype=torch.int32))) & 1
    return logits.masked_fill(~bits.flatten(1)[:, :logits.shape[1]].bool(), float("-inf"))


def bitmask_kept_where_zero(logits, bitmask):
    """Masks the tokens whose bit is 1 and keeps those whose bit is 0: the mask inverted."""
    bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return logits.masked_fill(bits.flatten(1)[:, :logits.shape[1]].bool(), float("-inf"))


def bitmask_without_the_sign_bit(logits, bitmask):  # bit 31 read as 0: token 32w + 31 never allowed
    bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    bits[:, :, 31] = 0
    return logits.masked_fill(~bits.flatten(1)[:, :logits.shape[1]].bool(), float("-inf"))


# (the check, the wrong answer)
MUTANTS = [
    (testing.check_penalize, penalize_openai_first),
    (testing.check_penalize, penalize_swapping_presence_and_frequency),
    (testing.check_penalize, penalize_always_dividing),
    (testing.check_penalize, penalize_output_only),
    (testing.check_prompt_rows, prompt_rows_from_the_chunk_start),
    (testing.check_prompt_rows, prompt_rows_past_the_prompt),
    (testing.check_prompt_rows, prompt_rows_each_request_from_row_0),
    (testing.check_prompt_rows, prompt_rows_by_position),
    (testing.check_toy_matcher, MatcherWithoutEnd),
    (testing.check_toy_matcher, MatcherFirstCharOnly),
    (testing.check_toy_matcher, MatcherEndByItsText),
    (testing.check_toy_matcher, MatcherNeverEnding),
    (testing.check_top_logprobs, logprobs_of_the_raw_logits),
    (testing.check_top_logprobs, rank_from_zero),
    (testing.check_top_logprobs, rank_counting_ties_as_ahead),
    (testing.check_apply_bitmask, bitmask_most_significant_first),
    (testing.check_apply_bitmask, bitmask_kept_where_zero),
    (testing.check_apply_bitmask, bitmask_without_the_sign_bit),
]
