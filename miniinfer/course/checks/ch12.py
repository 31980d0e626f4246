"""The checks of problem set 12 (sampling and structure): each answer against the reference, on random inputs.

Hand-written module (chapter 12)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from miniinfer.course.checks.harness import check, exercise, randint, tokens_differ, your_answers


def _histories(gen, case):
    """Random logits [B, V], each row's output-token counts and prompt tokens (as a mask)."""
    B, V = randint(gen, 1, 6), randint(gen, 5, 40)
    logits = torch.randn(B, V, generator=gen) * 3
    counts = torch.randint(0, 4, (B, V), generator=gen, dtype=torch.int32) * (torch.rand(B, V, generator=gen) < 0.3)
    in_prompt = torch.rand(B, V, generator=gen) < 0.2
    return logits, counts.int(), in_prompt


@exercise("12", 1, "penalize")
def check_penalize(fn: Callable) -> None:
    """fn(logits [B, V], counts [B, V] int32, in_prompt [B, V] bool, presence [B], frequency [B],
    repetition [B]) -> logits after transformers' repetition penalty (a token seen in the prompt or the
    output: its logit divided by the row's repetition if positive, multiplied if not), then OpenAI's
    frequency and presence penalties (l - frequency x count - presence x (count > 0))."""
    from miniinfer.worker.sample.processors import penalize

    def inputs(gen, case):
        logits, counts, in_prompt = _histories(gen, case)
        B = logits.shape[0]
        presence, frequency = torch.rand(B, generator=gen) * 4 - 2, torch.rand(B, generator=gen) * 4 - 2
        repetition = torch.rand(B, generator=gen) * 1.8 + 0.1
        if case < 3:  # one penalty at a time
            presence, frequency, repetition = (presence * (case == 0), frequency * (case == 1),
                                               repetition if case == 2 else torch.ones(B))
        return logits, counts, in_prompt, presence, frequency, repetition
    check("penalize", fn, penalize, inputs, cases=16)


@exercise("12", 2, "top_logprobs")
def check_top_logprobs(fn: Callable) -> None:
    """fn(logits [R, V], tokens [R], k) -> (the token's log-probability [R] float32, its rank [R] int64
    (1: the most likely), the k best log-probabilities [R, k] float32 and their token ids [R, k] int64).
    From case 9 on, each row's token shares its logit with another token below the k best: its rank
    counts only the tokens strictly more likely than it (logits [1, 1, 0, -1], token 1: rank 1)."""
    from miniinfer.worker.sample.logprobs import top_logprobs

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


@exercise("12", 3, "prompt_rows")
def check_prompt_rows(fn: Callable) -> None:
    """fn(num_computed, num_new, num_prompt) (lists, one entry per request of a step's batch) ->
    (request index, token position, batch row) of every prompt token the step scores, in batch order:
    the logits at position p score the token at p + 1, prompt tokens only, the first never."""
    from miniinfer.worker.sample.logprobs import prompt_rows

    def inputs(gen, case):
        B = randint(gen, 1, 6)
        prompts = [randint(gen, 1, 30) for _ in range(B)]
        computed = [randint(gen, 0, p + 4) for p in prompts]  # past the prompt: decoding
        new = [randint(gen, 1, 12) if c < p else 1 for c, p in zip(computed, prompts)]
        if case == 0:  # one prompt in three chunks, at the step of each
            return [0, 4, 8], [4, 4, 3], [11, 11, 11]
        return computed, new, prompts

    def as_lists(f):
        return lambda *a: tuple(torch.tensor([int(v) for v in x], dtype=torch.int64) for x in f(*a))
    check("prompt_rows", as_lists(fn), as_lists(prompt_rows), inputs, cases=40)


