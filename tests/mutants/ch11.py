"""Wrong answers to problem set 11 that its checks must reject: each named (or documented) for its mistake."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from miniinfer.course import checks as testing
from miniinfer.layers.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    Shard,
    VocabParallelEmbedding,
)


class ColumnWithoutTheShapes(ColumnParallelLinear):  # a piece of another model's shape sliced silently
    def load_weight(self, name, tensors):
        return torch.cat([t[rows] for t, rows in zip(tensors, self.rows)])


class ColumnCountingRowsOnly(ColumnParallelLinear):  # a weight with an extra input column goes through
    def load_weight(self, name, tensors):
        if any(t.get_shape()[0] != n for t, n in zip(tensors, self.sizes)):
            raise ValueError("a piece of another size")
        return torch.cat([t[rows] for t, rows in zip(tensors, self.rows)])


class ColumnCheckingTheFirstPiece(ColumnParallelLinear):  # q checked, k and v taken on trust
    def load_weight(self, name, tensors):
        shape = [self.sizes[0], self.in_features] if name == "weight" else [self.sizes[0]]
        if list(tensors[0].get_shape()) != shape:
            raise ValueError("q of another shape")
        return torch.cat([t[rows] for t, rows in zip(tensors, self.rows)])


class ColumnOfTheFirstPieceOnly(ColumnParallelLinear):  # q's rows, and k's and v's left out
    def load_weight(self, name, tensors):
        return tensors[0][self.rows[0]]


class ColumnWithTheFirstPiecesRows(ColumnParallelLinear):
    """Cuts every piece at q's rows: right while the pieces are the same size (gate, up), not for k and v."""
    def load_weight(self, name, tensors):
        return torch.cat([t[self.rows[0]] for t in tensors])


class ColumnWithTheWholeBias(ColumnParallelLinear):  # the weight's rows cut, the bias's forgotten
    def load_weight(self, name, tensors):
        rows = self.rows if name == "weight" else [slice(None)] * len(tensors)
        return torch.cat([t[r] for t, r in zip(tensors, rows)])


class RowWithoutTheSum(RowParallelLinear):  # each rank's partial sum returned as if it were the output
    def load_weight(self, name, tensors):
        return testing_row_load(self, name, tensors)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class RowWithTheBiasOnEveryRank(RowParallelLinear):  # summed over the ranks, the bias counts twice
    def load_weight(self, name, tensors):
        return tensors[0][:] if name == "bias" else tensors[0][:, self.columns]

    def forward(self, x):
        out = F.linear(x, self.weight, self.bias)
        dist.all_reduce(out)
        return out


class RowWithTheRanksRows(RowWithTheBiasOnEveryRank):  # the column-parallel cut: the rank's output rows
    def load_weight(self, name, tensors):
        return testing_row_load(self, name, tensors) if name == "bias" else tensors[0][self.columns]


def testing_row_load(layer, name, tensors):
    """The right load_weight, for the mutants whose mistake is in forward."""
    if name == "bias":
        bias = tensors[0][:]
        return bias if layer.first else torch.zeros_like(bias)
    return tensors[0][:, layer.columns]


class RowReducedBeforeTheBias(RowWithoutTheSum):
    """Adds the bias after the all-reduce, on every rank: rank 0's is right, the others' (zeros) miss it."""
    def forward(self, x):
        out = F.linear(x, self.weight)
        dist.all_reduce(out)
        return out + self.bias if self.bias is not None else out


class EmbeddingRowsNotPadded(VocabParallelEmbedding):  # the last share short of per_rank rows
    def load_weight(self, name, tensors):
        return tensors[0][self.start:min(self.start + self.per_rank, self.vocab_size)]


class EmbeddingPaddedInFront(VocabParallelEmbedding):  # the zero rows before the share's rows
    def load_weight(self, name, tensors):
        rows = tensors[0][self.start:min(self.start + self.per_rank, self.vocab_size)]
        return F.pad(rows, (0, 0, self.per_rank - rows.shape[0], 0))


class EmbeddingRowsFromZero(VocabParallelEmbedding):  # every rank loads the first rows: start left out
    def load_weight(self, name, tensors):
        return tensors[0][:self.per_rank]


class EmbeddingWithoutTheSum(VocabParallelEmbedding):  # each rank keeps only its own ids' rows
    def forward(self, ids):
        local = ids - self.start
        mine = (local >= 0) & (local < self.per_rank)
        return self.weight[local.clamp(0, self.per_rank - 1)] * mine[..., None]


