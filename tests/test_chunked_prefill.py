"""Chapter 07 in the engine: prefix caching and chunked prefill give transformers' greedy tokens,
round after round on one engine, under preemption; a step's budget goes to the decoders (which came
first) before a new prompt; blocks
come back (the block manager's and the scheduler's state machines are in test_prefix_cache.py
and test_scheduler.py)."""


import pytest
from test_engine import oracle

import miniinfer as mi
from miniinfer.core.block_manager import blocks_needed
from miniinfer.course.parity import run_steps, shared_workload

# (block size, preemption mode, prefix caching, chunked, token budget, max_num_seqs): budgets below
# the block size where a block holds more than one token.
CASES = [(1, "recompute", True, True, 4, 4), (4, "swap", True, True, 3, 3), (8, "recompute", True, True, 5, 4),
         (16, "swap", True, True, 12, 4), (4, "recompute", True, False, None, 4), (16, "recompute", False, True, 7, 4)]


@pytest.mark.parametrize("block_size, mode, caching, chunked, budget, max_num_seqs", CASES)
def test_greedy_equals_transformers_twice_under_preemption(hf_checkpoint, block_size, mode, caching, chunked,
                                                           budget, max_num_seqs):
    kind, folder, hf = hf_checkpoint
    prompts, params = shared_workload()
    expected = oracle((kind, "shared"), hf, prompts, params)
    sizes = [blocks_needed(len(p) + sp.max_tokens, block_size) for p, sp in zip(prompts, params)]
    num_blocks = max(sizes) * 3 // 2  # requests wait, running ones are preempted
    engine = mi.LLMEngine(mi.EngineConfig(
        model=folder, block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget, preemption_mode=mode, num_cpu_blocks=num_blocks // 2,
        enable_prefix_caching=caching, enable_chunked_prefill=chunked))
    preempted, cached = 0, []
    for _ in range(2):  # the second round finds the first round's blocks in the cache
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        final, n = run_steps(engine)
        preempted += n
        assert [final[i].token_ids for i in ids] == expected
        assert engine.block_manager.num_free_blocks == num_blocks  # cached-but-unused blocks count free
        assert engine.scheduler.cpu_block_manager is None or \
            engine.scheduler.cpu_block_manager.num_free_blocks == num_blocks // 2
        cached.append(sum(final[i].num_cached_tokens for i in ids))
    assert preempted > 0
    assert cached[1] > 0 if caching else cached == [0, 0]


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_a_prompt_sent_again_is_cached_but_its_last_token(course_model, block_size):
    engine = mi.LLMEngine(mi.EngineConfig(block_size=block_size, num_blocks=64, enable_prefix_caching=True),
                          model=course_model)
    params = mi.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    expected = mi.generate_cached(course_model, list(range(1, 49)), params)
    for length in (48, 48, 47):  # 48 is a whole number of blocks: the last block is recomputed
        prompt = list(range(1, length + 1))
        out = engine.generate([prompt], params, use_tqdm=False)[0]
        assert out.token_ids == (expected if length == 48 else mi.generate_cached(course_model, prompt, params))
        assert engine.block_manager.num_free_blocks == 64
    assert out.num_cached_tokens == (47 - 1) // block_size * block_size  # found again, up to its last token


def test_decodes_go_first_while_a_long_prompt_is_chunked(course_model):
    engine = mi.LLMEngine(mi.EngineConfig(block_size=4, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=10,
                                          enable_chunked_prefill=True), model=course_model)
    params = mi.SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    short = [engine.add_request([i + 1, i + 2], params) for i in range(3)]
    engine.step()
    engine.step()  # the three are decoding now
    long_params = mi.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    long_id = engine.add_request(list(range(1, 101)), long_params)
    pieces = []
    while not engine.requests[long_id].output_token_ids:
        engine.step()
        ran = engine.stats.scheduled
        assert all(ran[i] == 1 for i in short)  # every decoder gets its token in every step
        pieces.append(ran.get(long_id, 0))  # 0: a step scheduled before it arrived (overlap)
    assert [p for p in pieces if p] == [7] * 14 + [2] and sum(engine.stats.scheduled.values()) == 5
    final, _ = run_steps(engine)
    assert final[long_id].token_ids == mi.generate_cached(course_model, list(range(1, 101)), long_params)
    for i, rid in enumerate(short):
        assert final[rid].token_ids == mi.generate_cached(course_model, [i + 1, i + 2], params)
    assert engine.block_manager.num_free_blocks == 128


def test_unchunked_budget_must_hold_a_whole_prompt():
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        mi.LLMEngine(mi.EngineConfig(max_num_batched_tokens=100))
    engine = mi.LLMEngine(mi.EngineConfig(max_num_batched_tokens=100, max_num_seqs=8, enable_chunked_prefill=True))
    out = engine.generate([list(range(1, 301))], mi.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                          use_tqdm=False)[0]
    assert out.token_ids == mi.generate_cached(engine.model, list(range(1, 301)),
                                               mi.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))


def test_failure_mid_step_frees_everything_and_caches_nothing_wrong(course_model):
    engine = mi.LLMEngine(mi.EngineConfig(block_size=4, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=8,
                                          enable_prefix_caching=True, enable_chunked_prefill=True), model=course_model)
    params = mi.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = list(range(1, 30))
    engine.add_request(prompt, params)
    engine.step()  # its first piece: two blocks computed

    def fail(*_):
        raise RuntimeError("injected")

    hook = engine.model.model.layers[1].register_forward_hook(fail)  # after layer 0 stored the next piece
    try:
        with pytest.raises(RuntimeError, match="injected"):
            engine.step()
    finally:
        hook.remove()
    assert not engine.has_unfinished_requests() and engine.block_manager.num_free_blocks == 64
    out = engine.generate([prompt], params, use_tqdm=False)[0]
    assert out.token_ids == mi.generate_cached(course_model, prompt, params)
