"""Wrong answers to problem set 06 that its checks must reject: each named (or documented) for its mistake."""


import torch

from miniinfer.course import checks as testing


def admit_ignoring_budget(prompt_lens, free_blocks, block_size, seats, budget):
    """Never checks the token budget: admits prompts beyond what is left of the step's budget."""
    return testing._admit_ref(prompt_lens, free_blocks, block_size, seats, 10 ** 9)


def decodes_preempting_the_most_urgent(lens, free_blocks, block_size):
    """Walks the sequences from least to most urgent: preempts the most urgent ones first."""
    decode, preempted = testing._schedule_decodes_ref(lens[::-1], free_blocks, block_size)
    return [len(lens) - 1 - i for i in decode], [len(lens) - 1 - i for i in preempted]


def preempt_on_ties(head, head_blocks, running, running_blocks, free_blocks):
    """Treats the head as arriving first: it preempts running sequences of its priority that arrived before it."""
    return testing._preempt_for_ref((head[0], -1), head_blocks, running, running_blocks, free_blocks)


def admit_ignoring_seats(prompt_lens, free_blocks, block_size, seats, budget):
    """Never checks the free seats: admits more sequences than there are seats."""
    return testing._admit_ref(prompt_lens, free_blocks, block_size, 10 ** 9, budget)


def admit_skipping_what_does_not_fit(prompt_lens, free_blocks, block_size, seats, budget):
    """Skips a prompt that does not fit and admits later ones: not first come, first served."""
    n = 0  # passes over a prompt that does not fit and admits later ones: no longer first come, first served
    for length in prompt_lens:
        need = -(-length // block_size)
        if n < seats and length <= budget and need <= free_blocks:
            free_blocks, budget, n = free_blocks - need, budget - length, n + 1
    return n


def decodes_needing_a_block_one_token_late(lens, free_blocks, block_size):
    """Counts each sequence one token short: wants a block when its last one holds one token, not when it is full."""
    return testing._schedule_decodes_ref([n - 1 if n > 1 else n for n in lens], free_blocks, block_size)


def decodes_preempting_without_freeing(lens, free_blocks, block_size):
    """Never returns a victim's blocks: one missing block preempts every sequence after it, then itself."""
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
    """Preempts while head_blocks >= free_blocks: one victim too many when the free blocks just fit the head."""
    n = 0
    while n < len(running) and head_blocks >= free_blocks and tuple(head) < tuple(running[-1 - n]):
        free_blocks += running_blocks[-1 - n]
        n += 1
    return n


def preempt_by_arrival_only(head, head_blocks, running, running_blocks, free_blocks):
    """Compares arrivals only, ignoring priority: a more urgent head that came later preempts no one."""
    return testing._preempt_for_ref((0, head[1]), head_blocks, [(0, a) for _, a in running], running_blocks,
                                    free_blocks)


def sample_without_temperature(logits, temperature, top_p, noise):
    """Samples every row with temperature > 0 at temperature 1: the logits are never divided by it."""
    return testing._sample_rows_ref(logits, (temperature > 0).float(), top_p, noise)


def sample_multiplying_the_noise(logits, temperature, top_p, noise):
    """Takes argmax(probs * noise), not probs / noise: with exponential noise that is not a draw from probs."""
    return testing._sample_rows_ref(logits, temperature, top_p, 1 / noise)


def sample_without_top_p(logits, temperature, top_p, noise):
    """Ignores top_p: samples from every token, not only the nucleus."""
    return testing._sample_rows_ref(logits, temperature, torch.ones_like(top_p), noise)


def varlen_positions_from_zero(tokens, tables, num_cached, block_size):
    """Ignores num_cached: positions, slots and lengths as if no token of any sequence were cached."""
    return testing._varlen_ref(tokens, tables, [0] * len(tokens), block_size)


def varlen_query_starts_without_zero(tokens, tables, num_cached, block_size):
    """Drops query_start_loc's leading 0: B entries (each request's end) instead of B + 1 offsets."""
    positions, slots, starts, lens = testing._varlen_ref(tokens, tables, num_cached, block_size)
    return positions, slots, starts[1:], lens


def varlen_lengths_of_new_tokens_only(tokens, tables, num_cached, block_size):
    """seq_lens counts only the new tokens, not the cached ones before them."""
    positions, slots, starts, _ = testing._varlen_ref(tokens, tables, num_cached, block_size)
    return positions, slots, starts, torch.tensor([len(t) for t in tokens])


# (the check, the wrong answer)
MUTANTS = [
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
]