class EmbeddingWithoutZeros(VocabParallelEmbedding):  # other ranks' ids clamped onto this share's edge rows
    def forward(self, ids):
        out = self.weight[(ids - self.start).clamp(0, self.per_rank - 1)]
        dist.all_reduce(out)
        return out


class EmbeddingOneRowTooMany(VocabParallelEmbedding):  # local id per_rank counted as this rank's (<=)
    def forward(self, ids):
        local = ids - self.start
        mine = (local >= 0) & (local <= self.per_rank)
        out = self.weight[local.clamp(0, self.per_rank - 1)] * mine[..., None]
        dist.all_reduce(out)
        return out


class EmbeddingFromRowZero(VocabParallelEmbedding):  # global ids read as rows of the share
    def forward(self, ids):
        mine = (ids >= self.start) & (ids < self.start + self.per_rank)
        out = self.weight[ids.clamp(0, self.per_rank - 1)] * mine[..., None]
        dist.all_reduce(out)
        return out


class HeadWithThePadding(ParallelLMHead):  # the padding rows' logits left on: vocab rounded up to the ranks
    def forward(self, h):
        local = F.linear(h, self.weight)
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local)
        return torch.cat(parts, dim=-1)


class HeadReduced(ParallelLMHead):  # the ranks' logits of different rows summed instead of put side by side
    def forward(self, h):
        local = F.linear(h, self.weight)
        dist.all_reduce(local)
        return local[..., :self.vocab_size]


class HeadInReverse(ParallelLMHead):  # the parts put side by side last rank first
    def forward(self, h):
        local = F.linear(h, self.weight)
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local)
        return torch.cat(parts[::-1], dim=-1)[..., :self.vocab_size]


class PartOneShort(Shard):  # the share's last thing left out
    def part(self, n):
        step = n // self.size
        return slice(self.rank * step, (self.rank + 1) * step - 1)


class PartInReverse(Shard):
    """Rank 0 gets the last share (the layers agree, so the tokens would not tell; a sharded checkpoint would)."""
    def part(self, n):
        step = n // self.size
        return slice(n - (self.rank + 1) * step, n - self.rank * step)


class PartWhole(Shard):  # every rank keeps all n: the work not split
    def part(self, n):
        return slice(0, n)


class ShardWithoutReplication(Shard):  # fewer KV heads than ranks: n // size = 0 heads for everyone
    def kv_heads(self, n):
        return self.part(n)


class ShardOneHeadEach(Shard):  # as if every model had fewer KV heads than ranks: one head a rank, always
    def kv_heads(self, n):
        head = self.rank * n // self.size
        return slice(head, head + 1)


class ShardRoundRobin(Shard):
    """Fewer KV heads than ranks: rank r gets head r % n, not r * n // size; right only with one KV head."""
    def kv_heads(self, n):
        if n >= self.size:
            return self.part(n)
        return slice(self.rank % n, self.rank % n + 1)


class ShardOfRankZero(Shard):  # every rank the share of rank 0
    def kv_heads(self, n):
        return Shard(0, self.size).kv_heads(n)


# (the check, the wrong answer)
MUTANTS = [
    (testing.check_column, ColumnWithoutTheShapes),
    (testing.check_column, ColumnCountingRowsOnly),
    (testing.check_column, ColumnCheckingTheFirstPiece),
    (testing.check_column, ColumnOfTheFirstPieceOnly),
    (testing.check_column, ColumnWithTheFirstPiecesRows),
    (testing.check_column, ColumnWithTheWholeBias),
    (testing.check_row, RowWithoutTheSum),
    (testing.check_row, RowWithTheBiasOnEveryRank),
    (testing.check_row, RowWithTheRanksRows),
    (testing.check_row, RowReducedBeforeTheBias),
    (testing.check_embedding, EmbeddingRowsNotPadded),
    (testing.check_embedding, EmbeddingPaddedInFront),
    (testing.check_embedding, EmbeddingRowsFromZero),
    (testing.check_embedding, EmbeddingWithoutTheSum),
    (testing.check_embedding, EmbeddingWithoutZeros),
    (testing.check_embedding, EmbeddingOneRowTooMany),
    (testing.check_embedding, EmbeddingFromRowZero),
    (testing.check_lm_head, HeadWithThePadding),
    (testing.check_lm_head, HeadReduced),
    (testing.check_lm_head, HeadInReverse),
    (testing.check_shard, PartOneShort),
    (testing.check_shard, PartInReverse),
    (testing.check_shard, PartWhole),
    (testing.check_shard, ShardWithoutReplication),
    (testing.check_shard, ShardRoundRobin),
    (testing.check_shard, ShardOfRankZero),
    (testing.check_shard, ShardOneHeadEach),
]
