"""Prefix caching in the block manager: a hypothesis state machine over allocate / append / truncate /
fork / free / cache, the cases engines have broken on, and the radix-tree reference."""

import copy

import pytest
from conftest import unchanged_on_error
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from miniinfer.core.prefix_cache import ROOT_HASH, PrefixCachingBlockManager, chain_hash
from miniinfer.core.sampling_params import SamplingParams
from miniinfer.core.sequence import Sequence
from miniinfer.course.radix import RadixTree, common_prefix

IDS = st.integers(0, 5)
# Few distinct tokens and short prompts, so that prefixes repeat and the cache gets hits.
PROMPTS = st.lists(st.integers(0, 2), min_size=1, max_size=14)


def state(bm: PrefixCachingBlockManager) -> tuple:
    def by_id(d: dict) -> dict:  # sequences are keys by identity: a copy of one is another key
        return {s.request_id: copy.copy(v) for s, v in d.items()}

    return (sorted(bm.free_list), list(bm.ref_count), by_id(bm.tables), by_id(bm.lengths),
            dict(bm.cached), dict(bm.key), list(bm.evictable), by_id(bm.num_registered))


def computed(name: str, tokens: list[int]) -> Sequence:
    """A request whose tokens have all been computed (as after its steps in the engine)."""
    seq = Sequence(name, list(tokens), SamplingParams())
    seq.num_computed_tokens = len(tokens)
    return seq


def admit(bm: PrefixCachingBlockManager, seq: Sequence) -> list[int]:
    """Allocate seq as the scheduler admits it: its cached prefix shared; then its blocks cached."""
    hits = bm.match(seq)
    bm.allocate(seq, seq.num_tokens, hits)
    bm.cache_blocks(seq)
    return hits


class PrefixCacheMachine(RuleBasedStateMachine):
    """Each sequence's computed blocks are registered after every change, as the engine does after
    a model step."""

    def __init__(self):
        super().__init__()
        self.bm = PrefixCachingBlockManager(num_blocks=10, block_size=3)
        self.seqs: dict[int, Sequence] = {}

    def attempt(self, fn, *args):
        return unchanged_on_error(lambda: state(self.bm), fn, *args)

    @rule(s=IDS, prompt=PROMPTS)
    def allocate(self, s, prompt):
        seq = self.seqs.get(s) or computed(str(s), prompt)
        hits = self.bm.match(seq)
        if self.attempt(self.bm.allocate, seq, seq.num_tokens, hits) is not None:
            assert len(hits) * self.bm.block_size < seq.num_tokens  # the last token is always computed
            assert self.bm.block_table(seq)[:len(hits)] == hits
            self.bm.cache_blocks(seq)
            self.seqs[s] = seq

    @rule(s=IDS, token=st.integers(0, 2))
    def append(self, s, token):
        seq = self.seqs.get(s)
        if seq is not None and self.bm.can_append(seq):
            self.bm.append_token(seq)  # copy on write, after a fork
            seq.output_token_ids.append(token)
            seq.num_computed_tokens += 1
            self.bm.cache_blocks(seq)

    @rule(s=IDS, data=st.data())
    def truncate(self, s, data):
        seq = self.seqs.get(s)
        if seq is not None:
            n = data.draw(st.integers(1, seq.num_tokens))
            self.bm.truncate(seq, n)
            seq.prompt_token_ids, seq.output_token_ids = seq.token_ids(0, n), []
            seq.num_computed_tokens = n

    @rule(parent=IDS, child=IDS)
    def fork(self, parent, child):
        if parent not in self.seqs:
            return
        p = self.seqs[parent]
        c = self.seqs.get(child) or computed(str(child), p.token_ids(0, p.num_tokens))
        if self.attempt(self.bm.fork, p, c) is not None:
            self.seqs[child] = c

    @rule(s=IDS)
    def free(self, s):
        if s in self.seqs:
            self.bm.free(self.seqs.pop(s))
        else:
            self.attempt(self.bm.free, computed(str(s), [0]))

    @precondition(lambda self: not self.seqs)
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
        for seq, table in bm.tables.items():
            toks, size, parent = seq.token_ids(0, seq.num_tokens), bm.block_size, ROOT_HASH
            assert bm.num_registered[seq] <= len(toks) // size
            for i, b in enumerate(table):
                block = tuple(toks[i * size:(i + 1) * size])
                if b in bm.key:  # (a block cut by truncate holds the first tokens of its key)
                    assert bm.key[b][0] == parent and bm.key[b][1][:len(block)] == block
                parent = chain_hash(parent, block)


PrefixCacheMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestPrefixCacheMachine = PrefixCacheMachine.TestCase


def test_second_request_reuses_the_shared_prefix_and_computes_its_last_token():
    bm = PrefixCachingBlockManager(num_blocks=8, block_size=4)
    prompt = list(range(12))  # three full blocks
    a = computed("a", prompt)
    admit(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 8  # cached but unused counts as free
    b, c = computed("b", prompt), computed("c", prompt + [20, 21])
    assert len(admit(bm, b)) == 2  # fully cached: the block of its last token is computed again
    assert len(admit(bm, c)) == 3 and bm.block_table(c)[:2] == bm.block_table(b)[:2]


def test_eviction_is_least_recently_used_and_forgets_the_hash():
    bm = PrefixCachingBlockManager(num_blocks=4, block_size=2)
    a, b = computed("a", [1, 2, 3]), computed("b", [4, 5, 6])
    for seq in (a, b):
        admit(bm, seq)
    bm.free(a)  # a's first block is now the least recently used cached block
    bm.free(b)
    admit(bm, computed("c", [7, 8, 9]))  # 2 blocks: the never-cached free ones go first
    admit(bm, computed("d", [7]))        # then a's cached block is evicted
    assert bm.match(computed("e", [1, 2, 3])) == [] and len(bm.match(computed("f", [4, 5, 6]))) == 1


def test_a_different_prefix_never_hits_even_with_an_equal_block():
    bm = PrefixCachingBlockManager(num_blocks=8, block_size=2)
    admit(bm, computed("a", [1, 2, 3, 4, 0]))
    assert bm.match(computed("b", [9, 9, 3, 4, 0])) == []  # block [3, 4] is cached, but after [1, 2]
    assert len(bm.match(computed("c", [1, 2, 3, 4, 5]))) == 2


@pytest.mark.parametrize("num_tokens", [0, 3])
def test_bad_allocation_changes_nothing(num_tokens):
    bm = PrefixCachingBlockManager(num_blocks=4, block_size=2)
    admit(bm, computed("a", [1, 2, 3, 4, 5]))
    hits = bm.match(computed("b", [1, 2, 3, 4, 5]))  # two blocks: 3 tokens cannot cover them
    before = state(bm)
    with pytest.raises(ValueError):
        bm.allocate(computed("b", [1]), num_tokens, hits)
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
