"""The problem-set checks catch plausible mistakes: a check that passes a wrong answer teaches nothing."""

import math

import numpy as np
import pytest
import torch

import miniinfer as mi
import miniinfer.worker.logits_processors as lp
import miniinfer.worker.speculative as spec
from miniinfer.core.block_manager import OutOfBlocks
from miniinfer.course import checks as testing
from miniinfer.course.checks import ch09 as checks09
from miniinfer.course.checks import ch12 as checks12
from miniinfer.model.transformer import apply_rope, causal_attention


def rejected(check, wrong) -> None:
    """The check raises AssertionError on the wrong answer: a wrong result, not a crash or a pass."""
    with pytest.raises(AssertionError):
        check(wrong)


# Chapter 01 ------------------------------------------------------------------------------------

def attention_softmax_without_max(q, k, v, scale):
    """Right for small scores; exp overflows to inf (and inf / inf is NaN) once scores pass ~88."""
    T, group = q.shape[1], q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    e = torch.einsum("bthd,bshd->bhts", q, k).mul(scale).exp() * torch.ones(T, T).tril()
    return torch.einsum("bhts,bshd->bthd", e / e.sum(-1, keepdim=True), v)


def rms_norm_without_upcast(x, weight, eps):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm_eps_outside_the_root(x, weight, eps):
    xf = x.float()
    return weight * (xf / (xf.pow(2).mean(-1, keepdim=True).sqrt() + eps)).to(x.dtype)


def rms_norm_over_the_whole_tensor(x, weight, eps):
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean() + eps)).to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_interleaved(q, k, cos, sin):
    def rot(x):
        x1, x2 = x[..., 0::2], x[..., 1::2]
        c, s = cos[..., None, :], sin[..., None, :]
        return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), -1).flatten(-2).to(x.dtype)
    return rot(q), rot(k)


def rope_turning_backwards(q, k, cos, sin):
    c, s = torch.cat((cos, cos), -1)[..., None, :], torch.cat((sin, sin), -1)[..., None, :]
    return ((q * c - rotate_half(q) * s).to(q.dtype), (k * c - rotate_half(k) * s).to(k.dtype))


def rope_on_queries_only(q, k, cos, sin):
    return apply_rope(q, k, cos, sin)[0], k


