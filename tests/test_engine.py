"""Chapter 06: the continuous-batching engine against transformers, its refusals and its block
accounting (the scheduler's state machine is in test_scheduler.py)."""

import random

import pytest
from conftest import eos_is

import miniinfer as mi
from miniinfer.course.parity import hf_greedy, run_steps

ORACLE: dict = {}


def workload(n: int = 24, seed: int = 0, vocab: int = 301):
    """n requests of random prompt and output lengths (greedy, EOS ignored)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in range(n)]
    params = [mi.SamplingParams(temperature=0, max_tokens=rng.randint(1, 24), ignore_eos=True) for _ in range(n)]
    return prompts, params


def oracle(key, hf, prompts, params) -> list[list[int]]:
    """transformers' greedy tokens for a workload, computed once per key (model kind, workload)."""
    if key not in ORACLE:
        ORACLE[key] = [hf_greedy(hf, p, sp.max_tokens) for p, sp in zip(prompts, params)]
    return ORACLE[key]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_greedy_equals_transformers_under_preemption(hf_checkpoint, block_size, mode):
    kind, folder, hf = hf_checkpoint
    prompts, params = workload()
    # A pool of a third of what the workload needs at once: requests wait, and running ones are preempted.
    blocks = [mi.core.block_manager.blocks_needed(len(p) + sp.max_tokens, block_size) for p, sp in zip(prompts, params)]
    need, largest = sum(blocks), max(blocks)
    num_blocks = max(need // 3, largest)
    engine = mi.LLMEngine(mi.EngineConfig(model=folder, block_size=block_size, num_blocks=num_blocks,
                                          max_num_seqs=10, preemption_mode=mode, num_cpu_blocks=num_blocks // 2))
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    final, preempted = run_steps(engine)
    assert preempted > 0
    assert [final[i].token_ids for i in ids] == oracle(kind, hf, prompts, params)
    assert all(final[i].finish_reason == "length" for i in ids)
    assert engine.block_manager.num_free_blocks == num_blocks
    assert engine.scheduler.cpu_block_manager is None or \
        engine.scheduler.cpu_block_manager.num_free_blocks == num_blocks // 2


def test_triton_kernels_in_the_engine(hf_checkpoint):
    kind, folder, hf = hf_checkpoint
    prompts, params = workload(6, seed=1)
    engine = mi.LLMEngine(mi.EngineConfig(model=folder, block_size=3, num_blocks=40, kernels="triton"))
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, sp.max_tokens) for p, sp in zip(prompts, params)]
    assert engine.block_manager.num_free_blocks == 40


@pytest.fixture(scope="module")
def course_engine():
    return mi.LLMEngine(mi.EngineConfig(num_blocks=96, block_size=4, max_num_seqs=4))


def test_generate_in_prompt_order_with_params_per_prompt_and_eos(course_engine):
    engine = course_engine
    tok = engine.tokenizer
    prompts = ["def fibonacci(n):\n", "import os\n", "class A:\n    def f(self"]
    params = [mi.SamplingParams(temperature=0, max_tokens=n) for n in (30, 5, 20)]
    full = [mi.generate_cached(engine.model, tok(p).input_ids, sp) for p, sp in zip(prompts, params)]
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == full
    assert outs[0].text == tok.decode(full[0]) and outs[1].prompt_token_ids == tok("import os\n").input_ids
    eos = full[0][3]
    with eos_is(engine.model, eos, engine):
        out = engine.generate([prompts[0]], params[0], use_tqdm=False)[0]
    assert out.token_ids == full[0][:full[0].index(eos) + 1] and out.finish_reason == "stop"
    assert engine.block_manager.num_free_blocks == 96


def test_stream_yields_tokens_as_they_arrive(course_engine):
    engine = course_engine
    params = mi.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    pieces = list(engine.stream("import os\n", params))
    assert all(len(p.new_token_ids) == 1 for p in pieces) and len(pieces) == 12
    assert sum((p.new_token_ids for p in pieces), []) == pieces[-1].token_ids
    assert pieces[-1].finished and not any(p.finished for p in pieces[:-1])
    gen = engine.stream("import os\n", params)
    next(gen)
    gen.close()  # the caller walks away: its blocks come back
    assert not engine.has_unfinished_requests() and engine.block_manager.num_free_blocks == 96


def test_abort_frees_blocks_and_others_carry_on(course_engine):
    engine = course_engine
    params = mi.SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    a = engine.add_request([5, 6, 7, 8, 9], params)
    b = engine.add_request([10, 11, 12], params)
    for _ in range(5):
        engine.step()
    last = engine.abort(a)
    assert last.finished and last.finish_reason == "abort" and len(last.token_ids) == 5
    assert engine.abort(a) is None and engine.abort("no such request") is None
    final, _ = run_steps(engine)
    assert final[b].token_ids == mi.generate_cached(engine.model, [10, 11, 12], params)
    assert engine.block_manager.num_free_blocks == 96


def test_failure_mid_step_frees_that_steps_blocks(course_engine):
    engine = course_engine
    params = mi.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ids = [engine.add_request([3 + i, 4, 5], params) for i in range(3)]
    engine.step()

    def fail(*_):
        raise RuntimeError("injected")

    hook = engine.model.model.layers[1].register_forward_hook(fail)  # after layer 0 stored its K/V
    try:
        with pytest.raises(RuntimeError, match="injected"):
            engine.step()
    finally:
        hook.remove()
    assert not engine.has_unfinished_requests() and all(i not in engine.requests for i in ids)
    assert engine.block_manager.num_free_blocks == 96
    out = engine.generate([[3, 4, 5]], params, use_tqdm=False)[0]  # and it keeps serving
    assert out.token_ids == mi.generate_cached(engine.model, [3, 4, 5], params)



@pytest.mark.parametrize("swap", [False, True])
def test_a_request_whose_own_data_fails_fails_alone(course_model, swap):
    """A top_k set to a string after the door checked it: that request finishes with "error" at its
    next step, the others of every step give exactly their tokens alone, nothing leaks. With a pool
    of 12 blocks the step it fails in also preempts (swap: its block moves must still happen)."""
    config = mi.EngineConfig(num_blocks=12, block_size=4, max_num_seqs=4,
                             preemption_mode="swap" if swap else "recompute")
    engine = mi.LLMEngine(config, model=course_model)
    greedy = mi.SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    seeded = mi.SamplingParams(temperature=0.8, top_p=0.9, max_tokens=14, seed=7, ignore_eos=True)
    alone = [engine.generate([p], sp, use_tqdm=False)[0].token_ids for p, sp in [([3, 4, 5], greedy), ([6, 7], seeded)]]

    def start(engine) -> list[str]:
        bad = mi.SamplingParams(temperature=0.5, max_tokens=14, ignore_eos=True)
        return [engine.add_request(p, sp) for p, sp in [([3, 4, 5], greedy), ([8, 9, 10, 11], bad), ([6, 7], seeded)]]

    a, bad, b = start(engine)
    final: dict = {}

    def preempted() -> list[str]:  # out of the runner, to come back
        return [r for r, s in engine.requests.items() if s.output_token_ids and s.status is not mi.Status.RUNNING]

    while not preempted():
        final.update((o.request_id, o) for o in engine.step() if o.finished)
    # The runner takes a request's data in when the request (re)enters it: the preempted one fails
    # when it comes back, in a step that moves its blocks in (swap) or recomputes it.
    (victim,) = preempted()
    engine.requests[victim].params.top_k = "40"
    final.update(run_steps(engine)[0])
    assert final[victim].finish_reason == "error" and final[victim].error.startswith("TypeError")
    assert 0 < len(final[victim].token_ids) < 14
    assert [final[r].token_ids for r in (a, b) if r != victim] == [t for r, t in zip((a, b), alone) if r != victim]
    assert engine.block_manager.num_free_blocks == 12 and not engine.requests
    # A step whose only request fails runs nothing, and the engine goes on.
    alone_bad = engine.add_request([8, 9], mi.SamplingParams(max_tokens=3))
    engine.requests[alone_bad].params.temperature = "hot"
    assert [(o.request_id, o.finish_reason) for o in engine.step()] == [(alone_bad, "error")]
    assert engine.generate([[3, 4, 5]], greedy, use_tqdm=False)[0].token_ids == alone[0]
    assert engine.block_manager.num_free_blocks == 12


@pytest.mark.parametrize("prompt, params, match", [
    ([], mi.SamplingParams(), "empty"),
    ("", mi.SamplingParams(), "empty"),
    ([1, 2, 4096], mi.SamplingParams(), "token ids"),
    ([1, -1], mi.SamplingParams(), "token ids"),
    ([1, 2.0], mi.SamplingParams(), "token ids"),
    ([1] * 2040, mi.SamplingParams(max_tokens=9), "context"),
    ([1] * 300, mi.SamplingParams(max_tokens=100), "whole pool"),
    ([1, 2], {"temperature": 0}, "SamplingParams"),
])
def test_bad_requests_are_refused_and_change_nothing(course_engine, prompt, params, match):
    engine = course_engine
    good = engine.add_request([7, 8, 9], mi.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    engine.step()
    free = engine.block_manager.num_free_blocks
    waiting, running = list(engine.scheduler.waiting), list(engine.scheduler.running)
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, params)
    with pytest.raises(ValueError, match=match):  # generate checks every prompt before queueing any
        engine.generate([[1, 2, 3], prompt], params if isinstance(params, mi.SamplingParams) else [params, params],
                        use_tqdm=False)
    assert engine.block_manager.num_free_blocks == free
    assert engine.scheduler.waiting == waiting and engine.scheduler.running == running
    final, _ = run_steps(engine)
    assert final[good].token_ids == mi.generate_cached(engine.model, [7, 8, 9], mi.SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True))


