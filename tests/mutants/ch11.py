"""Wrong answers to problem set 11 that its checks must reject: each named (or documented) for its mistake."""



from miniinfer.course import checks as testing


def shard_interleaved(w, rank, size, by):  # every size-th row or column: not a consecutive share
    return w[rank::size] if by == "output" else w[:, rank::size]


def shard_by_the_other_dimension(w, rank, size, by):
    """Cuts columns for by="output" and rows for by="input": column- and row-parallel swapped."""
    return testing._shard_linear_ref(w, rank, size, "input" if by == "output" else "output")


def lookup_without_zeros(ids, share, start):
    """Clamps ids outside the share to its first or last row instead of returning zeros for them."""
    return share[(ids - start).clamp(0, share.shape[0] - 1)]


def lookup_one_row_too_many(ids, share, start):
    """Keeps local ids up to len(share), not len(share) - 1: the id just past the share gets its last row."""
    local = ids - start
    mine = (local >= 0) & (local <= share.shape[0])
    return share[local.clamp(0, share.shape[0] - 1)] * mine[..., None]


def reduce_everything(module):
    """An all-reduce after every module: sums the split outputs of qkv_proj and gate_up_proj, and the LM head's."""
    return "all_reduce"


def gather_the_attention(module):
    """All-gathers after qkv_proj, where each rank's own heads are all its attention needs."""
    return "all_gather" if module == "qkv_proj" else testing.COLLECTIVES[module]


def kv_share_without_replication(rank, size, num_kv_heads):
    """Fewer KV heads than ranks: gives rank r head r, not r * n // size; ranks r >= n get a head that is not there."""
    n = max(1, num_kv_heads // size)
    return rank * n, (rank + 1) * n


def kv_round_robin(rank, size, num_kv_heads):
    """Fewer KV heads than ranks: gives rank r head r % n, not r * n // size; right only with one KV head."""
    if num_kv_heads >= size:
        return kv_share_without_replication(rank, size, num_kv_heads)
    return rank % num_kv_heads, rank % num_kv_heads + 1


def shard_counted_from_the_end(w, rank, size, by):  # rank 0 takes the last share
    return testing._shard_linear_ref(w, size - 1 - rank, size, by)


def lookup_from_the_vocabulary_start(ids, share, start):  # the share's rows read as rows 0..
    mine = (ids >= start) & (ids < start + share.shape[0])
    return share[ids.clamp(0, share.shape[0] - 1)] * mine[..., None]


def reduce_the_head_too(module):  # the LM head's pieces summed, not put side by side
    return "all_reduce" if module == "lm_head" else testing.COLLECTIVES[module]


def kv_heads_of_rank_0(rank, size, num_kv_heads):  # every rank the share of rank 0
    return kv_share_without_replication(0, size, num_kv_heads) if num_kv_heads >= size else (0, 1)


# (the check, the wrong answer)
MUTANTS = [
    (testing.check_shard_linear, shard_interleaved),
    (testing.check_shard_linear, shard_by_the_other_dimension),
    (testing.check_vocab_lookup, lookup_without_zeros),
    (testing.check_vocab_lookup, lookup_one_row_too_many),
    (testing.check_collective_after, reduce_everything),
    (testing.check_collective_after, gather_the_attention),
    (testing.check_kv_heads_for, kv_share_without_replication),
    (testing.check_kv_heads_for, kv_round_robin),
    (testing.check_shard_linear, shard_counted_from_the_end),
    (testing.check_vocab_lookup, lookup_from_the_vocabulary_start),
    (testing.check_collective_after, reduce_the_head_too),
    (testing.check_kv_heads_for, kv_heads_of_rank_0),
]