def attention_without_mask(q, k, v, scale):
    group = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(group, 2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def attention_mask_off_by_one(q, k, v, scale):
    group, T = q.shape[2] // k.shape[2], q.shape[1]
    k, v = (t.repeat_interleave(group, 2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    future = torch.ones(T, T, dtype=torch.bool).triu(0)  # hides each token from itself too
    return torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(future, -math.inf).softmax(-1), v)


def attention_heads_tiled_not_interleaved(q, k, v, scale):
    group = q.shape[2] // k.shape[2]
    k, v = (t.repeat(1, 1, group, 1) for t in (k, v))  # query head h reads kv head h % Hk, not h // group
    return causal_attention(q, k, v, scale)


def attention_without_scale(q, k, v, scale):
    return causal_attention(q, k, v, 1.0)


def top_p_excluding_the_crossing_token(logits, top_p):
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    drop = sorted_logits.softmax(-1).cumsum(-1) > top_p
    return logits.masked_fill(drop.scatter(-1, order, drop), -math.inf)


def top_p_without_sorting(logits, top_p):
    probs = logits.softmax(-1)
    return logits.masked_fill(probs.cumsum(-1) - probs >= top_p, -math.inf)


def top_p_zeroing_instead_of_minus_inf(logits, top_p):
    kept = mi.core.sampling_params.top_p_filter(logits, top_p)
    return kept.masked_fill(kept.isinf(), 0.0)


@pytest.mark.parametrize("check, wrong", [
    (testing.check_rms_norm, rms_norm_without_upcast),
    (testing.check_rms_norm, rms_norm_eps_outside_the_root),
    (testing.check_rms_norm, rms_norm_over_the_whole_tensor),
    (testing.check_rope, rope_interleaved),
    (testing.check_rope, rope_turning_backwards),
    (testing.check_rope, rope_on_queries_only),
    (testing.check_attention, attention_without_mask),
    (testing.check_attention, attention_mask_off_by_one),
    (testing.check_attention, attention_heads_tiled_not_interleaved),
    (testing.check_attention, attention_without_scale),
    (testing.check_attention, attention_softmax_without_max),
    (testing.check_top_p, top_p_excluding_the_crossing_token),
    (testing.check_top_p, top_p_without_sorting),
    (testing.check_top_p, top_p_zeroing_instead_of_minus_inf),
])
def test_chapter_01_checks_reject_wrong_answers(check, wrong):
    rejected(check, wrong)


# Chapter 02 ------------------------------------------------------------------------------------

def write_kv_one_slot_early(k_cache, v_cache, k, v, start):
    return mi.write_kv(k_cache, v_cache, k, v, max(start - 1, 0))


def write_kv_first_token_only(k_cache, v_cache, k, v, start):
    return mi.write_kv(k_cache, v_cache, k[:, :1], v[:, :1], start)


def write_kv_keys_into_both(k_cache, v_cache, k, v, start):
    return mi.write_kv(k_cache, v_cache, k, k, start)


def cached_attention_over_every_slot(q, k_cache, v_cache, length, scale):
    return causal_attention(q, k_cache, v_cache, scale, q_start=k_cache.shape[1] - 1)


def cached_attention_without_the_newest(q, k_cache, v_cache, length, scale):
    if length == 1:
        return torch.zeros_like(q)
    return causal_attention(q, k_cache[:, :length - 1], v_cache[:, :length - 1], scale, q_start=length - 2)


def cached_attention_without_scale(q, k_cache, v_cache, length, scale):
    return causal_attention(q, k_cache[:, :length], v_cache[:, :length], 1.0, q_start=length - 1)


def right_pad(prompts, pad_id):
    L = max(map(len, prompts))
    ids = torch.tensor([p + [pad_id] * (L - len(p)) for p in prompts])
    real = torch.tensor([[True] * len(p) + [False] * (L - len(p)) for p in prompts])
    return ids, real, (real.cumsum(1) - 1).clamp(min=0)


def left_pad_positions_from_the_row_start(prompts, pad_id):
    ids, real, _ = mi.left_pad(prompts, pad_id)
    return ids, real, torch.arange(ids.shape[1]).expand_as(ids).clone()


def left_pad_with_zeros(prompts, pad_id):
    ids, real, positions = mi.left_pad(prompts, 0)
    return ids, real, positions


def waste_after_sorting(output_lens, batch_size):
    return mi.static_batch_waste(sorted(output_lens), batch_size)


def waste_over_useful_slots(output_lens, batch_size):
    steps = useful = 0
    for i in range(0, len(output_lens), batch_size):
        batch = output_lens[i:i + batch_size]
        steps, useful = steps + len(batch) * max(batch), useful + sum(batch)
    return (steps - useful) / useful


def waste_with_full_last_batch(output_lens, batch_size):
    steps = useful = 0
    for i in range(0, len(output_lens), batch_size):
        batch = output_lens[i:i + batch_size]
        steps, useful = steps + batch_size * max(batch), useful + sum(batch)
    return 1 - useful / steps


@pytest.mark.parametrize("check, wrong", [
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
])
def test_chapter_02_checks_reject_wrong_answers(check, wrong):
    rejected(check, wrong)


# Chapter 03 ------------------------------------------------------------------------------------

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
    def free(self, seq_id):
        del self.tables[seq_id], self.lengths[seq_id]


class FloorBlocks(Blocks):
    def blocks_for(self, num_tokens):
        return num_tokens // self.block_size


class PartialAllocation(Blocks):
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
    def allocate(self, seq_id, num_tokens):
        if seq_id in self.tables:
            self.free(seq_id)
        super().allocate(seq_id, num_tokens)


class NeverGrows(Blocks):
    def needs_block(self, seq_id):
        return False


class GrowsOneTokenLate(Blocks):
    def needs_block(self, seq_id):
        return self.lengths[seq_id] % self.block_size == 1 or self.block_size == 1


class BlockPerToken(Blocks):
    def needs_block(self, seq_id):
        return True


def slots_from_zero(block_table, start, num_tokens, block_size):
    return mi.slot_mapping(block_table, 0, num_tokens, block_size)


def slots_without_the_table(block_table, start, num_tokens, block_size):
    return torch.arange(start, start + num_tokens)


def slots_times_table_length(block_table, start, num_tokens, block_size):
    pos = torch.arange(start, start + num_tokens)
    return torch.tensor(block_table)[pos // block_size] * len(block_table) + pos % block_size


def gather_ignoring_tables(pool, block_tables, length):  # as if every table were 0, 1, 2, ...
    return pool.flatten(0, 1)[:length].expand(block_tables.shape[0], -1, -1, -1).clone()


def gather_one_short(pool, block_tables, length):
    out = mi.gather_kv(pool, block_tables, length)
    out[:, -1] = 0
    return out


def gather_blocks_by_offset(pool, block_tables, length):
    pos = torch.arange(length)
    slots = block_tables[:, pos % block_tables.shape[1]] * pool.shape[1] + pos // block_tables.shape[1] % pool.shape[1]
    return pool.flatten(0, 1)[slots]


@pytest.mark.parametrize("check, wrong", [
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
])
def test_chapter_03_checks_reject_wrong_answers(check, wrong):
    rejected(check, wrong)


def test_the_right_block_manager_passes():
    testing.check_block_manager(Blocks)
    testing.check_append_token(Blocks)


# Chapter 04 (the checks see the function that launches the kernel: these are its mistakes) -------

def norm_kernel_in_input_dtype(x, weight, eps):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def norm_kernel_mean_over_the_padded_block(x, weight, eps):
    xf, block = x.float(), triton_block(x.shape[-1])
    return (weight.float() * xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) / block + eps)).to(x.dtype)


def norm_kernel_without_eps(x, weight, eps):
    xf = x.float()
    return (weight.float() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True))).to(x.dtype)


def triton_block(n: int) -> int:
    return 1 << (n - 1).bit_length()


def rope_kernel_interleaved(q, k, cos, sin):
    return rope_interleaved(q, k, cos, sin)


def rope_kernel_first_position_only(q, k, cos, sin):
    return testing._in_float32(apply_rope)(q, k, cos[:1].expand_as(cos), sin[:1].expand_as(sin))


def rope_kernel_on_the_first_kv_heads_of_q(q, k, cos, sin):  # a grid of Hk programs per token
    rq, rk = testing._in_float32(apply_rope)(q, k, cos, sin)
    return torch.cat((rq[:, :k.shape[1]], q[:, k.shape[1]:]), 1), rk


@pytest.mark.parametrize("check, wrong", [
    (testing.check_rms_norm_kernel, norm_kernel_in_input_dtype),
    (testing.check_rms_norm_kernel, norm_kernel_mean_over_the_padded_block),
    (testing.check_rms_norm_kernel, norm_kernel_without_eps),
    (testing.check_rope_kernel, rope_kernel_interleaved),
    (testing.check_rope_kernel, rope_kernel_first_position_only),
    (testing.check_rope_kernel, rope_kernel_on_the_first_kv_heads_of_q),
])
def test_chapter_04_checks_reject_wrong_answers(check, wrong):
    rejected(check, wrong)


