"""Property-based tests of the block manager: random allocate / append / append_slots / truncate / fork /
free sequences."""

import copy

import pytest
from conftest import unchanged_on_error
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from miniinfer import BlockCopy, BlockManager, OutOfBlocks

IDS = st.integers(0, 7)


def state(bm: BlockManager) -> tuple:
    return (sorted(bm.free_list), list(bm.ref_count), copy.deepcopy(bm.tables), dict(bm.lengths))


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=4)

    def attempt(self, fn, *args):
        return unchanged_on_error(lambda: state(self.bm), fn, *args)

    @rule(seq=IDS, n=st.integers(0, 30))
    def allocate(self, seq, n):
        ok = seq not in self.bm.tables and n >= 1 and self.bm.can_allocate(n)
        table = self.attempt(self.bm.allocate, seq, n)
        assert (table is not None) == ok
        if ok:
            assert len(table) == -(-n // 4) and self.bm.num_tokens(seq) == n

    @rule(seq=IDS)
    def append(self, seq):
        if seq not in self.bm.tables:
            with pytest.raises(KeyError):
                self.bm.append_token(seq)
            return
        can, n, table = self.bm.can_append(seq), self.bm.num_tokens(seq), self.bm.block_table(seq)
        shared_last = self.bm.ref_count[table[-1]] > 1
        before = state(self.bm)
        try:
            result = self.bm.append_token(seq)
        except OutOfBlocks:
            assert not can and state(self.bm) == before
            return
        assert can and self.bm.num_tokens(seq) == n + 1
        if n % 4 == 0:  # crossed a block boundary
            assert result is None and self.bm.block_table(seq)[:-1] == table
        elif shared_last:  # copy on write of the shared last block
            assert result == BlockCopy(table[-1], self.bm.block_table(seq)[-1])
            assert self.bm.ref_count[result.dst] == 1
        else:
            assert result is None and self.bm.block_table(seq) == table

    @rule(seq=IDS, n=st.integers(0, 9))
    def append_slots(self, seq, n):
        """The engine's growth: its sequences' last blocks are their own."""
        bm = self.bm
        if seq not in bm.tables or bm.ref_count[bm.tables[seq][-1]] > 1:
            return
        length, table = bm.num_tokens(seq), bm.block_table(seq)
        can = -(-(length + n) // 4) - len(table) <= bm.num_free_blocks
        new = self.attempt(bm.append_slots, seq, n)
        assert (new is not None) == can
        if can:
            assert bm.block_table(seq) == table + new and bm.num_tokens(seq) == length + n

    @rule(seq=IDS, data=st.data())
    def truncate(self, seq, data):
        bm = self.bm
        if seq not in bm.tables:
            return
        free, table, n = bm.num_free_blocks, bm.block_table(seq), data.draw(st.integers(0, bm.num_tokens(seq) + 1))
        if not 1 <= n <= bm.num_tokens(seq):
            before = state(bm)
            with pytest.raises(ValueError, match="num_tokens must be in"):
                bm.truncate(seq, n)
            assert state(bm) == before
            return
        bm.truncate(seq, n)
        keep = -(-n // 4)
        assert bm.block_table(seq) == table[:keep] and bm.num_tokens(seq) == n
        assert bm.num_free_blocks == free + sum(bm.ref_count[b] == 0 for b in table[keep:])

    @rule(parent=IDS, child=IDS)
    def fork(self, parent, child):
        ok = parent in self.bm.tables and child not in self.bm.tables
        table = self.attempt(self.bm.fork, parent, child)
        if ok:
            assert table == self.bm.block_table(parent) == self.bm.block_table(child)

    @rule(seq=IDS)
    def free(self, seq):
        known = seq in self.bm.tables
        self.attempt(self.bm.free, seq)
        assert seq not in self.bm.tables
        if not known:
            with pytest.raises(KeyError, match="never allocated, or already freed"):
                self.bm.free(seq)

    @invariant()
    def counts_add_up(self):
        bm = self.bm
        used = sum(1 for r in bm.ref_count if r > 0)
        assert bm.num_free_blocks + used == bm.num_blocks
        assert len(set(bm.free_list)) == len(bm.free_list)
        assert all(bm.ref_count[b] == 0 for b in bm.free_list)

    @invariant()
    def sharing_matches_reference_counts(self):
        holders = {}
        for table in self.bm.tables.values():
            assert len(set(table)) == len(table)
            for b in table:
                holders[b] = holders.get(b, 0) + 1
        for b in range(self.bm.num_blocks):
            assert self.bm.ref_count[b] == holders.get(b, 0)

    @invariant()
    def tables_cover_their_tokens(self):
        for seq, table in self.bm.tables.items():
            assert len(table) == -(-self.bm.lengths[seq] // 4)

    def teardown(self):
        for seq in list(self.bm.tables):
            self.bm.free(seq)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert sorted(self.bm.free_list) == list(range(self.bm.num_blocks))


TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


@given(n=st.integers(1, 100), bs=st.integers(1, 20))
def test_can_allocate_agrees_with_allocate(n, bs):
    bm = BlockManager(5, bs)
    if bm.can_allocate(n):
        assert len(bm.allocate("s", n)) == -(-n // bs)
    else:
        with pytest.raises(OutOfBlocks, match=f"{-(-n // bs)} blocks needed, 5 of 5 free"):
            bm.allocate("s", n)
        assert bm.num_free_blocks == 5


def test_clear_errors():
    bm = BlockManager(4, 2)
    bm.allocate("a", 1)
    with pytest.raises(ValueError, match="'a' is already allocated"):
        bm.allocate("a", 1)
    with pytest.raises(ValueError, match="'a' is already allocated"):
        bm.fork("a", "a")
    with pytest.raises(KeyError, match="'zzz' has no blocks"):
        bm.block_table("zzz")
    with pytest.raises(ValueError, match="num_tokens must be >= 1"):
        bm.allocate("b", 0)
    with pytest.raises(ValueError, match="num_blocks >= 1"):
        BlockManager(0, 16)
