"""Wrong answers to problem set 03 that its checks must reject: each named (or documented) for its mistake."""


import torch

import miniinfer as mi
from miniinfer.core.block_manager import OutOfBlocks
from miniinfer.course import checks as testing


class Blocks:
    """A right answer to exercises 1 and 2 (the solution's), for the wrong ones to change."""

    def __init__(self, num_blocks, block_size):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_list, self.tables, self.lengths = list(range(num_blocks)), {}, {}

    @property
    def num_free_blocks(self):
        return len(self.free_list)

    def block_table(self, seq_id):
        return list(self.tables[seq_id])

    def num_tokens(self, seq_id):
        return self.lengths[seq_id]

    def blocks_for(self, num_tokens):
        return -(-num_tokens // self.block_size)

    def allocate(self, seq_id, num_tokens):
        if seq_id in self.tables:
            raise ValueError(seq_id)
        n = self.blocks_for(num_tokens)
        if n > len(self.free_list):
            raise OutOfBlocks(n)
        self.tables[seq_id] = [self.free_list.pop() for _ in range(n)]
        self.lengths[seq_id] = num_tokens

    def free(self, seq_id):
        self.free_list.extend(self.tables.pop(seq_id))
        del self.lengths[seq_id]

    def needs_block(self, seq_id):
        return self.lengths[seq_id] % self.block_size == 0

    def append_token(self, seq_id):
        if self.needs_block(seq_id):
            if not self.free_list:
                raise OutOfBlocks(1)
            self.tables[seq_id].append(self.free_list.pop())
        self.lengths[seq_id] += 1


class FreeLeaks(Blocks):
    """free forgets the table without returning its blocks: the free count never recovers."""

    def free(self, seq_id):
        del self.tables[seq_id], self.lengths[seq_id]


class FloorBlocks(Blocks):
    """Rounds the blocks a prompt needs down: no block for a partial last block (none at all under block_size)."""

    def blocks_for(self, num_tokens):
        return num_tokens // self.block_size


class PartialAllocation(Blocks):
    """Takes blocks one at a time and keeps them when the pool runs out: a failed allocate leaks blocks."""

    def allocate(self, seq_id, num_tokens):  # takes blocks one by one, keeps them when it runs out
        if seq_id in self.tables:
            raise ValueError(seq_id)
        table = []
        for _ in range(self.blocks_for(num_tokens)):
            if not self.free_list:
                raise OutOfBlocks(1)
            table.append(self.free_list.pop())
        self.tables[seq_id], self.lengths[seq_id] = table, num_tokens


class ReallocatesSilently(Blocks):
    """Allocating a sequence that already has blocks frees and reallocates it instead of raising ValueError."""

    def allocate(self, seq_id, num_tokens):
        if seq_id in self.tables:
            self.free(seq_id)
        super().allocate(seq_id, num_tokens)


class NeverGrows(Blocks):
    """append_token never adds a block: a sequence outgrows its table once its last block is full."""

    def needs_block(self, seq_id):
        return False


class GrowsOneTokenLate(Blocks):
    """Adds a block when the last block holds one token, not when it is full: the next block comes one token late."""

    def needs_block(self, seq_id):
        return self.lengths[seq_id] % self.block_size == 1 or self.block_size == 1


class BlockPerToken(Blocks):
    """Adds a new block for every appended token, not only when the last block is full."""

    def needs_block(self, seq_id):
        return True


def slots_from_zero(block_table, start, num_tokens, block_size):
    """Ignores start: maps tokens 0..num_tokens-1 instead of start..start+num_tokens-1."""
    return mi.slot_mapping(block_table, 0, num_tokens, block_size)


def slots_without_the_table(block_table, start, num_tokens, block_size):
    """Returns the positions as slots, as if the block table were 0, 1, 2, ..."""
    return torch.arange(start, start + num_tokens)


def slots_times_table_length(block_table, start, num_tokens, block_size):
    """Multiplies the block number by the table's length, not by block_size: right only when they are equal."""
    pos = torch.arange(start, start + num_tokens)
    return torch.tensor(block_table)[pos // block_size] * len(block_table) + pos % block_size


def gather_ignoring_tables(pool, block_tables, length):  # as if every table were 0, 1, 2, ...
    return pool.flatten(0, 1)[:length].expand(block_tables.shape[0], -1, -1, -1).clone()


def gather_one_short(pool, block_tables, length):
    """Zeroes the last position: gathers only the first length - 1 tokens."""
    out = mi.gather_kv(pool, block_tables, length)
    out[:, -1] = 0
    return out


def gather_blocks_by_offset(pool, block_tables, length):
    """Takes position p from table column p % width at offset p // width: deals tokens across blocks round-robin."""
    pos = torch.arange(length)
    slots = block_tables[:, pos % block_tables.shape[1]] * pool.shape[1] + pos // block_tables.shape[1] % pool.shape[1]
    return pool.flatten(0, 1)[slots]


# (the check, the wrong answer)
MUTANTS = [
    (testing.check_block_manager, FreeLeaks),
    (testing.check_block_manager, FloorBlocks),
    (testing.check_block_manager, PartialAllocation),
    (testing.check_block_manager, ReallocatesSilently),
    (testing.check_append_token, NeverGrows),
    (testing.check_append_token, GrowsOneTokenLate),
    (testing.check_append_token, BlockPerToken),
    (testing.check_slot_mapping, slots_from_zero),
    (testing.check_slot_mapping, slots_without_the_table),
    (testing.check_slot_mapping, slots_times_table_length),
    (testing.check_gather_kv, gather_ignoring_tables),
    (testing.check_gather_kv, gather_one_short),
    (testing.check_gather_kv, gather_blocks_by_offset),
]
