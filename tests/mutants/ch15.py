"""Wrong answers to problem set 15 that its checks must reject: each named (or documented) for its mistake."""

import torch

from miniinfer.course import checks as testing


def gather_in_pool_order(pools, block_ids):
    """Gathers the blocks in the order of their ids in the pool, not the table's: the prompt's blocks shuffled."""
    return torch.stack([pool[:, sorted(block_ids)] for pool in pools])


def gather_keys_only(pools, block_ids):
    """Sends the first pool alone: the values never leave (right only for chapter 14's keys-only pool)."""
    return torch.stack([pools[0][:, block_ids]])


def gather_all_but_the_last_block(pools, block_ids):
    """Leaves the last block out, as if it were not full: its tokens' K/V never arrive."""
    return torch.stack([pool[:, block_ids[:-1]] for pool in pools])


def scatter_into_the_first_blocks(pools, block_ids, kv):
    """Writes into blocks 0, 1, 2, ... of the pool: the decode engine's own block table is ignored."""
    for pool, part in zip(pools, kv):
        pool[:, :len(block_ids)] = part


def scatter_in_pool_order(pools, block_ids, kv):
    """Writes the i-th block into the i-th smallest id: the table's order lost on the way in."""
    for pool, part in zip(pools, kv):
        pool[:, sorted(block_ids)] = part


def scatter_keys_only(pools, block_ids, kv):
    """Scatters the first pool's part alone: the decode engine's values stay what they were."""
    pools[0][:, block_ids] = kv[0]


def bytes_of_whole_tokens(cfg, num_tokens, block_size, itemsize, gbps, latency_s):
    """Counts the prompt's tokens, not its blocks: the last block goes whole, however full."""
    import miniinfer as mi
    nbytes = num_tokens * mi.read_config(cfg).cache_bytes_per_token(itemsize)
    return nbytes, latency_s + nbytes / (gbps * 1e9)


def keys_without_values(cfg, num_tokens, block_size, itemsize, gbps, latency_s):
    """Counts a key per KV head and no value: half the bytes of a grouped-query model's blocks."""
    import miniinfer as mi
    per = mi.read_config(cfg).cache_bytes_per_token(itemsize)
    per = per if "kv_lora_rank" in cfg else per // 2
    nbytes = -(-num_tokens // block_size) * block_size * per
    return nbytes, latency_s + nbytes / (gbps * 1e9)


def gigabytes_as_gibibytes(cfg, num_tokens, block_size, itemsize, gbps, latency_s):
    """Reads GB/s as 2^30 bytes a second: every transfer 7% short."""
    import miniinfer as mi
    nbytes = -(-num_tokens // block_size) * block_size * mi.read_config(cfg).cache_bytes_per_token(itemsize)
    return nbytes, latency_s + nbytes / (gbps * 2**30)


def latency_forgotten(cfg, num_tokens, block_size, itemsize, gbps, latency_s):
    """Leaves the fixed latency out: a small prompt's transfer looks free."""
    import miniinfer as mi
    nbytes = -(-num_tokens // block_size) * block_size * mi.read_config(cfg).cache_bytes_per_token(itemsize)
    return nbytes, nbytes / (gbps * 1e9)


def hand_on_every_length(max_tokens, finish_reason, aborted):
    """Hands on every request that ended by length, also one that asked for one token: the decode engine
    then waits for K/V that never comes."""
    handed = finish_reason == "length"
    return ["decode"] * handed + ["abort decode"] * (handed and aborted) + ["client"] * (not aborted)


def answer_the_client_who_left(max_tokens, finish_reason, aborted):
    """Passes the output on even when the client has left: a reused request id gets another's tokens."""
    handed = finish_reason == "length" and max_tokens > 1
    return ["decode"] * handed + ["abort decode"] * (handed and aborted) + ["client"]


def no_abort_on_the_decode_side(max_tokens, finish_reason, aborted):
    """Forgets to abort on the decode side a request handed on after its client left: it is decoded to the
    end for nobody."""
    handed = finish_reason == "length" and max_tokens > 1
    return ["decode"] * handed + ["client"] * (not aborted)


# (the check, the wrong answer)
MUTANTS = [
    (testing.check_gather_blocks, gather_in_pool_order),
    (testing.check_gather_blocks, gather_keys_only),
    (testing.check_gather_blocks, gather_all_but_the_last_block),
    (testing.check_scatter_blocks, scatter_into_the_first_blocks),
    (testing.check_scatter_blocks, scatter_in_pool_order),
    (testing.check_scatter_blocks, scatter_keys_only),
    (testing.check_transfer_time, bytes_of_whole_tokens),
    (testing.check_transfer_time, keys_without_values),
    (testing.check_transfer_time, gigabytes_as_gibibytes),
    (testing.check_transfer_time, latency_forgotten),
    (testing.check_after_prefill, hand_on_every_length),
    (testing.check_after_prefill, answer_the_client_who_left),
    (testing.check_after_prefill, no_abort_on_the_decode_side),
]
