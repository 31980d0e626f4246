"""The checks of problem set 09 (speculative decoding): each answer against the reference, on random
inputs, and the last part: the engine run on the student's pieces against the engine without speculation.

Hand-written module (chapter 09)."""

from __future__ import annotations

import functools
from typing import Callable

import torch

from miniinfer.course.checks.harness import (
    as_tensor,
    blocks_back,
    check,
    check_tokens,
    device,
    engine_with,
    exercise,
    named,
    randint,
    random_block_size,
    your_answers,
)
from miniinfer.course.checks.speed import faster_of, speed_item, wall_seconds


def _rejection_sample_inputs(gen: torch.Generator, case: int) -> tuple:
    """Rows of every kind: a draft's guess, a guess made outright (q one-hot), the row after the last
    guess (-1, q zeros), q equal to p (nothing left to correct with), and p or q zero at some tokens."""
    R, V = randint(gen, 1, 12), randint(gen, 2, 9)
    p = torch.rand(R, V, generator=gen) ** 3
    p[torch.rand(R, V, generator=gen) < 0.2] = 0.0
    p[:, randint(gen, 0, V - 1)] += 0.01  # no row all zeros
    p = p / p.sum(-1, keepdim=True)
    q = torch.rand(R, V, generator=gen) ** 3
    q[torch.rand(R, V, generator=gen) < 0.2] = 0.0
    q[:, randint(gen, 0, V - 1)] += 0.01
    q = q / q.sum(-1, keepdim=True)
    kind = torch.randint(0, 4, (R,), generator=gen) if case else torch.arange(R) % 4
    guesses = torch.multinomial(q, 1, generator=gen)[:, 0]
    q[kind == 1] = torch.nn.functional.one_hot(guesses, V)[kind == 1].float()  # guessed outright
    q[kind == 2] = p[kind == 2]
    guesses = torch.where(kind == 2, torch.multinomial(p, 1, generator=gen)[:, 0], guesses)
    q[kind == 3], guesses[kind == 3] = 0.0, -1
    u = torch.rand(R, generator=gen).clamp(1e-6, 1 - 1e-6)
    noise = -torch.rand(R, V, generator=gen).clamp(min=1e-9).log()
    return p, q, guesses, u, noise


@exercise("09", 1, "rejection_sample")
def check_rejection_sample(fn: Callable) -> None:
    """fn(p, q, guesses, u, noise) -> (accepted [R] bool, tokens [R] int64): for each row, whether its
    guess (drawn from q; -1: none) is kept, u * q[guess] <= p[guess]; and the token sampled there,
    argmax(residual / noise) with residual = max(0, p - q), or p where that is all zeros."""
    from miniinfer.worker.speculative import rejection_sample
    check("rejection_sample", fn, rejection_sample, _rejection_sample_inputs, cases=60)


@exercise("09", 2, "keep_accepted")
def check_keep_accepted(fn: Callable) -> None:
    """fn(guesses, accepted, tokens, table, num_known, block_size) -> (kept tokens, table): the guesses
    before the first rejected one and the token sampled at that row; the table cut to the blocks that
    hold the known tokens and the kept guesses."""
    from miniinfer.core.block_manager import blocks_needed
    from miniinfer.worker.speculative import keep_accepted

    def inputs(gen, case):
        bs = random_block_size(gen, case)
        m = 0 if case == 2 else randint(gen, 1, 6)
        known = randint(gen, 1, 20)
        accepted = [True] * m if case == 3 else [bool(randint(gen, 0, 3)) for _ in range(m)]
        table = torch.randperm(40, generator=gen)[:blocks_needed(known + m, bs)].tolist()
        return ([randint(gen, 0, 9) for _ in range(m)], accepted, [randint(gen, 0, 9) for _ in range(m + 1)],
                table, known, bs)
    check("keep_accepted", as_tensor(fn), as_tensor(keep_accepted), inputs, cases=60)


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


class ToyDraft:
    """A draft model small enough to read: the logits of the next token are a row of a random table
    picked by the last token, plus one picked by the position (so every guess depends on the ones
    before it), at a scale that makes softmax overflow when computed without its max subtracted."""

    def __init__(self, vocab: int, seed: int, scale: float):
        gen = torch.Generator().manual_seed(seed)
        self.vocab, self.seed, self.scale = vocab, seed, scale
        self.by_token = torch.randn(vocab, vocab, generator=gen) * scale
        self.by_position = torch.randn(7, vocab, generator=gen) * scale
        self.by_token[:, -1], self.by_position[:, -1] = self.by_token[:, 0], self.by_position[:, 0]  # ties

    def __call__(self, tokens: list[int]) -> torch.Tensor:
        return self.by_token[tokens[-1]] + self.by_position[len(tokens) % 7]

    def __repr__(self) -> str:
        return f"ToyDraft(vocab={self.vocab}, seed={self.seed}, scale={self.scale})"