@exercise("12", 4, "apply_bitmask")
def check_apply_bitmask(fn: Callable) -> None:
    """fn(logits [R, V], bitmask [R, ceil(V / 32)] int32) -> logits with -inf where a token's bit is 0."""
    from miniinfer.worker.structured_output import apply_bitmask

    def inputs(gen, case):
        V = (33, 64, 95)[case] if case < 3 else randint(gen, 1, 200)  # a last word part used; all 32 bits
        R = randint(gen, 1, 5)
        bitmask = torch.randint(-2 ** 31, 2 ** 31, (R, -(-V // 32)), generator=gen, dtype=torch.int64).to(torch.int32)
        return torch.randn(R, V, generator=gen), bitmask
    check("apply_bitmask", fn, apply_bitmask, inputs, cases=12)


class ToyMatcher:
    """The reference: a regex as a DFA over characters, its allowed tokens as xgrammar's bitmask."""

    def __init__(self, dfa: dict[tuple[int, str], int], accepting: set[int], vocab: list[str], eos: set[int]):
        self.dfa, self.accepting, self.vocab, self.eos = dfa, accepting, vocab, eos
        self.state, self.done = 0, False

    def walk(self, text: str) -> int | None:
        state: int | None = self.state
        for ch in text:
            state = self.dfa.get((state, ch))  # type: ignore[arg-type]
            if state is None:
                return None
        return state

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, n: int) -> None:
        allowed = [bool(text) and i not in self.eos and self.walk(text) is not None
                   for i, text in enumerate(self.vocab)]
        for e in self.eos:
            allowed[e] = self.state in self.accepting
        bits = torch.tensor(allowed + [False] * (32 * bitmask.shape[1] - len(allowed)), dtype=torch.int64)
        bitmask[n] = (bits.view(-1, 32) << torch.arange(32)).sum(1).to(torch.int32)

    def accept_token(self, token: int) -> None:
        if token in self.eos:
            self.done = True
        else:
            state = self.walk(self.vocab[token])
            if state is None:
                raise ValueError(f"token {token} ({self.vocab[token]!r}) is not allowed in state {self.state}")
            self.state = state

    def is_terminated(self) -> bool:
        return self.done


def random_dfa(gen: torch.Generator, alphabet: str) -> tuple[dict[tuple[int, str], int], set[int]]:
    states = randint(gen, 1, 5)
    dfa = {(s, ch): randint(gen, 0, states - 1) for s in range(states) for ch in alphabet if randint(gen, 0, 2)}
    return dfa, {s for s in range(states) if randint(gen, 0, 1)} or {0}


@exercise("12", 5, "ToyMatcher")
def check_toy_matcher(cls: Callable) -> None:
    """cls(dfa, accepting, vocab, eos): a matcher that, token by token (accept_token), fills its row
    of a bitmask with the tokens whose text the DFA can walk from its state (fill_next_token_bitmask),
    the end tokens where the state accepts, and is terminated once an end token is taken."""
    def inputs(gen, case):
        alphabet = "ab.-"[:randint(gen, 1, 4)]
        dfa, accepting = random_dfa(gen, alphabet)
        V = (31, 32, 33)[case] if case < 3 else randint(gen, 2, 70)  # the last word: part used, whole, one bit
        vocab = ["".join(alphabet[randint(gen, 0, len(alphabet) - 1)] for _ in range(randint(gen, 0, 3)))
                 for _ in range(V)]
        eos = {randint(gen, 0, V - 1)}
        return dfa, accepting, vocab, eos, int(torch.randint(0, 2 ** 31, (), generator=gen))

    def run(make):
        def go(dfa, accepting, vocab, eos, seed):
            """The rows it fills, a step each, taking a random allowed token, until it ends or nothing is
            allowed; then whether it says it is terminated."""
            gen, m = torch.Generator().manual_seed(seed), make(dfa, accepting, vocab, eos)
            rows = torch.zeros(12, -(-len(vocab) // 32), dtype=torch.int32)
            for step in range(12):
                if m.is_terminated():
                    break
                m.fill_next_token_bitmask(rows, step)
                allowed = (((rows[step][:, None] >> torch.arange(32)) & 1).flatten()[:len(vocab)]).nonzero()[:, 0]
                if not len(allowed):
                    break
                m.accept_token(int(allowed[torch.randint(0, len(allowed), (), generator=gen)]))
            return rows, torch.tensor(bool(m.is_terminated()))
        return go
    check("ToyMatcher", run(cls), run(ToyMatcher), inputs, cases=40)


DIGITS = "0123456789"
# -?[0-9]+(\.[0-9]+)? as a DFA: 0 start, 1 after the sign, 2 in the integer part, 3 after the point, 4 in
# the fraction; 2 and 4 accept.
NUMBER_REGEX = r"-?[0-9]+(\.[0-9]+)?"
NUMBER_DFA = {(0, "-"): 1, (2, "."): 3, **{(s, d): 2 for s in (0, 1, 2) for d in DIGITS},
              **{(s, d): 4 for s in (3, 4) for d in DIGITS}}
NUMBER_ACCEPTING = {2, 4}
PROMPT = "def add(a, b):\n    return a + b\n\n\ndef"
SETTINGS: list[dict[str, Any]] = [
    dict(temperature=0, logprobs=3, prompt_logprobs=2),
    dict(temperature=0, repetition_penalty=1.3, presence_penalty=-2.0),  # where their order shows
    dict(temperature=0, frequency_penalty=1.0, presence_penalty=0.5, prompt_logprobs=0),
    dict(temperature=0.9, seed=1, min_p=0.2, logprobs=2),
    dict(temperature=1.2, seed=2, repetition_penalty=1.2, prompt_logprobs=1)]
NUMBER_PROMPTS = ["x = ", "pi = 3.", "The answer is "]


def _first_difference(mine, theirs, name: str) -> str | None:
    """Where two requests' outputs differ: tokens exactly, log-probabilities within float32 rounding."""
    if (wrong := tokens_differ(theirs.token_ids, mine.token_ids)) is not None:
        return f"{name}: {wrong}"
    for kind in ("logprobs", "prompt_logprobs"):
        a, b = getattr(mine, kind) or [], getattr(theirs, kind) or []
        if len(a) != len(b):
            return f"{name}: {len(b)} entries of {kind} expected, {len(a)} received"
        for j, (x, y) in enumerate(zip(a, b)):
            if (x is None) != (y is None) or x is not None and (
                    (x.token, x.rank, [t for t, _ in x.top]) != (y.token, y.rank, [t for t, _ in y.top])
                    or abs(x.logprob - y.logprob) > 1e-4):
                return f"{name}: {kind} of token {j + 1} differ\n  expected {y}\n  received {x}"
    return None


@exercise("12", 6, "your_processors")
def check_sampling_engine(processors: tuple) -> None:
    """The last part: an engine whose logits processors are the given subclasses (each in place of the
    package class it derives from), its prompts computed in chunks of 7 tokens, against the package's
    engine without chunks and with xgrammar: the same tokens, log-probabilities and prompt
    log-probabilities for a batch of requests with their own settings; every block back."""
    __tracebackhide__ = True
    import dataclasses

    import miniinfer as mi
    from miniinfer.worker.components import build_components
    params = [mi.SamplingParams(max_tokens=24, **s) for s in SETTINGS]
    number = mi.StructuredOutput(regex=NUMBER_REGEX)
    params += [mi.SamplingParams(temperature=t, seed=i, max_tokens=12, structured_output=number)
               for i, t in enumerate((0, 0.8, 1.2))]
    prompts = [PROMPT] * len(SETTINGS) + NUMBER_PROMPTS
    model, tok = mi.load_model(), mi.load_tokenizer()
    plain = mi.EngineConfig(num_blocks=64)
    theirs = mi.LLMEngine(plain, model=model, tokenizer=tok).generate(prompts, params, use_tqdm=False)
    config = mi.EngineConfig(num_blocks=64, enable_chunked_prefill=True, max_num_batched_tokens=7)
    package = build_components(config)
    yours = {cls.__mro__[1]: cls for cls in processors}
    engine = mi.LLMEngine(config, model=model, tokenizer=tok, components=dataclasses.replace(
        package, processors=tuple(yours.get(make, make) for make in package.processors)))
    with your_answers("12"):
        ours = engine.generate(prompts, params, use_tqdm=False)
    for i, (mine, their) in enumerate(zip(ours, theirs)):
        what = ", ".join(f"{k}={v}" for k, v in (SETTINGS[i] if i < len(SETTINGS) else {"regex": NUMBER_REGEX}).items())
        if (wrong := _first_difference(mine, their, f"request {i + 1} of {len(ours)} ({what})")) is not None:
            raise AssertionError(wrong)
    bm = engine.block_manager
    if bm.num_free_blocks != bm.num_blocks:
        raise AssertionError(f"{bm.num_blocks - bm.num_free_blocks} blocks were not given back")
    numbers = ", ".join(repr(o.text) for o in ours[len(SETTINGS):])
    print(f"passed: {len(ours)} requests in chunks of 7 prompt tokens, the package's tokens and log-probabilities; "
          f"your grammar wrote {numbers} as xgrammar does; every block back")
