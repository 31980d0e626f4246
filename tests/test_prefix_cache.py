"""Prefix caching in the block manager: a hypothesis state machine over allocate / append / fork /
free / cache, the cases engines have broken on, and the radix-tree reference."""

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from conftest import unchanged_on_error

from miniinfer.prefix_cache import ROOT_HASH, PrefixCachingBlockManager, chain_hash
from miniinfer.radix import RadixTree, common_prefix

IDS = st.integers(0, 5)
# Few distinct tokens and short prompts, so that prefixes repeat and the cache gets hits.
PROMPTS = st.lists(st.integers(0, 2), min_size=1, max_size=14)


def state(bm: PrefixCachingBlockManager) -> tuple:
    return (sorted(bm.free_list), list(bm.ref_count), copy.deepcopy(bm.tables), dict(bm.lengths),
            dict(bm.cached), dict(bm.key), list(bm.evictable), copy.deepcopy(bm.hashes))


class PrefixCacheMachine(RuleBasedStateMachine):
    """Each sequence's tokens are tracked beside the manager; after every step its computed blocks
    are registered, as the engine does after a model step."""

    def __init__(self):
        super().__init__()
        self.bm = PrefixCachingBlockManager(num_blocks=10, block_size=3)
        self.tokens: dict[int, list[int]] = {}

    def attempt(self, fn, *args):
        return unchanged_on_error(lambda: state(self.bm), fn, *args)

    def computed(self, s: int) -> None:
        self.bm.cache_blocks(s, self.tokens[s])

    @rule(s=IDS, prompt=PROMPTS)
    def allocate(self, s, prompt):
        if self.attempt(self.bm.allocate, s, len(prompt), prompt) is not None:
            assert self.bm.num_cached_tokens(s) < len(prompt)  # the last token is always computed
            self.tokens[s] = list(prompt)
            self.computed(s)

    @rule(s=IDS, token=st.integers(0, 2))
    def append(self, s, token):
        if s in self.tokens and self.bm.can_append(s):
            self.bm.append_token(s)
            self.tokens[s].append(token)
            self.computed(s)

    @rule(parent=IDS, child=IDS)
    def fork(self, parent, child):
        if self.attempt(self.bm.fork, parent, child) is not None:
            self.tokens[child] = list(self.tokens[parent])

    @rule(s=IDS)
    def free(self, s):
        if s in self.tokens:
            self.bm.free(s)
            del self.tokens[s]
        else:
            self.attempt(self.bm.free, s)

    @precondition(lambda self: not self.tokens)
    @rule()
    def all_free(self):
        assert self.bm.num_free_blocks == self.bm.num_blocks

    @invariant()
    def consistent(self):
        bm = self.bm
        held = [b for t in bm.tables.values() for b in t]
        for b in range(bm.num_blocks):
            assert bm.ref_count[b] == held.count(b)
        # Every block is exactly one of: on the free list, cached and unused, in use.
        assert sorted(bm.free_list + list(bm.evictable) + sorted(set(held))) == list(range(bm.num_blocks))
        assert bm.num_free_blocks == bm.num_blocks - len(set(held))
        assert set(bm.evictable) <= set(bm.key) and not set(bm.free_list) & set(bm.key)
        assert {b: h for h, b in bm.cached.items()} == {b: chain_hash(*k) for b, k in bm.key.items()}
        # A cached block in use holds the tokens of its user at that position, after the same
        # prefix: its key is (the hash of the user's preceding blocks, its tokens).
        for s, table in bm.tables.items():
            toks, size, parent = self.tokens[s], bm.block_size, ROOT_HASH
            for i, b in enumerate(table):
                block = tuple(toks[i * size:(i + 1) * size])
                if b in bm.key:
                    assert bm.key[b] == (parent, block)
                parent = chain_hash(parent, block)


PrefixCacheMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestPrefixCacheMachine = PrefixCacheMachine.TestCase


def test_second_request_reuses_the_shared_prefix_and_computes_its_last_token():
    bm = PrefixCachingBlockManager(num_blocks=8, block_size=4)
    prompt = list(range(12))  # three full blocks
    bm.allocate("a", 12, prompt)
    bm.cache_blocks("a", prompt)
    bm.free("a")
    assert bm.num_free_blocks == 8  # cached but unused counts as free
    bm.allocate("b", 12, prompt)  # fully cached: the block of its last token is computed again
    assert bm.num_cached_tokens("b") == 8
    bm.allocate("c", 14, prompt + [20, 21])
    assert bm.num_cached_tokens("c") == 12 and bm.block_table("c")[:2] == bm.block_table("b")[:2]


def test_eviction_is_least_recently_used_and_forgets_the_hash():
    bm = PrefixCachingBlockManager(num_blocks=4, block_size=2)
    for name, prompt in (("a", [1, 2, 3]), ("b", [4, 5, 6])):
        bm.allocate(name, 3, prompt)
        bm.cache_blocks(name, prompt)
    bm.free("a")  # a's first block is now the least recently used cached block
    bm.free("b")
    bm.allocate("c", 3, [7, 8, 9])  # 2 blocks: the never-cached free ones go first
    bm.allocate("d", 1, [7])        # then a's cached block is evicted
    assert bm.match([1, 2, 3]) == [] and len(bm.match([4, 5, 6])) == 1


def test_a_different_prefix_never_hits_even_with_an_equal_block():
    bm = PrefixCachingBlockManager(num_blocks=8, block_size=2)
    bm.allocate("a", 5, [1, 2, 3, 4, 0])
    bm.cache_blocks("a", [1, 2, 3, 4, 0])
    assert bm.match([9, 9, 3, 4, 0]) == []  # block [3, 4] is cached, but after [1, 2]
    assert len(bm.match([1, 2, 3, 4, 5])) == 2


@pytest.mark.parametrize("bad", [dict(num_tokens=3, token_ids=[1, 2]), dict(num_tokens=0, token_ids=[])])
def test_bad_allocation_changes_nothing(bad):
    bm = PrefixCachingBlockManager(num_blocks=4, block_size=2)
    before = state(bm)
    with pytest.raises(ValueError):
        bm.allocate("a", **bad)
    assert state(bm) == before


@settings(max_examples=300, deadline=None)
@given(stored=st.lists(st.lists(st.integers(0, 2), max_size=12), max_size=8),
       query=st.lists(st.integers(0, 2), max_size=12))
def test_radix_tree_matches_the_longest_stored_prefix(stored, query):
    tree = RadixTree()
    for tokens in stored:
        tree.insert(tokens)
    assert tree.match(query) == max((common_prefix(query, t) for t in stored), default=0)
    assert tree.num_tokens() == len({tuple(t[:i]) for t in stored for i in range(1, len(t) + 1)})
