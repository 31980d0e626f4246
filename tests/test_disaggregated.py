"""Chapter 15: a prefill engine and a decode engine in processes of their own (gloo on the CPU)
give one LLMEngine's tokens, give every block back, and fail their requests when one dies."""

import dataclasses
import os
import signal
import time

import pytest
import torch

import miniinfer as mi
from miniinfer.engine.disaggregated import DisaggregatedConfig, DisaggregatedEngine


def prompts_with_shared_prefixes(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    head = torch.randint(3, vocab, (21,), generator=g).tolist()
    rest = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 5, 9, 30, 2, 13)]
    return [head + r for r in rest] + rest


def params(n: int) -> list[mi.SamplingParams]:
    """Greedy, seeded sampling, and a request that ends with its first token."""
    each = [mi.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True) for _ in range(n)]
    each[1] = mi.SamplingParams(max_tokens=12, temperature=1.0, top_k=20, seed=7, ignore_eos=True)
    each[2] = mi.SamplingParams(max_tokens=1, temperature=0)
    return each


def served_by_both(config: mi.EngineConfig, prompts, each) -> tuple[list, list, DisaggregatedEngine]:
    one = mi.LLMEngine(config)
    want = [o.token_ids for o in one.generate(prompts, each, use_tqdm=False)]
    one.close()
    # The prefill engine caches prefixes and chunks prompts; the decode engine's small pool preempts.
    prefill = dataclasses.replace(config, enable_prefix_caching=True, enable_chunked_prefill=True,
                                  max_num_batched_tokens=16)
    decode = dataclasses.replace(config, num_blocks=24, max_num_seqs=6)
    pair = DisaggregatedEngine(prefill, decode)
    got = [o.token_ids for o in pair.generate(prompts, each, use_tqdm=False)]
    return want, got, pair


def all_blocks_back(pair: DisaggregatedEngine) -> None:
    """Each engine's pool as it reported after its last step: nothing held, nothing leaked."""
    stats = pair.router.stats
    assert stats["prefill"].blocks_used == 0 and stats["decode"].blocks_used == 0, stats


def test_the_pair_gives_one_engines_tokens_on_each_shape(hf_checkpoint):
    _, path, hf = hf_checkpoint
    config = mi.EngineConfig(model=str(path), num_blocks=64, block_size=3, max_num_seqs=8)
    prompts = prompts_with_shared_prefixes(hf.config.vocab_size)
    want, got, pair = served_by_both(config, prompts, params(len(prompts)))
    try:
        assert got == want
        all_blocks_back(pair)
    finally:
        pair.close()


@pytest.fixture(scope="module")
def pair():
    config = mi.EngineConfig(num_blocks=48, block_size=4, max_num_seqs=8)
    engine = DisaggregatedEngine(dataclasses.replace(config, enable_prefix_caching=True), config)
    yield engine
    engine.close()
    assert all(not c.process.is_alive() for c in (engine.router.prefill, engine.router.decode))


def flat(logprobs) -> list[float]:
    """Each position's token, rank, log-probability and top candidates, as one list of numbers."""
    return [x for t in logprobs for x in (t.token, t.rank, t.logprob, *(y for pair in t.top for y in pair))]


def test_the_course_model_streams_logprobs_and_stops_as_one_engine(pair):
    prompts = ["def add(a, b):\n", "import os\n", "class Stack:\n    def push(self, x):"]
    stop = mi.SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[199])  # a newline
    each = [mi.SamplingParams(max_tokens=10, temperature=0, logprobs=2, prompt_logprobs=1), stop,
            mi.SamplingParams(max_tokens=10, temperature=0.8, seed=3, repetition_penalty=1.3, min_tokens=4)]
    one = mi.LLMEngine(mi.EngineConfig(num_blocks=48, block_size=4))
    want = one.generate(prompts, each, use_tqdm=False)
    got = pair.generate(prompts, each, use_tqdm=False)
    for w, g in zip(want, got):
        assert (g.token_ids, g.finish_reason, g.text) == (w.token_ids, w.finish_reason, w.text)
    assert flat(got[0].logprobs) == pytest.approx(flat(want[0].logprobs), abs=1e-5)
    assert flat(got[0].prompt_logprobs[1:]) == pytest.approx(flat(want[0].prompt_logprobs[1:]), abs=1e-5)
    streamed = list(pair.stream(prompts[0], each[0]))
    assert [t for o in streamed for t in o.new_token_ids] == want[0].token_ids and streamed[-1].finished
    assert flat([lp for o in streamed for lp in o.new_logprobs]) == pytest.approx(flat(want[0].logprobs), abs=1e-5)
    all_blocks_back(pair)