# Chapter 05 ------------------------------------------------------------------------------------

def merge_taking_the_max_lse(o1, lse1, o2, lse2):
    o, _ = testing._merge_partials_ref(o1, lse1, o2, lse2)
    return o, torch.maximum(lse1, lse2)


def merge_by_averaging(o1, lse1, o2, lse2):
    _, lse = testing._merge_partials_ref(o1, lse1, o2, lse2)
    return (o1 + o2) / 2, lse


def merge_with_swapped_weights(o1, lse1, o2, lse2):
    lse = torch.logaddexp(lse1, lse2)
    return o1 * (lse2 - lse).exp()[..., None] + o2 * (lse1 - lse).exp()[..., None], lse


def decode_program_softmax_without_max(q, k_cache, v_cache, table, start, end, scale):
    bs, pos = k_cache.shape[1], torch.arange(start, end)
    slots = torch.tensor(table)[pos // bs] * bs + pos % bs
    e = ((q @ k_cache.flatten(0, 1)[slots].T) * scale).exp()
    return (e / e.sum(-1, keepdim=True)) @ v_cache.flatten(0, 1)[slots], e.sum(-1).log()


def decode_program_one_token_too_far(q, k_cache, v_cache, table, start, end, scale):
    end = min(end + 1, len(table) * k_cache.shape[1])
    return testing._decode_program_ref(q, k_cache, v_cache, table, start, end, scale)


def decode_program_from_zero(q, k_cache, v_cache, table, start, end, scale):
    return testing._decode_program_ref(q, k_cache, v_cache, table, 0, end, scale)


def decode_program_lse_in_base_2(q, k_cache, v_cache, table, start, end, scale):
    o, lse = testing._decode_program_ref(q, k_cache, v_cache, table, start, end, scale)
    return o, lse / math.log(2)


def merge_splits_by_mean(part, lse):
    return part.mean(-2)


def merge_splits_counting_empty_as_zero(part, lse):
    return testing._merge_splits_ref(part, lse.nan_to_num(neginf=0.0))


def merge_splits_first_only(part, lse):
    return part[:, 0].clone()


def store_kv_minus_one_to_the_last_slot(k, v, k_cache, v_cache, slot_mapping):
    k_cache.flatten(0, 1)[slot_mapping] = k
    v_cache.flatten(0, 1)[slot_mapping] = v


def store_kv_keys_into_both(k, v, k_cache, v_cache, slot_mapping):
    mi.store_kv_ref(k, k, k_cache, v_cache, slot_mapping)


def store_kv_block_and_offset_swapped(k, v, k_cache, v_cache, slot_mapping):
    keep = slot_mapping >= 0
    s = slot_mapping[keep]
    nb = k_cache.shape[0]
    for cache, x in ((k_cache, k), (v_cache, v)):
        cache[s % nb, (s // nb) % cache.shape[1]] = x[keep]


@pytest.mark.parametrize("check, wrong", [
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
])
def test_chapter_05_checks_reject_wrong_answers(check, wrong):
    rejected(check, wrong)


# Chapter 06 ------------------------------------------------------------------------------------


def admit_ignoring_budget(prompt_lens, free_blocks, block_size, seats, budget):
    return testing._admit_ref(prompt_lens, free_blocks, block_size, seats, 10 ** 9)


def decodes_preempting_the_most_urgent(lens, free_blocks, block_size):
    decode, preempted = testing._schedule_decodes_ref(lens[::-1], free_blocks, block_size)
    return [len(lens) - 1 - i for i in decode], [len(lens) - 1 - i for i in preempted]


def preempt_on_ties(head, head_blocks, running, running_blocks, free_blocks):
    return testing._preempt_for_ref((head[0], -1), head_blocks, running, running_blocks, free_blocks)


def admit_ignoring_seats(prompt_lens, free_blocks, block_size, seats, budget):
    return testing._admit_ref(prompt_lens, free_blocks, block_size, 10 ** 9, budget)


def admit_skipping_what_does_not_fit(prompt_lens, free_blocks, block_size, seats, budget):
    n = 0  # passes over a prompt that does not fit and admits later ones: no longer first come, first served
    for length in prompt_lens:
        need = -(-length // block_size)
        if n < seats and length <= budget and need <= free_blocks:
            free_blocks, budget, n = free_blocks - need, budget - length, n + 1
    return n


def decodes_needing_a_block_one_token_late(lens, free_blocks, block_size):
    return testing._schedule_decodes_ref([n - 1 if n > 1 else n for n in lens], free_blocks, block_size)


def decodes_preempting_without_freeing(lens, free_blocks, block_size):
    queue, decode, preempted = list(range(len(lens))), [], []
    while queue:
        i = queue.pop(0)
        if lens[i] % block_size == 0 and free_blocks == 0:
            preempted.append(queue.pop() if queue else i)  # and its blocks are forgotten
            if preempted[-1] == i:
                continue
            queue.insert(0, i)
            continue
        free_blocks -= lens[i] % block_size == 0
        decode.append(i)
    return decode, preempted


def preempt_while_it_would_still_fit(head, head_blocks, running, running_blocks, free_blocks):
    n = 0
    while n < len(running) and head_blocks >= free_blocks and tuple(head) < tuple(running[-1 - n]):
        free_blocks += running_blocks[-1 - n]
        n += 1
    return n


def preempt_by_arrival_only(head, head_blocks, running, running_blocks, free_blocks):
    return testing._preempt_for_ref((0, head[1]), head_blocks, [(0, a) for _, a in running], running_blocks,
                                    free_blocks)


def sample_without_temperature(logits, temperature, top_p, noise):
    return testing._sample_rows_ref(logits, (temperature > 0).float(), top_p, noise)


def sample_multiplying_the_noise(logits, temperature, top_p, noise):
    return testing._sample_rows_ref(logits, temperature, top_p, 1 / noise)


def sample_without_top_p(logits, temperature, top_p, noise):
    return testing._sample_rows_ref(logits, temperature, torch.ones_like(top_p), noise)


def varlen_positions_from_zero(tokens, tables, num_cached, block_size):
    return testing._varlen_ref(tokens, tables, [0] * len(tokens), block_size)


def varlen_query_starts_without_zero(tokens, tables, num_cached, block_size):
    positions, slots, starts, lens = testing._varlen_ref(tokens, tables, num_cached, block_size)
    return positions, slots, starts[1:], lens


def varlen_lengths_of_new_tokens_only(tokens, tables, num_cached, block_size):
    positions, slots, starts, _ = testing._varlen_ref(tokens, tables, num_cached, block_size)
    return positions, slots, starts, torch.tensor([len(t) for t in tokens])


@pytest.mark.parametrize("check, wrong", [
    (testing.check_admit, admit_ignoring_budget),
    (testing.check_admit, admit_ignoring_seats),
    (testing.check_admit, admit_skipping_what_does_not_fit),
    (testing.check_schedule_decodes, decodes_preempting_the_most_urgent),
    (testing.check_schedule_decodes, decodes_needing_a_block_one_token_late),
    (testing.check_schedule_decodes, decodes_preempting_without_freeing),
    (testing.check_preempt_for, preempt_on_ties),
    (testing.check_preempt_for, preempt_while_it_would_still_fit),
    (testing.check_preempt_for, preempt_by_arrival_only),
    (testing.check_sample_rows, sample_without_top_p),
    (testing.check_sample_rows, sample_without_temperature),
    (testing.check_sample_rows, sample_multiplying_the_noise),
    (testing.check_varlen_metadata, varlen_positions_from_zero),
    (testing.check_varlen_metadata, varlen_query_starts_without_zero),
    (testing.check_varlen_metadata, varlen_lengths_of_new_tokens_only),
])
def test_chapter_06_checks_reject_wrong_answers(check, wrong):
    rejected(check, wrong)


def test_reference_scheduler_helpers_agree_with_the_engine_scheduler():
    """The admit reference is the engine's admission (watermark aside), on one concrete case."""
    bm = mi.BlockManager(10, 4)
    sched = mi.Scheduler(bm, max_num_seqs=3, max_num_batched_tokens=30)
    lens = [9, 12, 5, 2]
    for i, n in enumerate(lens):
        sched.add(mi.Sequence(str(i), [1] * n, mi.SamplingParams(max_tokens=1), arrival=i))
    out = sched.schedule()
    assert len(out.num_new_tokens) == testing._admit_ref(lens, 10, 4, 3, 30) == 3


def hashes_without_the_chain(tokens, block_size):
    return [hash(tuple(tokens[i:i + block_size])) for i in range(0, len(tokens) - block_size + 1, block_size)]


def prefix_matching_the_last_block_too(tokens, cached, block_size):
    return testing._longest_cached_prefix_ref(tokens + [0], cached, block_size)


def evicting_before_the_free_list_is_used_up(free, ops):
    return testing._lru_evictions_ref([], ops)


def hashes_with_the_partial_last_block(tokens, block_size):
    return testing._chain_hashes_ref(tokens + [0] * (-len(tokens) % block_size), block_size)


def hashes_chained_from_another_root(tokens, block_size):
    return [h for h, _ in mi.core.prefix_cache.block_keys(tokens, block_size, parent=-1)]


def prefix_skipping_a_missing_block(tokens, cached, block_size):
    return [cached[h] for h in testing._chain_hashes_ref(tokens[:-1], block_size) if h in cached]


def prefix_of_every_block_the_tokens_fill(tokens, cached, block_size):
    blocks = []
    for h in testing._chain_hashes_ref(tokens, block_size):  # the last token's block too, when full
        if h not in cached:
            break
        blocks.append(cached[h])
    return blocks


def lru_order_reversed(free, ops):
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
    return testing._lru_evictions_ref(free, [(op, arg) for op, arg in ops if op != "hit"])


def prefill_one_prompt_a_step(num_decoders, prompt_lens, budget):
    steps = []
    for i, n in enumerate(prompt_lens):
        while n:
            take = min(n, budget - num_decoders)
            steps.append([take if j == i else 0 for j in range(len(prompt_lens))])
            n -= take
    return steps


def prefill_counting_decoders_once(num_decoders, prompt_lens, budget):
    first = testing._prefill_plan_ref(num_decoders, prompt_lens, budget)[:1]
    done = [sum(col) for col in zip(*first)] if first else []
    return first + testing._prefill_plan_ref(0, [n - d for n, d in zip(prompt_lens, done)], budget)


def prefill_before_decodes(num_decoders, prompt_lens, budget):
    return testing._prefill_plan_ref(0, prompt_lens, budget)


@pytest.mark.parametrize("check, wrong", [
    (testing.check_chain_hashes, hashes_without_the_chain),
    (testing.check_chain_hashes, hashes_with_the_partial_last_block),
    (testing.check_chain_hashes, hashes_chained_from_another_root),
    (testing.check_longest_cached_prefix, prefix_matching_the_last_block_too),
    (testing.check_longest_cached_prefix, prefix_skipping_a_missing_block),
    (testing.check_longest_cached_prefix, prefix_of_every_block_the_tokens_fill),
    (testing.check_lru_evictions, evicting_before_the_free_list_is_used_up),
    (testing.check_lru_evictions, lru_order_reversed),
    (testing.check_lru_evictions, evicting_blocks_still_hit),
    (testing.check_prefill_plan, prefill_before_decodes),
    (testing.check_prefill_plan, prefill_one_prompt_a_step),
    (testing.check_prefill_plan, prefill_counting_decoders_once),
])
def test_chapter_07_checks_reject_wrong_answers(check, wrong):
    rejected(check, wrong)


def sse_on_one_line(data):
    return f"data: {data}\n\n"


def sse_without_the_blank_line(data):
    return "".join(f"data: {line}\n" for line in data.split("\n"))


def sse_escaping_newlines(data):
    return "data: " + data.replace("\n", "\\n") + "\n\n"


class DecodeEachToken:
    def __init__(self, tokenizer):
        self.tok = tokenizer

    def add(self, ids):
        return self.tok.decode(ids)

    def finish(self):
        return ""


class EverythingSoFar(DecodeEachToken):
    """Hands out the whole text each time, not what is new."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.ids = []

    def add(self, ids):
        self.ids += ids
        return self.tok.decode(self.ids).replace("\ufffd", "")


class HoldEverything(DecodeEachToken):
    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.ids = []

    def add(self, ids):
        self.ids += ids
        return ""

    def finish(self):
        return self.tok.decode(self.ids)


async def stream_without_abort(outputs, abort):
    while True:
        out = await outputs.get()
        yield out
        if out.finished:
            return


async def stream_stopping_before_the_finished_one(outputs, abort):
    while True:
        out = await outputs.get()
        if out.finished:
            return
        yield out


async def stream_that_always_aborts(outputs, abort):
    try:
        while True:
            out = await outputs.get()
            yield out
            if out.finished:
                return
    finally:
        abort()


@pytest.mark.parametrize("check, wrong", [
    (testing.check_sse_event, sse_on_one_line),
    (testing.check_sse_event, sse_without_the_blank_line),
    (testing.check_sse_event, sse_escaping_newlines),
    (testing.check_detokenizer, DecodeEachToken),
    (testing.check_detokenizer, HoldEverything),
    (testing.check_detokenizer, EverythingSoFar),
    (testing.check_stream_request, stream_without_abort),
    (testing.check_stream_request, stream_that_always_aborts),
    (testing.check_stream_request, stream_stopping_before_the_finished_one),
])
def test_chapter_08_checks_reject_wrong_answers(check, wrong):
    rejected(check, wrong)


# Chapter 09 ------------------------------------------------------------------------------------

def rejection_sample_residual_is_p(p, q, guesses, u, noise):  # the tempting shortcut: biased to q's likes
    return spec.rejection_sample(p, q, guesses, u, noise)[0], (p / noise).argmax(-1)


def rejection_sample_q_over_p(p, q, guesses, u, noise):  # the ratio upside down
    g = guesses.clamp(min=0)[:, None]
    kept = (guesses >= 0) & (u * p.gather(-1, g)[:, 0] <= q.gather(-1, g)[:, 0])
    return kept, spec.rejection_sample(p, q, guesses, u, noise)[1]


def rejection_sample_without_fallback(p, q, guesses, u, noise):  # p = q leaves zeros: always token 0
    return spec.rejection_sample(p, q, guesses, u, noise)[0], ((p - q).clamp(min=0) / noise).argmax(-1)


def rejection_sample_keeping_no_guess(p, q, guesses, u, noise):  # -1 read as the last token: "kept"
    g = guesses[:, None] % p.shape[-1]
    return u * q.gather(-1, g)[:, 0] <= p.gather(-1, g)[:, 0], spec.rejection_sample(p, q, guesses, u, noise)[1]


def keep_counting_every_accepted(guesses, accepted, tokens, table, num_known, block_size):
    a = sum(accepted)  # not only those before the first rejection
    return guesses[:a] + [tokens[a]], table[:-(-(num_known + a) // block_size)]


def keep_the_last_tokens_block(guesses, accepted, tokens, table, num_known, block_size):
    new, _ = spec.keep_accepted(guesses, accepted, tokens, table, num_known, block_size)
    return new, table[:-(-(num_known + len(new)) // block_size)]  # the sampled token has no K/V yet


def keep_without_the_bonus(guesses, accepted, tokens, table, num_known, block_size):
    new, kept = spec.keep_accepted(guesses, accepted, tokens, table, num_known, block_size)
    return (new[:-1] if len(new) > len(guesses) else new), kept


def keep_flooring_the_blocks(guesses, accepted, tokens, table, num_known, block_size):
    new, _ = spec.keep_accepted(guesses, accepted, tokens, table, num_known, block_size)
    return new, table[:(num_known + len(new) - 1) // block_size]


def ngram_at_the_earliest_place(tokens, k, max_n):
    for n in range(min(max_n, len(tokens) - 1), 0, -1):
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == tokens[-n:]:
                return tokens[start + n:start + n + k]
    return []


def ngram_shortest_first(tokens, k, max_n):
    for n in range(1, min(max_n, len(tokens) - 1) + 1):
        if guesses := spec.ngram_guesses(tokens, k, n, n):
            return guesses
    return []


def ngram_matching_the_end_itself(tokens, k, max_n):  # the tail always matches itself: no guesses
    for n in range(min(max_n, len(tokens) - 1), 0, -1):
        for start in range(len(tokens) - n, -1, -1):
            if tokens[start:start + n] == tokens[-n:]:
                return tokens[start + n:start + n + k]
    return []


def ngram_all_that_follow(tokens, k, max_n):  # not cut to k
    guesses = spec.ngram_guesses(tokens, len(tokens), max_n)
    return guesses if len(guesses) > k else spec.ngram_guesses(tokens, k, max_n)


def counts_of(a, b, rare: int = 10) -> torch.Tensor:
    """[2, categories] float64: the values seen, those seen fewer than `rare` times pooled."""
    values = sorted(set(a) | set(b))
    counts = torch.tensor([[x.count(v) for v in values] for x in (a, b)], dtype=torch.float64)
    pooled = counts.sum(0) < rare
    counts = torch.cat([counts[:, ~pooled], counts[:, pooled].sum(1, keepdim=True)], 1)
    return counts[:, counts.sum(0) > 0]


def p_value(counts: torch.Tensor, dof: int) -> float:
    expected = counts.sum(1, keepdim=True) * counts.sum(0) / counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    return 1.0 if dof < 1 else float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def same_law_without_pooling(a, b):
    counts = counts_of(a, b, rare=0)
    return p_value(counts, counts.shape[1] - 1)


def same_law_one_degree_too_many(a, b):
    counts = counts_of(a, b)
    return p_value(counts, counts.shape[1])


def same_law_against_a_alone(a, b):  # b tested against a's frequencies, as if they were the truth
    counts = counts_of(a, b)
    counts = counts[:, counts[0] > 0]
    expected = counts[0] / len(a) * len(b)
    stat = ((counts[1] - expected) ** 2 / expected).sum()
    dof = counts.shape[1] - 1
    return 1.0 if dof < 1 else float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def same_law_statistic(a, b):  # the statistic, not its p-value
    counts = counts_of(a, b)
    expected = counts.sum(1, keepdim=True) * counts.sum(0) / counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("check, wrong", [
    (testing.check_rejection_sample, rejection_sample_residual_is_p),
    (testing.check_rejection_sample, rejection_sample_q_over_p),
    (testing.check_rejection_sample, rejection_sample_without_fallback),
    (testing.check_rejection_sample, rejection_sample_keeping_no_guess),
    (testing.check_keep_accepted, keep_counting_every_accepted),
    (testing.check_keep_accepted, keep_the_last_tokens_block),
    (testing.check_keep_accepted, keep_without_the_bonus),
    (testing.check_keep_accepted, keep_flooring_the_blocks),
    (testing.check_ngram_guesses, ngram_at_the_earliest_place),
    (testing.check_ngram_guesses, ngram_shortest_first),
    (testing.check_ngram_guesses, ngram_matching_the_end_itself),
    (testing.check_ngram_guesses, ngram_all_that_follow),
    (testing.check_same_law, same_law_without_pooling),
    (testing.check_same_law, same_law_one_degree_too_many),
    (testing.check_same_law, same_law_against_a_alone),
    (testing.check_same_law, same_law_statistic),
])
def test_chapter_09_checks_reject_wrong_answers(check, wrong):
    rejected(check, wrong)


def runner_with(**pieces) -> type:
    return type("Broken", (spec.SpeculativeRunner,), {k: staticmethod(v) for k, v in pieces.items()})


class EarliestNgram(mi.NgramProposer):
    def propose(self, runner, out, room):
        return {rid: ngram_at_the_earliest_place(runner.requests[rid].token_ids, k, 3) for rid, k in room.items()}, None


@pytest.mark.parametrize("runner, law, says", [
    (runner_with(rejection_sample=rejection_sample_residual_is_p), checks09.same_law, "follow different laws"),
    (runner_with(keep_accepted=keep_counting_every_accepted), checks09.same_law, "greedy, prompt"),
    (type("Broken", (spec.SpeculativeRunner,), {"proposers": {"ngram": EarliestNgram}}), checks09.same_law,
     "not the package's guesses"),
    (spec.SpeculativeRunner, lambda a, b: 0.0, "follow different laws"),
], ids=["rejection_sample", "keep_accepted", "ngram_guesses", "same_law"])
def test_chapter_09_last_part_fails_on_each_broken_piece(runner, law, says):
    """The last part runs the engine on the student's pieces: each one broken fails it, by name."""
    with pytest.raises(AssertionError, match=says):
        testing.check_speculative_engine(runner, law)


# Chapter 10 ------------------------------------------------------------------------------------

def fake_quantize_floor(w, bits, symmetric):  # truncates instead of rounding
    top = 2 ** (bits - 1) - 1
    scale = (w.abs().amax(1, keepdim=True) / top).clamp(min=1e-10)
    return torch.floor(w / scale).clamp(-top - 1, top) * scale


def fake_quantize_always_symmetric(w, bits, symmetric):
    return testing._fake_quantize_ref(w, bits, True)


def pack_without_offset(codes):
    shifts = torch.arange(8, dtype=torch.int32) * 4
    return ((codes.to(torch.int32) & 15).reshape(codes.shape[0], -1, 8) << shifts).sum(-1, dtype=torch.int32)


def pack_first_code_highest(codes):
    shifts = 28 - torch.arange(8, dtype=torch.int32) * 4
    return ((codes.to(torch.int32) + 8).reshape(codes.shape[0], -1, 8) << shifts).sum(-1, dtype=torch.int32)


def scales_per_row(w, group_size):
    return (w.abs().amax(1, keepdim=True) / 7).clamp(min=1e-10).expand(-1, w.shape[1] // group_size)


def scales_over_8(w, group_size):
    return (w.reshape(w.shape[0], -1, group_size).abs().amax(-1) / 8).clamp(min=1e-10)


def dequant_without_offset(x, packed, scale):
    codes = (packed[..., None] >> (torch.arange(8, dtype=torch.int32) * 4)) & 15
    N, G = scale.shape
    return x @ (codes.reshape(N, G, -1) * scale[..., None]).reshape(N, -1).T


def dequant_first_scale_only(x, packed, scale):
    codes = ((packed[..., None] >> (torch.arange(8, dtype=torch.int32) * 4)) & 15) - 8
    return x @ (codes.reshape(packed.shape[0], -1) * scale[:, :1]).T


def fp8_with_fnuz_range(x):  # 240 is the largest e4m3fnuz value, another FP8 flavour
    scale = x.abs().amax(1, keepdim=True).float().clamp(min=1e-12) / 240
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


def fp8_one_scale_for_all(x):
    scale = x.abs().amax().float().clamp(min=1e-12) / 448 * torch.ones(x.shape[0], 1)
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("check, wrong", [
    (testing.check_fake_quantize, fake_quantize_floor),
    (testing.check_fake_quantize, fake_quantize_always_symmetric),
    (testing.check_pack_int4, pack_without_offset),
    (testing.check_pack_int4, pack_first_code_highest),
    (testing.check_group_scales, scales_per_row),
    (testing.check_group_scales, scales_over_8),
    (testing.check_dequant_matmul, dequant_without_offset),
    (testing.check_dequant_matmul, dequant_first_scale_only),
    (testing.check_fp8_quantize, fp8_with_fnuz_range),
    (testing.check_fp8_quantize, fp8_one_scale_for_all),
])
def test_chapter_10_checks_reject_wrong_answers(check, wrong):
    rejected(check, wrong)


# Chapter 11 ------------------------------------------------------------------------------------

def shard_interleaved(w, rank, size, by):  # every size-th row or column: not a consecutive share
    return w[rank::size] if by == "output" else w[:, rank::size]


def shard_by_the_other_dimension(w, rank, size, by):
    return testing._shard_linear_ref(w, rank, size, "input" if by == "output" else "output")


def lookup_without_zeros(ids, share, start):
    return share[(ids - start).clamp(0, share.shape[0] - 1)]


def lookup_one_row_too_many(ids, share, start):
    local = ids - start
    mine = (local >= 0) & (local <= share.shape[0])
    return share[local.clamp(0, share.shape[0] - 1)] * mine[..., None]


def reduce_everything(module):
    return "all_reduce"


def gather_the_attention(module):
    return "all_gather" if module == "qkv_proj" else testing.COLLECTIVES[module]


def kv_share_without_replication(rank, size, num_kv_heads):
    n = max(1, num_kv_heads // size)
    return rank * n, (rank + 1) * n


def kv_round_robin(rank, size, num_kv_heads):
    if num_kv_heads >= size:
        return kv_share_without_replication(rank, size, num_kv_heads)
    return rank % num_kv_heads, rank % num_kv_heads + 1


@pytest.mark.parametrize("check, wrong", [
    (testing.check_shard_linear, shard_interleaved),
    (testing.check_shard_linear, shard_by_the_other_dimension),
    (testing.check_vocab_lookup, lookup_without_zeros),
    (testing.check_vocab_lookup, lookup_one_row_too_many),
    (testing.check_collective_after, reduce_everything),
    (testing.check_collective_after, gather_the_attention),
    (testing.check_kv_heads_for, kv_share_without_replication),
    (testing.check_kv_heads_for, kv_round_robin),
])
def test_chapter_11_checks_reject_wrong_answers(check, wrong):
    rejected(check, wrong)


# Chapter 12 ------------------------------------------------------------------------------------

def penalize_openai_first(logits, counts, in_prompt, presence, frequency, repetition):  # the order swapped
    logits = logits - counts * frequency[:, None] - (counts > 0) * presence[:, None]
    return lp.penalize(logits, counts, in_prompt, presence * 0, frequency * 0, repetition)


def penalize_swapping_presence_and_frequency(logits, counts, in_prompt, presence, frequency, repetition):
    return lp.penalize(logits, counts, in_prompt, frequency, presence, repetition)


def penalize_always_dividing(logits, counts, in_prompt, presence, frequency, repetition):
    seen = in_prompt | (counts > 0)
    logits = torch.where(seen, logits / repetition[:, None], logits)
    return lp.penalize(logits, counts, in_prompt, presence, frequency, torch.ones_like(repetition))


def penalize_output_only(logits, counts, in_prompt, presence, frequency, repetition):
    return lp.penalize(logits, counts, torch.zeros_like(in_prompt), presence, frequency, repetition)


def prompt_rows_from_the_chunk_start(num_computed, num_new, num_prompt):  # scores token c, not c + 1 first
    b, t, rows = lp.prompt_rows(num_computed, num_new, num_prompt)
    return b, t - 1, rows


def prompt_rows_past_the_prompt(num_computed, num_new, num_prompt):  # the first generated token as well
    return lp.prompt_rows(num_computed, num_new, [p + 1 for p in num_prompt])


def prompt_rows_each_request_from_row_0(num_computed, num_new, num_prompt):
    b, t, rows = lp.prompt_rows(num_computed, num_new, num_prompt)
    return b, t, t - 1 - np.asarray(num_computed, np.int64)[b]


def prompt_rows_by_position(num_computed, num_new, num_prompt):  # as if every chunk started the prompt
    b, t, rows = lp.prompt_rows(num_computed, num_new, num_prompt)
    return b, t, rows + np.asarray(num_computed, np.int64)[b]


class MatcherWithoutEnd(checks12.ToyMatcher):  # the end token never allowed
    def fill_next_token_bitmask(self, bitmask, n):
        super().fill_next_token_bitmask(bitmask, n)
        for e in self.eos:
            bitmask[n, e // 32] &= ~(1 << (e % 32)) if e % 32 < 31 else 0x7FFFFFFF


class MatcherFirstCharOnly(checks12.ToyMatcher):  # a token allowed when its first character is
    def walk(self, text):
        return super().walk(text[:1]) if text else self.state


class MatcherEndByItsText(checks12.ToyMatcher):  # the end token judged by its text, as any other
    def fill_next_token_bitmask(self, bitmask, n):
        eos, self.eos = self.eos, set()
        super().fill_next_token_bitmask(bitmask, n)
        self.eos = eos


class MatcherNeverEnding(checks12.ToyMatcher):
    def is_terminated(self):
        return False


def logprobs_of_the_raw_logits(logits, tokens, k):  # no log-softmax
    top, ids = logits.topk(k, dim=-1)
    own = logits.gather(-1, tokens[:, None])[:, 0]
    return own, (logits > own[:, None]).sum(-1) + 1, top, ids


def rank_counting_ties_as_ahead(logits, tokens, k):
    """`>=` counts the token itself and every token tied with it: logits [1, 1, 0, -1], token 1 -> 2."""
    own, _, top, ids = mi.worker.logits_processors.top_logprobs(logits, tokens, k)
    logprobs = logits.float().log_softmax(-1)
    return own, (logprobs >= own[:, None]).sum(-1), top, ids


def rank_from_zero(logits, tokens, k):
    own, rank, top, ids = mi.worker.logits_processors.top_logprobs(logits, tokens, k)
    return own, rank - 1, top, ids


def bitmask_most_significant_first(logits, bitmask):
    bits = (bitmask[:, :, None] >> (31 - torch.arange(32, dtype=torch.int32))) & 1
    return logits.masked_fill(~bits.flatten(1)[:, :logits.shape[1]].bool(), float("-inf"))


def bitmask_kept_where_zero(logits, bitmask):
    bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return logits.masked_fill(bits.flatten(1)[:, :logits.shape[1]].bool(), float("-inf"))


def bitmask_without_the_sign_bit(logits, bitmask):  # bit 31 read as 0: token 32w + 31 never allowed
    bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    bits[:, :, 31] = 0
    return logits.masked_fill(~bits.flatten(1)[:, :logits.shape[1]].bool(), float("-inf"))


@pytest.mark.parametrize("check, wrong", [
    (testing.check_penalize, penalize_openai_first),
    (testing.check_penalize, penalize_swapping_presence_and_frequency),
    (testing.check_penalize, penalize_always_dividing),
    (testing.check_penalize, penalize_output_only),
    (testing.check_prompt_rows, prompt_rows_from_the_chunk_start),
    (testing.check_prompt_rows, prompt_rows_past_the_prompt),
    (testing.check_prompt_rows, prompt_rows_each_request_from_row_0),
    (testing.check_prompt_rows, prompt_rows_by_position),
    (testing.check_toy_matcher, MatcherWithoutEnd),
    (testing.check_toy_matcher, MatcherFirstCharOnly),
    (testing.check_toy_matcher, MatcherEndByItsText),
    (testing.check_toy_matcher, MatcherNeverEnding),
    (testing.check_top_logprobs, logprobs_of_the_raw_logits),
    (testing.check_top_logprobs, rank_from_zero),
    (testing.check_top_logprobs, rank_counting_ties_as_ahead),
    (testing.check_apply_bitmask, bitmask_most_significant_first),
    (testing.check_apply_bitmask, bitmask_kept_where_zero),
    (testing.check_apply_bitmask, bitmask_without_the_sign_bit),
])
def test_chapter_12_checks_reject_wrong_answers(check, wrong):
    rejected(check, wrong)


VOCAB = [mi.load_tokenizer().decode([i]) for i in range(4096)]


def processor(base: type, **pieces) -> type:
    return type("Broken", (base,), {k: v if callable(v) and k == "matcher" else staticmethod(v)
                                    for k, v in pieces.items()})


def number_matcher(cls):
    return lambda self, structure: cls(checks12.NUMBER_DFA, checks12.NUMBER_ACCEPTING, VOCAB, {0})


@pytest.mark.parametrize("pieces, says", [
    ((processor(lp.Penalties, penalize=penalize_openai_first),), "repetition_penalty"),
    ((processor(lp.Logprobs, scorer=rank_from_zero),), "logprobs of token"),
    ((processor(lp.PromptLogprobs, rows_for=prompt_rows_from_the_chunk_start),), "prompt_logprobs of token"),
    ((processor(lp.Structured, mask=bitmask_most_significant_first),), "regex"),
    ((processor(lp.Structured, matcher=number_matcher(MatcherFirstCharOnly)),), "regex"),
], ids=["penalize", "top_logprobs", "prompt_rows", "apply_bitmask", "ToyMatcher"])
def test_chapter_12_last_part_fails_on_each_broken_piece(pieces, says):
    """The last part runs the engine on the student's processors (the right matcher where the piece
    broken is not the matcher): each broken piece fails it, naming the request."""
    right = processor(lp.Structured, matcher=number_matcher(checks12.ToyMatcher))
    if not any(issubclass(p, lp.Structured) for p in pieces):
        pieces += (right,)
    with pytest.raises(AssertionError, match=says):
        testing.check_sampling_engine(pieces)


def test_an_exception_in_the_answer_names_the_case_and_its_inputs():
    def shape_error(x, weight, eps):
        return x @ weight[:-1]

    with pytest.raises(testing.AnswerError, match=r"rms_norm, case 1 of \d+\n  inputs: tensor \(\d+(, \d+)*\) "
                                                  r"float32, tensor \(\d+,\) float32, 1e-05\n.*\n  your code raised "
                                                  r"RuntimeError"):
        testing.check_rms_norm(shape_error)
    x, weight, eps = testing.last_failure["inputs"]  # the case, to call the answer on again
    assert isinstance(x, torch.Tensor) and eps == 1e-05


def test_an_unanswered_exercise_says_which():
    def unanswered(x, weight, eps):
        raise NotImplementedError()

    with pytest.raises(testing.NotAnswered, match=r"^exercise 1 \(rms_norm\) is not answered yet"):
        testing.check_rms_norm(unanswered)
