"""Wrong answers to problem set 09 that its checks must reject: each named (or documented) for its mistake."""


import torch

import miniinfer.worker.speculative as spec
from miniinfer.course import checks as testing


def rejection_sample_residual_is_p(p, q, guesses, u, noise):  # the tempting shortcut: biased to q's likes
    return spec.rejection_sample(p, q, guesses, u, noise)[0], (p / noise).argmax(-1)


def rejection_sample_q_over_p(p, q, guesses, u, noise):  # the ratio upside down
    g = guesses.clamp(min=0)[:, None]
    kept = (guesses >= 0) & (u * p.gather(-1, g)[:, 0] <= q.gather(-1, g)[:, 0])
    return kept, spec.rejection_sample(p, q, guesses, u, noise)[1]


def rejection_sample_without_fallback(p, q, guesses, u, noise):  # p = q leaves zeros: always token 0
    return spec.rejection_sample(p, q, guesses, u, noise)[0], ((p - q).clamp(min=0) / noise).argmax(-1)


def rejection_sample_keeping_no_guess(p, q, guesses, u, noise):  # -1 read as the last token: "kept"
    g = guesses[:, None] % p.shape[-1]
    return u * q.gather(-1, g)[:, 0] <= p.gather(-1, g)[:, 0], spec.rejection_sample(p, q, guesses, u, noise)[1]