def draft_guesses(draft: Callable[[list[int]], torch.Tensor], tokens: list[int], k: int, temperature: float,
                  noise: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """k guesses drawn one after another from the draft: q_j = softmax(draft(tokens + guesses so far) /
    temperature) (one-hot at the argmax at temperature 0), guess j = argmax(q_j / noise[j])."""
    guesses: list[int] = []
    qs = []
    for j in range(k):
        logits = draft(tokens + guesses).float()
        q = (torch.nn.functional.one_hot(logits.argmax(), logits.shape[-1]).float() if temperature == 0
             else (logits / temperature).softmax(-1))
        guesses.append(int((q / noise[j]).argmax()))
        qs.append(q)
    return guesses, torch.stack(qs)


@exercise("09", 4, "draft_guesses")
def check_draft_guesses(fn: Callable) -> None:
    """fn(draft, tokens, k, temperature, noise [k, V]) -> (k guesses, q [k, V]): each guess drawn from
    the draft's distribution after the tokens and the guesses before it, by chapter 06's race."""
    def inputs(gen, case):
        V, k = randint(gen, 2, 40), (1, 5)[case % 2] if case < 4 else randint(gen, 1, 6)
        temperature = (0.0, 0.05, 0.7, 1.0, 1.5)[case % 5]
        draft = ToyDraft(V, randint(gen, 0, 10 ** 6), (1.0, 40.0)[case % 3 == 2])
        tokens = [randint(gen, 0, V - 1) for _ in range(randint(gen, 1, 6))]
        noise = -torch.rand(k, V, generator=gen).clamp(min=1e-9).log()
        return draft, tokens, k, temperature, noise

    def as_tensors(f):
        def run(draft, tokens, k, temperature, noise):
            guesses, q = f(draft, list(tokens), k, temperature, noise)
            return torch.tensor(guesses, dtype=torch.int64), q
        return run
    check("draft_guesses", as_tensors(fn), as_tensors(draft_guesses), inputs, cases=40)


RARE = 10  # categories seen fewer times than this in both samples together are pooled into one (expected 5 each)


def same_law(a: list[int], b: list[int]) -> float:
    """The chi-square test of homogeneity: the p-value that samples a and b come from one distribution."""
    counts = torch.stack([torch.bincount(torch.tensor(x, dtype=torch.int64), minlength=max(a + b) + 1)
                          for x in (a, b)]).double()
    rare = counts.sum(0) < RARE
    counts = torch.cat([counts[:, ~rare], counts[:, rare].sum(1, keepdim=True)], 1)
    counts = counts[:, counts.sum(0) > 0]
    if counts.shape[1] < 2:
        return 1.0
    expected = counts.sum(1, keepdim=True) * counts.sum(0) / counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((counts.shape[1] - 1) / 2, dtype=torch.float64), stat / 2))


@exercise("09", 5, "same_law")
def check_same_law(fn: Callable) -> None:
    """fn(a, b) -> the chi-square p-value that the samples a and b (lists of ints) have one law: the
    values seen, those seen fewer than 10 times in a and b together pooled into one category."""
    def inputs(gen, case):
        V = randint(gen, 1, 12)
        law_a = torch.rand(V, generator=gen) ** 2 + 1e-3
        law_b = law_a if case % 2 else torch.rand(V, generator=gen) ** 2 + 1e-3
        na, nb = (1, 1) if case == 0 else (randint(gen, 5, 300), randint(gen, 5, 300))
        return (torch.multinomial(law_a, na, replacement=True, generator=gen).tolist(),
                torch.multinomial(law_b, nb, replacement=True, generator=gen).tolist())
    check("same_law", lambda a, b: torch.tensor(float(fn(a, b)), dtype=torch.float64),
          lambda a, b: torch.tensor(same_law(a, b), dtype=torch.float64), inputs, cases=40, rtol=1e-4, atol=1e-9)


GREEDY_PROMPTS = ["for i in range(10):\n    print(i)\nfor j in range(10):\n", "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [",
                  'def add(a, b):\n    """Return a + b."""\n    return a + b\n\n\ndef sub(a, b):\n']
# Measured on the 2-core CPU (2026-11-26), 400 requests of 4 tokens: with the reference pieces p = 0.55-0.99
# over four sets of seeds; a replacement drawn from p instead of the residual 5e-9, a guess always kept 1e-35.
# Prompts whose next tokens are nearly certain gave the test less power; 5 expected a category (RARE) kept
# a correct sampler from failing it.
SAMPLED_PROMPT = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n   "
SAMPLES, SAMPLED_TOKENS = 400, 4
LEVEL = 1e-3  # the p-value below which the two engines' outputs have different laws


def _engine(model, tok, runner: type | None = None, **config):
    """The course model's engine: on runner with n-gram speculation (k = 4), or without speculation."""
    import miniinfer as mi
    if runner is None:
        return mi.LLMEngine(mi.EngineConfig(block_size=4, **config), model=model, tokenizer=tok)
    spec = mi.EngineConfig(speculative_method="ngram", num_speculative_tokens=4, block_size=4, **config)
    return engine_with(spec, model, tok, runner=runner)