def test_aborts_in_either_engine_lose_nothing_and_ids_can_be_reused(pair):
    p = mi.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for rid in ("a", "b", "c"):
        pair.add_request("def f(x):\n", p, request_id=rid)
    pair.abort("a")  # at once: in the prefill engine, or on its way to decode
    seen: dict[str, int] = {}
    while "b" not in seen:
        for o in pair.step():
            seen[o.request_id] = len(o.token_ids)
    pair.abort("b")  # now in the decode engine
    pair.add_request("import os\n", p, request_id="a")  # a reused id is a new request
    final = {}
    while pair.has_unfinished_requests():
        for o in pair.step():
            if o.finished:
                final[o.request_id] = o
    assert "b" not in final and len(final["a"].token_ids) == 40 and len(final["c"].token_ids) == 40
    time.sleep(0.5)  # the engines' last messages, after the aborts
    pair.generate(["y"], mi.SamplingParams(max_tokens=2), use_tqdm=False)
    all_blocks_back(pair)


def test_bad_pairs_are_refused_before_any_process_starts(monkeypatch):
    monkeypatch.setattr("miniinfer.engine.disaggregated.Router", None)  # would fail if reached
    base = mi.EngineConfig(num_blocks=8)
    for decode, match in [(dataclasses.replace(base, block_size=8), "block_size differ"),
                          (dataclasses.replace(base, model="/elsewhere"), "model differ"),
                          (dataclasses.replace(base, dtype=torch.bfloat16), "dtype differ"),
                          (dataclasses.replace(base, tensor_parallel_size=2), "tensor parallelism"),
                          (dataclasses.replace(base, speculative_model="course"), "speculation")]:
        with pytest.raises(ValueError, match=match):
            DisaggregatedEngine(base, decode)
    with pytest.raises(ValueError, match="own GPU"):
        DisaggregatedConfig(dataclasses.replace(base, device="cuda:0"), dataclasses.replace(base, device="cuda"))


def test_the_pair_reads_its_pools_through_the_executor(course_model):
    """The blocks a pair copies are the executor's pools (keys and values, or keys alone), not reached
    through its runner; an executor whose pools live in its ranks' processes says it has none here."""
    from miniinfer.engine.multiprocess import MultiProcessExecutor
    engine = mi.LLMEngine(mi.EngineConfig(num_blocks=8), model=course_model)
    cache = engine.executor.runner.cache
    pools = engine.executor.kv_pools()
    assert len(pools) == 2 and pools[0] is cache.k and pools[1] is cache.v
    with pytest.raises(ValueError, match="executor='in_process'"):
        MultiProcessExecutor.kv_pools(None)  # type: ignore[arg-type]


@pytest.mark.parametrize("victim", ["prefill", "decode"])
def test_a_killed_engine_fails_the_requests_with_the_reason_and_leaves_no_process(victim):
    config = mi.EngineConfig(num_blocks=128, block_size=4)
    pair = DisaggregatedEngine(config, config)
    router = pair.router
    try:
        long = mi.SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        ids = [pair.add_request(p, long) for p in ("def f(x):\n", "import os\n")]
        while not any(len(o.token_ids) > 2 for o in pair.step()):
            pass
        os.kill(getattr(router, victim).process.pid, signal.SIGKILL)
        final = {}
        while pair.has_unfinished_requests():
            final.update({o.request_id: o for o in pair.step() if o.finished})
        reason = f"the {victim} engine ended (exit code -9)"
        assert all(final[r].finish_reason == "error" and final[r].error == reason for r in ids), final
        later = pair.generate(["x"], mi.SamplingParams(max_tokens=3), use_tqdm=False)[0]
        assert later.finish_reason == "error" and later.error == reason
        for client in (router.prefill, router.decode):
            client.process.join(10)
            assert not client.process.is_alive()
    finally:
        pair.close()


def test_served_disaggregated_the_openai_client_streams_one_engines_text(tmp_path):
    """`miniinfer serve --disaggregated`: whole and streamed completions equal one engine's greedy text,
    hostile values get a 400, and SIGTERM leaves no process and no traceback."""
    import openai
    from test_server import serves_one_engines_text_and_ends_cleanly

    def hostile_values_get_400(client) -> None:
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            client.completions.create(model="pycoder", prompt="x", max_tokens=10**6)
    serves_one_engines_text_and_ends_cleanly(tmp_path / "server.log", "--disaggregated", then=hostile_values_get_400)


def test_a_fault_in_the_router_fails_its_requests_and_stops_both_engines(monkeypatch):
    from miniinfer.engine.disaggregated import Router

    def broken(self, source, outputs):
        raise KeyError("a bug")
    monkeypatch.setattr(Router, "_outputs", broken)
    pair = DisaggregatedEngine(mi.EngineConfig(num_blocks=32), mi.EngineConfig(num_blocks=32))
    try:
        out = pair.generate(["def f(x):"], mi.SamplingParams(max_tokens=4), use_tqdm=False)[0]
        assert out.finish_reason == "error" and out.error == "the router failed: KeyError: 'a bug' (in " \
            "test_a_fault_in_the_router_fails_its_requests_and_stops_both_engines.<locals>.broken)"
        for client in (pair.router.prefill, pair.router.decode):
            client.process.join(10)
            assert not client.process.is_alive()
    finally:
        pair.close()
