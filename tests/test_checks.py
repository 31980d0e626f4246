"""The problem-set checks catch plausible mistakes: a check that passes a wrong answer teaches nothing."""

import pytest
import torch

import miniinfer as mi
from miniinfer import testing


def admit_ignoring_budget(prompt_lens, free_blocks, block_size, seats, budget):
    return testing._admit_ref(prompt_lens, free_blocks, block_size, seats, 10 ** 9)


def decodes_preempting_the_most_urgent(lens, free_blocks, block_size):
    decode, preempted = testing._schedule_decodes_ref(lens[::-1], free_blocks, block_size)
    return [len(lens) - 1 - i for i in decode], [len(lens) - 1 - i for i in preempted]


def preempt_on_ties(head, head_blocks, running, running_blocks, free_blocks):
    return testing._preempt_for_ref((head[0], -1), head_blocks, running, running_blocks, free_blocks)


def sample_without_top_p(logits, temperature, top_p, noise):
    return testing._sample_rows_ref(logits, temperature, torch.ones_like(top_p), noise)


def varlen_positions_from_zero(tokens, tables, num_cached, block_size):
    return testing._varlen_ref(tokens, tables, [0] * len(tokens), block_size)


@pytest.mark.parametrize("check, wrong", [
    (testing.check_admit, admit_ignoring_budget),
    (testing.check_schedule_decodes, decodes_preempting_the_most_urgent),
    (testing.check_preempt_for, preempt_on_ties),
    (testing.check_sample_rows, sample_without_top_p),
    (testing.check_varlen_metadata, varlen_positions_from_zero),
])
def test_chapter_06_checks_reject_wrong_answers(check, wrong):
    with pytest.raises(AssertionError):
        check(wrong)


def test_reference_scheduler_helpers_agree_with_the_engine_scheduler():
    """The admit reference is the engine's admission (watermark aside), on one concrete case."""
    bm = mi.BlockManager(10, 4)
    sched = mi.Scheduler(bm, max_num_seqs=3, max_num_batched_tokens=30)
    lens = [9, 12, 5, 2]
    for i, n in enumerate(lens):
        sched.add(mi.Sequence(str(i), [1] * n, mi.SamplingParams(max_tokens=1), arrival=i))
    out = sched.schedule()
    assert len(out.seqs) == testing._admit_ref(lens, 10, 4, 3, 30) == 3


def hashes_without_the_chain(tokens, block_size):
    return [hash(tuple(tokens[i:i + block_size])) for i in range(0, len(tokens) - block_size + 1, block_size)]


def prefix_matching_the_last_block_too(tokens, cached, block_size):
    return testing._longest_cached_prefix_ref(tokens + [0], cached, block_size)


def evicting_before_the_free_list_is_used_up(free, ops):
    return testing._lru_evictions_ref([], ops)


def prefill_before_decodes(num_decoders, prompt_lens, budget):
    return testing._prefill_plan_ref(0, prompt_lens, budget)


@pytest.mark.parametrize("check, wrong", [
    (testing.check_chain_hashes, hashes_without_the_chain),
    (testing.check_longest_cached_prefix, prefix_matching_the_last_block_too),
    (testing.check_lru_evictions, evicting_before_the_free_list_is_used_up),
    (testing.check_prefill_plan, prefill_before_decodes),
])
def test_chapter_07_checks_reject_wrong_answers(check, wrong):
    with pytest.raises(AssertionError):
        check(wrong)


def sse_on_one_line(data):
    return f"data: {data}\n\n"


class DecodeEachToken:
    def __init__(self, tokenizer):
        self.tok = tokenizer

    def add(self, ids):
        return self.tok.decode(ids)

    def finish(self):
        return ""


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
    (testing.check_detokenizer, DecodeEachToken),
    (testing.check_detokenizer, HoldEverything),
    (testing.check_stream_request, stream_without_abort),
    (testing.check_stream_request, stream_that_always_aborts),
])
def test_chapter_08_checks_reject_wrong_answers(check, wrong):
    with pytest.raises(AssertionError):
        check(wrong)
