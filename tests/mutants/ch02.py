"""Wrong answers to problem set 02 that its checks must reject: each named (or documented) for its mistake."""


import torch

import miniinfer as mi
from miniinfer.course import checks as testing
from miniinfer.model.transformer import causal_attention


def write_kv_one_slot_early(k_cache, v_cache, k, v, start):
    """Writes at start - 1: every token lands one slot early, over the one before; right only at start 0."""
    return mi.write_kv(k_cache, v_cache, k, v, max(start - 1, 0))


def write_kv_first_token_only(k_cache, v_cache, k, v, start):
    """Writes only the first of the T new tokens: wrong whenever T > 1."""
    return mi.write_kv(k_cache, v_cache, k[:, :1], v[:, :1], start)


def write_kv_keys_into_both(k_cache, v_cache, k, v, start):
    """Writes the keys into the value cache too."""
    return mi.write_kv(k_cache, v_cache, k, k, start)


def cached_attention_over_every_slot(q, k_cache, v_cache, length, scale):
    """Attends over all max_len slots, the empty ones past length included."""
    return causal_attention(q, k_cache, v_cache, scale, q_start=k_cache.shape[1] - 1)


def cached_attention_without_the_newest(q, k_cache, v_cache, length, scale):
    """Attends over slots 0..length-2: the newest token never sees its own key and value."""
    if length == 1:
        return torch.zeros_like(q)
    return causal_attention(q, k_cache[:, :length - 1], v_cache[:, :length - 1], scale, q_start=length - 2)


def cached_attention_without_scale(q, k_cache, v_cache, length, scale):
    """Leaves the scores unscaled (scale 1, not 1/sqrt(D)): the softmax comes out too sharp."""
    return causal_attention(q, k_cache[:, :length], v_cache[:, :length], 1.0, q_start=length - 1)


def right_pad(prompts, pad_id):
    """Pads on the right: a shorter prompt's last token is not in the last column, where the next token is read."""
    L = max(map(len, prompts))
    ids = torch.tensor([p + [pad_id] * (L - len(p)) for p in prompts])
    real = torch.tensor([[True] * len(p) + [False] * (L - len(p)) for p in prompts])
    return ids, real, (real.cumsum(1) - 1).clamp(min=0)


def left_pad_positions_from_the_row_start(prompts, pad_id):
    """Counts positions from the row's first column, padding included: a padded prompt does not start at 0."""
    ids, real, _ = mi.left_pad(prompts, pad_id)
    return ids, real, torch.arange(ids.shape[1]).expand_as(ids).clone()


def left_pad_with_zeros(prompts, pad_id):
    """Pads with 0 instead of pad_id: wrong whenever pad_id is not 0."""
    ids, real, positions = mi.left_pad(prompts, 0)
    return ids, real, positions


def waste_after_sorting(output_lens, batch_size):
    """Sorts the lengths before batching: measures a length-sorted schedule (less waste), not the arrival order."""
    return mi.static_batch_waste(sorted(output_lens), batch_size)


def waste_over_useful_slots(output_lens, batch_size):
    """Divides the wasted slots by the useful ones, not by all slots: too large, and can pass 1."""
    steps = useful = 0
    for i in range(0, len(output_lens), batch_size):
        batch = output_lens[i:i + batch_size]
        steps, useful = steps + len(batch) * max(batch), useful + sum(batch)
    return (steps - useful) / useful


def waste_with_full_last_batch(output_lens, batch_size):
    """Counts a short last batch as batch_size rows: its empty seats count as waste unless the batches divide evenly."""
    steps = useful = 0
    for i in range(0, len(output_lens), batch_size):
        batch = output_lens[i:i + batch_size]
        steps, useful = steps + batch_size * max(batch), useful + sum(batch)
    return 1 - useful / steps


# (the check, the wrong answer)
MUTANTS = [
    (testing.check_write_kv, write_kv_one_slot_early),
    (testing.check_write_kv, write_kv_first_token_only),
    (testing.check_write_kv, write_kv_keys_into_both),
    (testing.check_cached_attention, cached_attention_over_every_slot),
    (testing.check_cached_attention, cached_attention_without_the_newest),
    (testing.check_cached_attention, cached_attention_without_scale),
    (testing.check_left_pad, right_pad),
    (testing.check_left_pad, left_pad_positions_from_the_row_start),
    (testing.check_left_pad, left_pad_with_zeros),
    (testing.check_static_batch_waste, waste_after_sorting),
    (testing.check_static_batch_waste, waste_over_useful_slots),
    (testing.check_static_batch_waste, waste_with_full_last_batch),
]
