"""The checks of problem set 09 (speculative decoding): each answer against the reference, on random inputs.

Hand-written module (chapter 09)."""

from __future__ import annotations

from typing import Callable

import torch

from miniinfer.course.checks.harness import as_tensor, check, exercise, randint, random_block_size


def _rejection_step_ref(p, q, guess, u):
    residual = (p - q).clamp(min=0)
    residual = residual / residual.sum() if residual.sum() > 0 else p
    return torch.tensor(bool(u * q[guess] <= p[guess])), residual


@exercise("09", 1, "rejection_step")
def check_rejection_step(fn: Callable) -> None:
    """fn(p, q, guess, u) -> (kept, residual): whether the guess (drawn from q) is kept, given a
    uniform u in (0, 1): with probability min(1, p[guess] / q[guess]); and the distribution a rejected
    guess is replaced from, norm(max(0, p - q)) (p itself where p equals q)."""
    def inputs(gen, case):
        V = randint(gen, 2, 9)
        p = torch.rand(V, generator=gen) ** 3
        q = p.clone() if case == 0 else torch.rand(V, generator=gen) ** 3
        if case == 1:  # a token q never proposes but p likes, and one p never takes
            q[0], p[-1] = 0.0, 0.0
        return p / p.sum(), q / q.sum(), randint(gen, 1, V - 1), float(torch.rand((), generator=gen))

    def as_tensors(f):
        def run(p, q, guess, u):
            kept, residual = f(p, q, guess, u)
            return torch.tensor(bool(kept)), residual
        return run
    check("rejection_step", as_tensors(fn), _rejection_step_ref, inputs, cases=60, atol=1e-6)


def _expected_tokens_ref(alpha, k):
    return torch.tensor(float(k + 1) if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha), dtype=torch.float64)


@exercise("09", 2, "expected_tokens")
def check_expected_tokens(fn: Callable) -> None:
    """fn(alpha, k) -> the tokens a step with k guesses makes on average when each guess is kept with
    probability alpha (independently): the kept ones before the first rejection, and one token more."""
    def inputs(gen, case):
        alpha = (0.0, 1.0)[case] if case < 2 else float(torch.rand((), generator=gen))
        return alpha, randint(gen, 1, 10)
    check("expected_tokens", lambda a, k: torch.tensor(float(fn(a, k)), dtype=torch.float64),
          _expected_tokens_ref, inputs, cases=30, rtol=1e-9, atol=1e-9)


@exercise("09", 3, "ngram_guesses")
def check_ngram_guesses(fn: Callable) -> None:
    """fn(tokens, k, max_n) -> up to k guesses: for n from max_n down to 1, the tokens that followed
    the latest earlier occurrence of the last n tokens (one that is followed by a token), the first
    n that has one; [] when none has."""
    from miniinfer.worker.speculative import ngram_guesses

    def inputs(gen, case):
        vocab = randint(gen, 1, 4)
        tokens = [randint(gen, 0, vocab) for _ in range(randint(gen, 1, 24))]
        return tokens, randint(gen, 1, 6), randint(gen, 1, 4)
    check("ngram_guesses", as_tensor(fn), as_tensor(lambda t, k, n: ngram_guesses(t, k, n)), inputs, cases=80)


def _rollback_ref(table, num_tokens, block_size):
    keep = -(-num_tokens // block_size)
    return table[:keep], table[keep:]


@exercise("09", 4, "rollback")
def check_rollback(fn: Callable) -> None:
    """fn(table, num_tokens, block_size) -> (kept, released): a block table cut to hold only the first
    num_tokens tokens (the rest were rejected guesses), and the blocks it gives back, in order."""
    def inputs(gen, case):
        bs = random_block_size(gen, case)
        n = randint(gen, 1, 30)
        blocks = torch.randperm(40, generator=gen)[:-(-(n + randint(gen, 0, 8)) // bs)].tolist()
        return blocks, n, bs
    check("rollback", as_tensor(fn), as_tensor(_rollback_ref), inputs, cases=40)
