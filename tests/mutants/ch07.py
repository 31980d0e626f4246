"""Wrong answers to problem set 07 that its checks must reject: each named (or documented) for its mistake."""



import miniinfer as mi
from miniinfer.course import checks as testing


def hashes_without_the_chain(tokens, block_size):
    """Hashes each block's tokens alone, without its parent's hash: equal blocks after different prefixes collide."""
    return [hash(tuple(tokens[i:i + block_size])) for i in range(0, len(tokens) - block_size + 1, block_size)]


def prefix_matching_the_last_block_too(tokens, cached, block_size):
    """Hashes every token: matches the last token's block when it is full, leaving no token to compute."""
    return testing._longest_cached_prefix_ref(tokens + [0], cached, block_size)


def evicting_before_the_free_list_is_used_up(free, ops):
    """Ignores the free list: every block a take needs is evicted from the cache, free blocks or not."""
    return testing._lru_evictions_ref([], ops)


def hashes_with_the_partial_last_block(tokens, block_size):
    """Pads a partial last block with zeros and hashes it: one hash too many unless block_size divides the length."""
    return testing._chain_hashes_ref(tokens + [0] * (-len(tokens) % block_size), block_size)


def hashes_chained_from_another_root(tokens, block_size):
    """Starts the chain from parent -1, not the root hash 0: every hash differs."""
    return [h for h, _ in mi.core.prefix_cache.block_keys(tokens, block_size, parent=-1)]


def prefix_skipping_a_missing_block(tokens, cached, block_size):
    """Goes on past a missing block: returns cached blocks after the gap, which are no prefix."""
    return [cached[h] for h in testing._chain_hashes_ref(tokens[:-1], block_size) if h in cached]


def prefix_by_unchained_hashes(tokens, cached, block_size):
    """Looks blocks up by their own tokens' hash, not the chain's: a block never matches the cache's keys."""
    blocks = []
    for h in hashes_without_the_chain(tokens[:-1], block_size):
        if h not in cached:
            break
        blocks.append(cached[h])
    return blocks


def lru_order_reversed(free, ops):
    """Puts each released block at the front of the LRU list: evicts the most recently released first."""
    lru, evicted = [], []
    for op, arg in ops:
        if op == "release":
            lru.insert(0, arg)
        elif op == "hit":
            if arg in lru:
                lru.remove(arg)
        else:
            use = min(arg, len(free))
            del free[:use]
            evicted += lru[:arg - use]
            del lru[:arg - use]
    return evicted


def evicting_blocks_still_hit(free, ops):
    """Ignores hits: a cached block that a request reuses stays evictable, and is evicted while in use."""
    return testing._lru_evictions_ref(free, [(op, arg) for op, arg in ops if op != "hit"])


def prefill_one_prompt_a_step(num_decoders, prompt_lens, budget):
    """Gives each step to one prompt only: what a finished prompt leaves of the budget goes unused."""
    steps = []
    for i, n in enumerate(prompt_lens):
        while n:
            take = min(n, budget - num_decoders)
            steps.append([take if j == i else 0 for j in range(len(prompt_lens))])
            n -= take
    return steps


def prefill_counting_decoders_once(num_decoders, prompt_lens, budget):
    """Takes the decoders' tokens out of the first step only: later steps give the prompts the whole budget."""
    first = testing._prefill_plan_ref(num_decoders, prompt_lens, budget)[:1]
    done = [sum(col) for col in zip(*first)] if first else []
    return first + testing._prefill_plan_ref(0, [n - d for n, d in zip(prompt_lens, done)], budget)


def prefill_before_decodes(num_decoders, prompt_lens, budget):
    """Leaves no room for the decoders: the prompts get the whole budget every step."""
    return testing._prefill_plan_ref(0, prompt_lens, budget)


# (the check, the wrong answer)
MUTANTS = [
    (testing.check_chain_hashes, hashes_without_the_chain),
    (testing.check_chain_hashes, hashes_with_the_partial_last_block),
    (testing.check_chain_hashes, hashes_chained_from_another_root),
    (testing.check_longest_cached_prefix, prefix_matching_the_last_block_too),
    (testing.check_longest_cached_prefix, prefix_skipping_a_missing_block),
    (testing.check_longest_cached_prefix, prefix_by_unchained_hashes),
    (testing.check_lru_evictions, evicting_before_the_free_list_is_used_up),
    (testing.check_lru_evictions, lru_order_reversed),
    (testing.check_lru_evictions, evicting_blocks_still_hit),
    (testing.check_prefill_plan, prefill_before_decodes),
    (testing.check_prefill_plan, prefill_one_prompt_a_step),
    (testing.check_prefill_plan, prefill_counting_decoders_once),
]
