"""The checks of problem set 07 (prefix caching): each answer against the reference, on random inputs.

Hand-written module (chapter 07)."""

from __future__ import annotations

from typing import Callable

import torch

from miniinfer.course.checks.harness import (
    as_tensor,
    blocks_back,
    check,
    check_tokens,
    exercise,
    named,
    randint,
    random_block_size,
    your_answers,
)


def _chain_hashes_ref(tokens, block_size):
    from miniinfer.core.prefix_cache import block_keys
    return [h for h, _ in block_keys(tokens, block_size)]


@exercise("07", 1, "chain_hashes")
def check_chain_hashes(fn: Callable) -> None:
    """fn(tokens, block_size) -> the chained hash of each full block, in order."""
    def inputs(gen, case):
        return [randint(gen, 0, 3) for _ in range(randint(gen, 0, 30))], random_block_size(gen, case, 5)
    check("chain_hashes", as_tensor(fn), as_tensor(_chain_hashes_ref), inputs, cases=40)


def _longest_cached_prefix_ref(tokens, cached, block_size):
    hashes = _chain_hashes_ref(tokens[:-1], block_size)  # the last token's block is always computed
    blocks = []
    for h in hashes:
        if h not in cached:
            break
        blocks.append(cached[h])
    return blocks


@exercise("07", 2, "longest_cached_prefix")
def check_longest_cached_prefix(fn: Callable) -> None:
    """fn(tokens, cached {hash: block}, block_size) -> the cached blocks of the longest prefix,
    leaving at least the last token to compute; some caches have lost blocks inside a prefix."""
    def inputs(gen, case):
        bs = random_block_size(gen, case, 4)
        stored = [[randint(gen, 0, 2) for _ in range(randint(gen, 0, 16))] for _ in range(3)]
        cached = {h: randint(gen, 0, 99) for s in stored for h in _chain_hashes_ref(s, bs)}
        if case % 2:  # evictions leave gaps: a later block of a prefix can outlive an earlier one
            cached = {h: b for h, b in cached.items() if torch.rand((), generator=gen) > 0.3}
        query = stored[0][:randint(gen, 0, 16)] + [randint(gen, 0, 2) for _ in range(randint(gen, 1, 6))]
        return query, cached, bs
    check("longest_cached_prefix", as_tensor(fn), as_tensor(_longest_cached_prefix_ref), inputs, cases=60)


def _lru_evictions_ref(free, ops):
    lru, evicted = [], []
    for op, arg in ops:
        if op == "release":
            lru.append(arg)
        elif op == "hit":
            if arg in lru:
                lru.remove(arg)
        else:  # take arg blocks
            use = min(arg, len(free))
            del free[:use]
            evicted += lru[:arg - use]
            del lru[:arg - use]
    return evicted


@exercise("07", 3, "lru_evictions")
def check_lru_evictions(fn: Callable) -> None:
    """fn(free, ops) -> the cached blocks evicted, in order. ops: ("release", b): cached block b
    loses its last user; ("hit", b): a request reuses cached block b; ("take", n): n blocks are
    needed, from the free list first (front first), then by evicting the least recently used."""
    def inputs(gen, case):
        free = list(range(randint(gen, 0, 4)))
        left, lru, in_use, ops = len(free), [], list(range(10, 10 + randint(gen, 0, 8))), []
        for _ in range(randint(gen, 0, 14)):  # only valid ops: a take never asks for more than there is
            kind = randint(gen, 0, 2)
            if kind == 0 and in_use:
                b = in_use.pop(randint(gen, 0, len(in_use) - 1))
                ops.append(("release", b))
                lru.append(b)
            elif kind == 1 and lru:
                b = lru.pop(randint(gen, 0, len(lru) - 1))
                ops.append(("hit", b))
                in_use.append(b)
            elif left + len(lru):
                n = randint(gen, 1, left + len(lru))
                ops.append(("take", n))
                del lru[:n - min(n, left)]
                left -= min(n, left)
        return free, ops
    check("lru_evictions", as_tensor(fn), as_tensor(_lru_evictions_ref), inputs, cases=60)


def _prefill_plan_ref(num_decoders, prompt_lens, budget):
    left, steps = list(prompt_lens), []
    while any(left):
        room, step = budget - num_decoders, []
        for i, n in enumerate(left):
            take = min(n, room)
            step.append(take)
            left[i], room = n - take, room - take
        steps.append(step)
    return steps


@exercise("07", 4, "prefill_plan")
def check_prefill_plan(fn: Callable) -> None:
    """fn(num_decoders, prompt_lens, budget) -> for each step until every prompt is computed, the
    tokens of each prompt computed in it: the decoders take one token each first, the prompts share
    what is left in queue order."""
    def inputs(gen, case):
        d = randint(gen, 0, 5)
        return d, [randint(gen, 1, 40) for _ in range(randint(gen, 0, 4))], d + randint(gen, 1, 12)
    check("prefill_plan", as_tensor(fn), as_tensor(_prefill_plan_ref), inputs, cases=60)


SHARED = "import numpy as np\n\n\ndef moving_average(values, window):\n"
PROMPTS = [SHARED + end for end in ['    """Return', "    if window", "    out = []"]]


@exercise("07", 5, "YourCache")
def check_prefix_cache(cache: type) -> None:
    """The last part: the engine with prefix caching on cache (a PrefixCachingBlockManager whose match
    is the student's lookup) serves three requests sharing 20 prompt tokens twice, in blocks of 4 with
    prompts in pieces of a 16-token budget: the package engine's tokens and cache hits in both rounds,
    and every block back."""
    __tracebackhide__ = True
    import miniinfer as mi
    from miniinfer.engine.llm_engine import BLOCK_MANAGERS
    model, tok = mi.load_model(), mi.load_tokenizer()
    config = mi.EngineConfig(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                             enable_chunked_prefill=True, enable_prefix_caching=True)
    params = mi.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    package = mi.LLMEngine(config, model=model, tokenizer=tok)
    expected = [package.generate(PROMPTS, params, use_tqdm=False) for _ in range(2)]
    written = dict.__getitem__(BLOCK_MANAGERS, True)  # as the table holds it: "module:name", imported when asked for
    BLOCK_MANAGERS[True] = cache
    try:
        engine = mi.LLMEngine(config, model=model, tokenizer=tok)
    finally:
        dict.__setitem__(BLOCK_MANAGERS, True, written)
    with your_answers("07"):
        rounds = [engine.generate(PROMPTS, params, use_tqdm=False) for _ in range(2)]
    for out in rounds[1]:
        print(f"{out.num_cached_tokens:2} of {len(out.prompt_token_ids)} prompt tokens cached:",
              repr(tok.decode(out.prompt_token_ids[-4:] + out.token_ids)))
    for r, (mine, theirs) in enumerate(zip(rounds, expected)):
        check_tokens(named(PROMPTS, f"round {r + 1} of 2"), [o.token_ids for o in theirs], [o.token_ids for o in mine])
        hits, want = [o.num_cached_tokens for o in mine], [o.num_cached_tokens for o in theirs]
        if hits != want:
            raise AssertionError(f"round {r + 1} of 2: the right tokens, but prompt tokens found in the cache "
                                 f"per request\n  expected {want}\n  received {hits}")
    blocks_back(engine.block_manager, "two rounds of three requests")
    print("passed: the package engine's tokens and cache hits in both rounds, every block back")
