"""Wrong answers to problem set 05 that its checks must reject: each named (or documented) for its mistake."""

import math

import torch

import miniinfer as mi
from miniinfer.course import checks as testing


def merge_taking_the_max_lse(o1, lse1, o2, lse2):
    """Returns max(lse1, lse2), not their log-sum-exp: the merged lse is too small by up to log 2."""
    o, _ = testing._merge_partials_ref(o1, lse1, o2, lse2)
    return o, torch.maximum(lse1, lse2)


def merge_by_averaging(o1, lse1, o2, lse2):
    """Averages o1 and o2 with equal weights, not weights exp(lse_i - lse): right only when lse1 == lse2."""
    _, lse = testing._merge_partials_ref(o1, lse1, o2, lse2)
    return (o1 + o2) / 2, lse


def merge_with_swapped_weights(o1, lse1, o2, lse2):
    """Weights each part by the other part's share: the part with the smaller lse counts most."""
    lse = torch.logaddexp(lse1, lse2)
    return o1 * (lse2 - lse).exp()[..., None] + o2 * (lse1 - lse).exp()[..., None], lse


def decode_program_softmax_without_max(q, k_cache, v_cache, table, start, end, scale):
    """exp of the raw scores, no maximum subtracted: scores in the hundreds overflow to inf and NaN."""
    bs, pos = k_cache.shape[1], torch.arange(start, end)
    slots = torch.tensor(table)[pos // bs] * bs + pos % bs
    e = ((q @ k_cache.flatten(0, 1)[slots].T) * scale).exp()
    return (e / e.sum(-1, keepdim=True)) @ v_cache.flatten(0, 1)[slots], e.sum(-1).log()


def decode_program_one_token_too_far(q, k_cache, v_cache, table, start, end, scale):
    """Reads tokens start..end, one past end - 1: that slot's NaN spoils the result."""
    end = min(end + 1, len(table) * k_cache.shape[1])
    return testing._decode_program_ref(q, k_cache, v_cache, table, start, end, scale)


def decode_program_from_zero(q, k_cache, v_cache, table, start, end, scale):
    """Ignores start: reads tokens 0..end-1, not only this program's piece start..end-1."""
    return testing._decode_program_ref(q, k_cache, v_cache, table, 0, end, scale)


def decode_program_lse_in_base_2(q, k_cache, v_cache, table, start, end, scale):
    """Returns the log-sum-exp in base 2 (divided by ln 2), not the natural log."""
    o, lse = testing._decode_program_ref(q, k_cache, v_cache, table, start, end, scale)
    return o, lse / math.log(2)


def merge_splits_by_mean(part, lse):
    """Takes the plain mean of the splits, ignoring their lse weights (empty splits included)."""
    return part.mean(-2)


def merge_splits_counting_empty_as_zero(part, lse):
    """Reads an empty split's lse -inf as 0: it gets a weight, and its zeros pull the result toward 0."""
    return testing._merge_splits_ref(part, lse.nan_to_num(neginf=0.0))


def merge_splits_first_only(part, lse):
    """Returns split 0 alone: right only when the other splits are empty."""
    return part[:, 0].clone()


def store_kv_minus_one_to_the_last_slot(k, v, k_cache, v_cache, slot_mapping):
    """Indexes with slot -1 too: tokens that must be written nowhere overwrite the pool's last slot."""
    k_cache.flatten(0, 1)[slot_mapping] = k
    v_cache.flatten(0, 1)[slot_mapping] = v


def store_kv_keys_into_both(k, v, k_cache, v_cache, slot_mapping):
    """Writes the keys into the value cache too."""
    mi.store_kv_ref(k, k, k_cache, v_cache, slot_mapping)


def store_kv_block_and_offset_swapped(k, v, k_cache, v_cache, slot_mapping):
    """Block = slot % num_blocks, offset = slot // num_blocks, not slot // block_size and slot % block_size."""
    keep = slot_mapping >= 0
    s = slot_mapping[keep]
    nb = k_cache.shape[0]
    for cache, x in ((k_cache, k), (v_cache, v)):
        cache[s % nb, (s // nb) % cache.shape[1]] = x[keep]


# (the check, the wrong answer)
MUTANTS = [
    (testing.check_merge_partials, merge_taking_the_max_lse),
    (testing.check_merge_partials, merge_by_averaging),
    (testing.check_merge_partials, merge_with_swapped_weights),
    (testing.check_decode_program, decode_program_one_token_too_far),
    (testing.check_decode_program, decode_program_from_zero),
    (testing.check_decode_program, decode_program_lse_in_base_2),
    (testing.check_decode_program, decode_program_softmax_without_max),
    (testing.check_merge_splits, merge_splits_by_mean),
    (testing.check_merge_splits, merge_splits_counting_empty_as_zero),
    (testing.check_merge_splits, merge_splits_first_only),
    (testing.check_store_kv, store_kv_minus_one_to_the_last_slot),
    (testing.check_store_kv, store_kv_keys_into_both),
    (testing.check_store_kv, store_kv_block_and_offset_swapped),
]
