"""Chapter 08: AsyncLLMEngine serves concurrent streams with the engine's exact tokens, frees the
blocks of clients that leave, refuses bad requests at once and keeps serving."""

import asyncio
import contextlib
import dataclasses
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import miniinfer as mi


@pytest.fixture(params=["thread", "process"])
def engine(request, course_model):
    """The engine stepped by a thread of this process, or run in a process of its own."""
    config = mi.EngineConfig(num_blocks=64, block_size=4, max_num_seqs=6)
    eng = mi.AsyncLLMEngine(mi.LLMEngine(config, model=course_model) if request.param == "thread" else config)
    yield eng
    eng.close()
    assert not eng.client.is_alive()
    assert isinstance(eng.client, mi.engine.core_client.InprocClient) or not eng.client.process.is_alive()


async def collect(engine, prompt, params, leave_after=None):
    tokens = []
    async for out in engine.generate(prompt, params):
        tokens += out.new_token_ids
        assert tokens == out.token_ids
        if leave_after is not None and len(tokens) >= leave_after:
            break
    return tokens


async def drained(engine):
    """Wait until the engine has taken every command and holds no request and no block."""
    for _ in range(500):
        s = engine.stats
        if engine.client.commands.empty() and s.running + s.waiting + s.swapped + s.blocks_used == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"requests left behind: {engine.stats}")


def test_concurrent_streams_give_the_engines_tokens(engine, course_model):
    prompts = [[i + 1, i + 2, 7] for i in range(10)]  # more than max_num_seqs and than the pool holds at once
    params = mi.SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    async def main():
        got = await asyncio.gather(*(collect(engine, p, params) for p in prompts))
        await drained(engine)
        return got

    assert asyncio.run(main()) == [mi.generate_cached(course_model, p, params) for p in prompts]
    assert engine.stats.blocks_total == 64


def test_clients_that_leave_free_their_blocks(engine):
    params = mi.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    async def main():
        got = await asyncio.gather(*(collect(engine, [5, i], params, leave_after=2) for i in range(8)))
        await drained(engine)
        return got

    assert all(len(t) >= 2 for t in asyncio.run(main()))
    if isinstance(engine.client, mi.engine.core_client.InprocClient):
        assert engine.client.engine.block_manager.num_free_blocks == 64 and not engine.client.engine.requests


def test_a_request_starts_with_its_stream_and_a_stream_dropped_unread_ends_it(engine):
    params = mi.SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)

    async def main():
        outputs = engine.generate([5, 6], params)  # not read: the engine runs it all the same
        for _ in range(500):
            if engine.generated_tokens:
                break
            await asyncio.sleep(0.01)
        del outputs  # no `finally` ran (the generator never started): its collection aborts the request
        await drained(engine)

    asyncio.run(main())
    assert 0 < engine.generated_tokens < 240 and not engine.streams


def test_bad_requests_are_refused_at_once_and_serving_goes_on(engine, course_model):
    params = mi.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    async def main():
        for bad in ([], [1, 10 ** 6]):
            with pytest.raises(ValueError):
                await collect(engine, bad, params)
        return await collect(engine, [3, 4], params)

    assert asyncio.run(main()) == mi.generate_cached(course_model, [3, 4], params)


def test_a_failed_step_ends_its_streams_frees_their_blocks_and_serving_goes_on(course_model):
    """Thread mode (the runner can be patched in this process): the third forward raises."""
    eng = mi.AsyncLLMEngine(mi.LLMEngine(mi.EngineConfig(num_blocks=64, block_size=4, max_num_seqs=6),
                                         model=course_model))
    runner, forwards = eng.client.engine.executor.runner, []
    launch = runner.launch

    def fail_the_third(out):
        forwards.append(len(out.num_new_tokens))
        if len(forwards) == 3:
            raise RuntimeError("injected failure")
        return launch(out)

    runner.launch = fail_the_third
    params = mi.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [[i + 1, 2] for i in range(4)]

    async def main():
        got = await asyncio.gather(*(collect(eng, p, params) for p in prompts), return_exceptions=True)
        await drained(eng)
        return got, await collect(eng, [3, 4], params)

    try:
        got, after = asyncio.run(asyncio.wait_for(main(), 60))  # a stream left waiting fails, not hangs
    finally:
        eng.close()
    failed = [g for g in got if isinstance(g, RuntimeError)]
    assert failed and all(str(g) == "RuntimeError: injected failure" for g in failed)
    assert all(g == mi.generate_cached(course_model, p, params) for g, p in zip(got, prompts) if g not in failed)
    assert after == mi.generate_cached(course_model, [3, 4], params)
    assert eng.client.engine.block_manager.num_free_blocks == 64 and not eng.client.engine.requests