@exercise("09", 6, "YourRunner", "YourRunner, same_law")
def check_speculative_engine(runner: type, law: Callable) -> None:
    """The last part: the engine on runner (a SpeculativeRunner with the student's pieces) gives the
    tokens of the engine without speculation, greedy, in as many steps as the package's n-gram runner;
    sampled at temperature 0.8, SAMPLES seeded requests with it and without speculation pass the
    student's chi-square test; every block comes back."""
    __tracebackhide__ = True
    import miniinfer as mi
    from miniinfer.worker.speculative import SpeculativeRunner
    greedy = mi.SamplingParams(temperature=0, max_tokens=48)
    model, tok = mi.load_model(), mi.load_tokenizer()  # one copy for the five engines
    with your_answers("09"):
        yours, plain, package = (_engine(model, tok, r, num_blocks=128) for r in (runner, None, SpeculativeRunner))
        got, expected = ([o.token_ids for o in e.generate(GREEDY_PROMPTS, greedy, use_tqdm=False)]
                         for e in (yours, plain))
        check_tokens([f"greedy, prompt {i + 1} of {len(GREEDY_PROMPTS)} ({p!r})" for i, p in enumerate(GREEDY_PROMPTS)],
                     expected, got)
        blocks_back(yours.block_manager, "greedy")
        package.generate(GREEDY_PROMPTS, greedy, use_tqdm=False)
        mine, theirs = yours.stats.spec, package.stats.spec
        if (mine.proposed, mine.accepted) != (theirs.proposed, theirs.accepted):
            raise AssertionError(
                f"greedy, the right tokens but not the package's guesses: {mine.accepted} of {mine.proposed} "
                f"guesses kept ({mine.tokens_per_step:.2f} tokens a step), expected {theirs.accepted} of "
                f"{theirs.proposed} ({theirs.tokens_per_step:.2f}): look at your n-gram lookup")
        each = [mi.SamplingParams(temperature=0.8, max_tokens=SAMPLED_TOKENS, ignore_eos=True, seed=i)
                for i in range(SAMPLES)]
        # Every request verifies guesses, however many run (the engine's default speculates in small batches only).
        yours, plain = (_engine(model, tok, r, num_blocks=SAMPLES * 4, max_num_seqs=SAMPLES,
                                speculative_max_batch=SAMPLES) for r in (runner, None))
        runs = [[tuple(o.token_ids) for o in e.generate([SAMPLED_PROMPT] * SAMPLES, each, use_tqdm=False)]
                for e in (yours, plain)]
        blocks_back(yours.block_manager, "sampled")
        names = {t: n for n, t in enumerate(sorted(set(runs[0] + runs[1])))}  # each sequence a category
        p_value = float(law([names[t] for t in runs[0]], [names[t] for t in runs[1]]))
    s = yours.stats.spec
    if p_value < LEVEL:
        raise AssertionError(f"sampled at temperature 0.8: the {SAMPLED_TOKENS} tokens of {SAMPLES} seeded requests "
                             f"with your speculation and without follow different laws (chi-square p = "
                             f"{p_value:.2g} < {LEVEL:g}); {s.acceptance_rate:.0%} of the guesses were kept")
    print(f"passed: greedy, the tokens without speculation, {mine.tokens_per_step:.2f} a step as the package's; "
          f"sampled, the same law (chi-square p = {p_value:.2f}, {s.acceptance_rate:.0%} of the guesses kept); "
          "every block back")


@speed_item("09", 6, "YourRunner")
def speed_speculative_runner(runner: type):
    """Greedy n-gram speculation (k = 4) on the three pieces of code that repeat themselves: the engine
    on runner against the package's speculative runner, each also against no speculation; the course
    model on the GPU when there is one."""
    import miniinfer as mi
    from miniinfer.worker.speculative import SpeculativeRunner
    greedy = mi.SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    model, tok = mi.load_model(device=device()), mi.load_tokenizer()
    runs = [functools.partial(_engine(model, tok, r, num_blocks=128).generate, GREEDY_PROMPTS, greedy, use_tqdm=False)
            for r in (runner, SpeculativeRunner, None)]
    with your_answers("09"):
        got, expected, _ = ([o.token_ids for o in run()] for run in runs)  # a first round each: graphs, caches
        check_tokens(named(GREEDY_PROMPTS, "greedy, the timed workload (a wrong answer is not timed)"), expected, got)
        yours, theirs = faster_of(runs[0], runs[1], wall_seconds)
    plain = min(wall_seconds(runs[2]) for _ in range(2))
    return theirs / yours, (f"{plain / yours:.2f}x faster than without speculation, the package's runner "
                            f"{plain / theirs:.2f}x")