def test_bad_engine_configs_are_refused():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        mi.EngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="block_size"):
        mi.EngineConfig(block_size=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        mi.LLMEngine(mi.EngineConfig(max_num_batched_tokens=100))
    with pytest.raises(ValueError, match="policy"):
        mi.LLMEngine(mi.EngineConfig(policy="random"))
    with pytest.raises(ValueError, match="preemption_mode"):
        mi.LLMEngine(mi.EngineConfig(preemption_mode="drop"))
    with pytest.raises(mi.CheckpointError):
        mi.LLMEngine(mi.EngineConfig(model="/no/such/folder"))


def test_cpu_pool_default_and_duplicate_ids():
    engine = mi.LLMEngine(mi.EngineConfig())
    per_block = 2 * 6 * 16 * 2 * 64 * 4  # K and V, 6 layers, 16 tokens, 2 KV heads of 64 floats
    assert engine.block_manager.num_blocks == mi.worker.model_runner.CPU_KV_BYTES // per_block
    engine.add_request([1, 2], request_id="x")
    with pytest.raises(ValueError, match="in use"):
        engine.add_request([1, 2], request_id="x")


def test_a_tokenizer_given_is_the_one_used(tmp_path):
    """A checkpoint without tokenizer files, served with the course tokenizer given: text in and out
    goes through it (the engine loads the checkpoint's own only when none is given)."""
    import transformers
    tok = mi.load_tokenizer()
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    engine = mi.LLMEngine(mi.EngineConfig(model=str(tmp_path), num_blocks=16), tokenizer=tok)
    assert engine.tokenizer is tok
    out = engine.generate(["def f():"], mi.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                          use_tqdm=False)[0]
    assert out.prompt_token_ids == tok.encode("def f():") and out.text == tok.decode(out.token_ids)
    with pytest.raises(ValueError, match="tokenizer"):  # none given, none in the checkpoint: ids only
        mi.LLMEngine(mi.EngineConfig(model=str(tmp_path), num_blocks=16)).add_request("text")


def test_priority_arrival_preempts_a_less_urgent_one(course_engine):
    engine = mi.LLMEngine(mi.EngineConfig(num_blocks=12, block_size=4, max_num_seqs=2, policy="priority"),
                          model=course_engine.model)
    params = mi.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    low = [engine.add_request([i + 1] * 8, params, priority=5) for i in range(2)]
    engine.step()
    urgent = engine.add_request([9] * 8, params, priority=-1)
    engine.step()
    running = {s.request_id for s in engine.scheduler.running}
    assert urgent in running and len(running & set(low)) == 1  # the later of the two low ones gave way
    assert low[1] not in running
    final, _ = run_steps(engine)
    for rid, prompt in zip(low + [urgent], [[1] * 8, [2] * 8, [9] * 8]):
        assert final[rid].token_ids == mi.generate_cached(engine.model, prompt, params)
    assert engine.block_manager.num_free_blocks == 12


def test_seeded_request_samples_the_same_alone_or_in_any_batch(course_engine):
    model = course_engine.model
    seeded = mi.SamplingParams(temperature=0.9, top_k=50, top_p=0.9, max_tokens=24, seed=1234, ignore_eos=True)
    alone = mi.LLMEngine(mi.EngineConfig(num_blocks=64, block_size=4), model=model).generate(
        [[1, 2, 3]], seeded, use_tqdm=False)[0].token_ids
    others = [mi.SamplingParams(temperature=t, top_p=p, max_tokens=20, ignore_eos=True) for t, p in
              [(0, 1), (1.3, 0.5), (0.7, 1.0)]]
    # A small pool: the seeded request is also preempted and recomputed on the way.
    busy = mi.LLMEngine(mi.EngineConfig(num_blocks=16, block_size=4), model=model)
    outs = busy.generate([[9, 9], [1, 2, 3], [4] * 20, [5, 6]], [others[0], seeded, others[1], others[2]],
                         use_tqdm=False)
    assert outs[1].token_ids == alone
    other_seed = mi.SamplingParams(**{**seeded.__dict__, "seed": 99})
    assert busy.generate([[1, 2, 3]], other_seed, use_tqdm=False)[0].token_ids != alone


def test_timeline_records_every_step(course_engine):
    prompts, params = workload(8, seed=3)
    num_blocks = 12  # block size 4: some requests wait, some are preempted and recomputed
    engine = mi.LLMEngine(mi.EngineConfig(block_size=4, num_blocks=num_blocks, max_num_seqs=4),
                          model=course_engine.model)
    steps = mi.trace_steps(engine, prompts, params)
    preempted = [r for s in steps for r in s.preempted]
    assert preempted and steps[-1].free_blocks == num_blocks
    for rid, (p, sp) in enumerate(zip(prompts, params)):
        rid, in_pool, generated = str(rid), False, 0
        for s in steps:  # a preemption (before the forward) drops its K/V: the next run recomputes
            in_pool = in_pool and rid not in s.preempted
            if rid in s.ran:
                assert s.ran[rid] == (1 if in_pool else len(p) + generated)
                in_pool, generated = True, generated + 1  # every step it runs in yields a token
        assert generated == sp.max_tokens
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots()
    mi.draw_timeline(steps, ax)
    assert len(ax.get_yticks()) == len(prompts)
    plt.close(fig)