def test_a_request_that_fails_on_its_own_data_ends_only_its_stream(course_model):
    """Thread mode (the request's parameters are this process's object): a stream whose top_k turned
    into a string after its SamplingParams were checked ends with the error when its data reaches the
    runner; the streams beside it are exact."""
    eng = mi.AsyncLLMEngine(mi.LLMEngine(mi.EngineConfig(num_blocks=64, block_size=4, max_num_seqs=6),
                                         model=course_model))
    params = mi.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    bad = mi.SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True)
    prompts = [[i + 1, 2] for i in range(4)]

    async def spoiled():
        bad.top_k = "many"
        outs = [out async for out in eng.generate([9, 9, 9], bad)]
        return outs[-1].token_ids

    async def main():
        got = await asyncio.gather(spoiled(), *(collect(eng, p, params) for p in prompts), return_exceptions=True)
        await drained(eng)
        return got

    try:
        got = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        eng.close()
    assert isinstance(got[0], RuntimeError) and str(got[0]).startswith("the request failed: TypeError")
    assert got[1:] == [mi.generate_cached(course_model, p, params) for p in prompts]
    assert eng.client.engine.block_manager.num_free_blocks == 64 and not eng.client.engine.requests


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_text_is_the_tokenizers_decoding_in_both_modes(mode, course_model):
    """The front end builds each RequestOutput, with its text, whichever side runs the engine."""
    tok = mi.load_tokenizer(None)
    config = mi.EngineConfig(num_blocks=64, block_size=4)
    eng = mi.AsyncLLMEngine(mi.LLMEngine(config, model=course_model, tokenizer=tok) if mode == "thread" else config)
    params = mi.SamplingParams(temperature=0, max_tokens=16)

    async def main():
        async for out in eng.generate("def add(a, b):\n", params):
            assert out.text == tok.decode(out.token_ids)
        return out

    try:
        out = asyncio.run(main())
    finally:
        eng.close()
    assert out.finished and out.text and out.text == tok.decode(out.token_ids)


def test_shutdown_answers_every_command_taken_before_it(course_model):
    """run_engine with scripted commands: a request refused in the same batch as Shutdown still hears
    why, and the one queued before Shutdown ends as aborted, its blocks back."""
    engine = mi.LLMEngine(mi.EngineConfig(num_blocks=16, block_size=4), model=course_model)
    params = mi.SamplingParams(max_tokens=4)
    add = mi.engine.core.AddRequest
    script = [add("a", [1, 2], params), add("a", [3], params),
              mi.engine.core.Shutdown()]
    emitted = []
    mi.engine.core.run_engine(engine, lambda block: script.pop(0) if script else None,
                               lambda outputs, stats: emitted.append(outputs))
    [outputs] = emitted
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", "error"), ("a", "abort")]
    assert "already in use" in outputs[0].error and outputs[1].error == "the engine was closed"
    assert engine.block_manager.num_free_blocks == 16 and not engine.requests