def keep_counting_every_accepted(guesses, accepted, tokens, table, num_known, block_size):
    """Counts every accepted guess, also those after the first rejection: keeps rejected guesses."""
    a = sum(accepted)  # not only those before the first rejection
    return guesses[:a] + [tokens[a]], table[:-(-(num_known + a) // block_size)]


def keep_the_last_tokens_block(guesses, accepted, tokens, table, num_known, block_size):
    """Keeps a block for the sampled token too, which has no K/V yet: one block too many when it starts a block."""
    new, _ = spec.keep_accepted(guesses, accepted, tokens, table, num_known, block_size)
    return new, table[:-(-(num_known + len(new)) // block_size)]  # the sampled token has no K/V yet


def keep_without_the_bonus(guesses, accepted, tokens, table, num_known, block_size):
    """Drops the token sampled after the last guess when every guess is kept."""
    new, kept = spec.keep_accepted(guesses, accepted, tokens, table, num_known, block_size)
    return (new[:-1] if len(new) > len(guesses) else new), kept


def keep_flooring_the_blocks(guesses, accepted, tokens, table, num_known, block_size):
    """Rounds the kept blocks down: drops the partly filled last block of the kept tokens."""
    new, _ = spec.keep_accepted(guesses, accepted, tokens, table, num_known, block_size)
    return new, table[:(num_known + len(new) - 1) // block_size]


def ngram_at_the_earliest_place(tokens, k, max_n):
    """Takes the earliest earlier occurrence of the n-gram, not the latest."""
    for n in range(min(max_n, len(tokens) - 1), 0, -1):
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == tokens[-n:]:
                return tokens[start + n:start + n + k]
    return []


def ngram_shortest_first(tokens, k, max_n):
    """Tries n from 1 up: takes the shortest matching n-gram, not the longest."""
    for n in range(1, min(max_n, len(tokens) - 1) + 1):
        if guesses := spec.ngram_guesses(tokens, k, n, n):
            return guesses
    return []


def ngram_matching_the_end_itself(tokens, k, max_n):  # the tail always matches itself: no guesses
    for n in range(min(max_n, len(tokens) - 1), 0, -1):
        for start in range(len(tokens) - n, -1, -1):
            if tokens[start:start + n] == tokens[-n:]:
                return tokens[start + n:start + n + k]
    return []


def ngram_all_that_follow(tokens, k, max_n):  # not cut to k
    guesses = spec.ngram_guesses(tokens, len(tokens), max_n)
    return guesses if len(guesses) > k else spec.ngram_guesses(tokens, k, max_n)


def _draft(draft, tokens, k, noise, q_of, appended: bool = True, row=lambda j: j):
    """Draft guesses with one piece swapped: how q is made from the logits, whether the guesses join
    the context, which noise row draws guess j."""
    guesses, qs = [], []
    for j in range(k):
        q = q_of(draft(tokens + guesses if appended else tokens).float())
        guesses.append(int((q / noise[row(j)]).argmax()))
        qs.append(q)
    return guesses, torch.stack(qs)


def _q(temperature):
    return lambda logits: (torch.nn.functional.one_hot(logits.argmax(), logits.shape[-1]).float() if temperature == 0
                           else (logits / temperature).softmax(-1))


def draft_without_temperature(draft, tokens, k, temperature, noise):  # q from the raw logits: right at 1 only
    return _draft(draft, tokens, k, noise, lambda logits: logits.softmax(-1))


def draft_from_the_prompt_only(draft, tokens, k, temperature, noise):  # every guess at the same position
    return _draft(draft, tokens, k, noise, _q(temperature), appended=False)


def draft_softmax_at_zero(draft, tokens, k, temperature, noise):
    """Temperature 0 read as 1 for q: the race then draws from the softmax instead of taking the argmax."""
    return _draft(draft, tokens, k, noise, _q(temperature) if temperature else lambda logits: logits.softmax(-1))


def draft_one_noise_row(draft, tokens, k, temperature, noise):  # the same random numbers for every guess
    return _draft(draft, tokens, k, noise, _q(temperature), row=lambda j: 0)


def draft_exp_without_the_max(draft, tokens, k, temperature, noise):  # exp overflows at large logits / temperature
    def q_of(logits):
        if temperature == 0:
            return _q(0)(logits)
        e = (logits / temperature).exp()
        return e / e.sum()
    return _draft(draft, tokens, k, noise, q_of)


def counts_of(a, b, rare: int = 10) -> torch.Tensor:
    """[2, categories] float64: the values seen, those seen fewer than `rare` times pooled."""
    values = sorted(set(a) | set(b))
    counts = torch.tensor([[x.count(v) for v in values] for x in (a, b)], dtype=torch.float64)
    pooled = counts.sum(0) < rare
    counts = torch.cat([counts[:, ~pooled], counts[:, pooled].sum(1, keepdim=True)], 1)
    return counts[:, counts.sum(0) > 0]


def p_value(counts: torch.Tensor, dof: int) -> float:
    expected = counts.sum(1, keepdim=True) * counts.sum(0) / counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    return 1.0 if dof < 1 else float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def same_law_without_pooling(a, b):
    """Never pools values seen fewer than 10 times: their tiny expected counts throw the statistic off."""
    counts = counts_of(a, b, rare=0)
    return p_value(counts, counts.shape[1] - 1)


def same_law_one_degree_too_many(a, b):
    """Uses as many degrees of freedom as categories, not one fewer: the p-value comes out too large."""
    counts = counts_of(a, b)
    return p_value(counts, counts.shape[1])


def same_law_against_a_alone(a, b):  # b tested against a's frequencies, as if they were the truth
    counts = counts_of(a, b)
    counts = counts[:, counts[0] > 0]
    expected = counts[0] / len(a) * len(b)
    stat = ((counts[1] - expected) ** 2 / expected).sum()
    dof = counts.shape[1] - 1
    return 1.0 if dof < 1 else float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def same_law_statistic(a, b):  # the statistic, not its p-value
    counts = counts_of(a, b)
    expected = counts.sum(1, keepdim=True) * counts.sum(0) / counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# (the check, the wrong answer)
MUTANTS = [
    (testing.check_rejection_sample, rejection_sample_residual_is_p),
    (testing.check_rejection_sample, rejection_sample_q_over_p),
    (testing.check_rejection_sample, rejection_sample_without_fallback),
    (testing.check_rejection_sample, rejection_sample_keeping_no_guess),
    (testing.check_keep_accepted, keep_counting_every_accepted),
    (testing.check_keep_accepted, keep_the_last_tokens_block),
    (testing.check_keep_accepted, keep_without_the_bonus),
    (testing.check_keep_accepted, keep_flooring_the_blocks),
    (testing.check_ngram_guesses, ngram_at_the_earliest_place),
    (testing.check_ngram_guesses, ngram_shortest_first),
    (testing.check_ngram_guesses, ngram_matching_the_end_itself),
    (testing.check_ngram_guesses, ngram_all_that_follow),
    (testing.check_draft_guesses, draft_without_temperature),
    (testing.check_draft_guesses, draft_from_the_prompt_only),
    (testing.check_draft_guesses, draft_softmax_at_zero),
    (testing.check_draft_guesses, draft_one_noise_row),
    (testing.check_draft_guesses, draft_exp_without_the_max),
    (testing.check_same_law, same_law_without_pooling),
    (testing.check_same_law, same_law_one_degree_too_many),
    (testing.check_same_law, same_law_against_a_alone),
    (testing.check_same_law, same_law_statistic),
]