def test_outputs_of_several_steps_go_as_one():
    """What piles up while the front end reads slowly crosses the pipe as one message."""
    E, S = mi.engine.core.EngineOutput, mi.engine.core.EngineStats
    steps = [([E("a", [1]), E("b", [2], num_cached_tokens=16)], S(running=2, new_tokens=2, step_seconds=0.1, steps=1)),
             ([E("a", [3], "stop"), E("b", [4], num_cached_tokens=16)], S(running=1, new_tokens=2, step_seconds=0.2,
                                                                        steps=1)),
             ([E("b", [], "error", error="boom")], S(running=0, step_seconds=0.3, steps=1))]
    outputs, stats = mi.engine.core_client.coalesce(steps)
    assert [(o.request_id, o.new_token_ids, o.finish_reason, o.num_cached_tokens, o.error) for o in outputs] == [
        ("a", [1, 3], "stop", 0, None), ("b", [2, 4], "error", 0, "boom")]
    assert (stats.running, stats.new_tokens, stats.steps, round(stats.step_seconds, 6)) == (0, 4, 3, 0.6)
    assert steps[0][0][0].new_token_ids == [1] and mi.engine.core_client.coalesce(steps[:1]) == steps[0]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.text(min_size=1, max_size=4), st.lists(st.integers(0, 2 ** 31), max_size=3),
                          st.sampled_from([None, "stop", "length", "abort", "error"]), st.integers(0, 64),
                          st.one_of(st.none(), st.text(max_size=8)),
                          st.one_of(st.none(), st.lists(st.tuples(st.integers(0, 9), st.floats(-9, 0)), max_size=3))),
                max_size=8))
def test_outputs_cross_the_pipe_packed_unchanged(rows):
    outputs = [mi.engine.core.EngineOutput(*row) for row in rows]
    assert mi.engine.core_client.unpack(pickle.loads(pickle.dumps(mi.engine.core_client.pack(outputs)))) == outputs


def test_a_request_prepared_in_a_thread_lets_the_others_step_on(course_model, monkeypatch):
    """Thread mode (a preparation registered in this process): a request whose preparation waits (as a
    grammar that compiles slowly) waits for it in a thread while another request streams; then it runs
    exactly. One aborted while preparing never runs; one whose preparation fails ends with the reason.
    No clock: the preparation ends once the other request has streamed 20 tokens, which it could never do
    were the preparation holding up the engine's steps."""
    import threading
    import time

    streamed, aborted = threading.Event(), threading.Event()

    def slow(params, tokenizer, info, config):
        if params.seed == 1:
            return lambda: streamed.wait(30)
        if params.seed == 3:
            return lambda: aborted.wait(30)
        if params.seed == 2:
            return lambda: (_ for _ in ()).throw(ValueError("it does not prepare"))
        return None

    config = mi.EngineConfig(num_blocks=64)
    components = dataclasses.replace(mi.worker.components.build_components(config), prepares=(slow,))
    eng = mi.AsyncLLMEngine(mi.LLMEngine(config, model=course_model, components=components))
    queued, enqueue = [], eng.client.engine.enqueue
    eng.client.engine.enqueue = lambda *a, **k: queued.append(enqueue(*a, **k))
    free = mi.SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    held = mi.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, seed=1)

    async def timed(prompt, params, after_20=None):
        times = []
        async for out in eng.generate(prompt, params):
            times += [time.perf_counter()] * len(out.new_token_ids)
            if after_20 is not None and len(times) >= 20:
                after_20.set()
        return times

    async def main():
        free_times, held_times = await asyncio.gather(timed([5, 6], free, streamed), timed([7, 8], held))
        try:
            await collect(eng, [1, 2], mi.SamplingParams(max_tokens=4, seed=2))
            failed = None
        except RuntimeError as err:
            failed = err
        leaver = asyncio.ensure_future(collect(eng, [3, 4], dataclasses.replace(held, seed=3)))
        await asyncio.sleep(0.1)
        leaver.cancel()  # aborted while it prepares
        with contextlib.suppress(asyncio.CancelledError):
            await leaver  # its abort is sent ...
        while not eng.client.commands.empty():
            await asyncio.sleep(0.01)  # ... and taken by the engine before the preparation may end
        aborted.set()
        await asyncio.sleep(0.5)  # its preparation ends; the engine must drop the request, not run it
        await drained(eng)
        return free_times, held_times, failed

    try:
        free_times, held_times, failed = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        eng.close()
    assert streamed.is_set() and held_times[0] > free_times[19]  # it waited while the other streamed
    assert len(held_times) == 8 and failed is not None and "it does not prepare" in str(failed)
    assert len(queued) == 2  # the free and the held request: not the one that failed, nor the one aborted
    assert eng.client.engine.block_manager.num_free_blocks == 64 and not eng.client.engine.requests
