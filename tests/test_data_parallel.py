"""Chapter 16: data-parallel replicas behind a router give one engine's greedy tokens under every rule,
give every block back, keep serving when one replica dies, and refuse what they cannot run."""

import dataclasses
import os
import re
import signal
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_disaggregated import params, prompts_with_shared_prefixes

import miniinfer as mi
from miniinfer.engine.data_parallel import (
    POLICIES,
    CacheGuess,
    Replicas,
    ReplicatedEngine,
    cache_aware,
    least_loaded,
    replica_configs,
    round_robin,
)


def blocks_back(engine: ReplicatedEngine) -> None:
    """Each replica's pool as it reported after its last step: nothing held."""
    assert all(s.blocks_used == 0 for s in engine.router.stats.values()), engine.router.stats


@pytest.mark.parametrize("rule", list(POLICIES))
def test_replicas_give_one_engines_tokens_under_every_rule(hf_checkpoint, rule):
    _, path, hf = hf_checkpoint
    config = mi.EngineConfig(model=str(path), num_blocks=48, block_size=3, max_num_seqs=4,
                             enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=16)
    prompts = prompts_with_shared_prefixes(hf.config.vocab_size)
    each = params(len(prompts))
    want = [o.token_ids for o in mi.LLMEngine(config).generate(prompts, each, use_tqdm=False)]
    replicas = ReplicatedEngine(dataclasses.replace(config, data_parallel_size=2, router=rule))
    try:
        got = [o.token_ids for o in replicas.generate(prompts, each, use_tqdm=False)]
        assert got == want
        assert sorted(replicas.router.placed) != [0, len(prompts)]  # both served
        assert replicas.router.loads == [0, 0]
        blocks_back(replicas)
    finally:
        replicas.close()


@pytest.mark.parametrize("rule, hits", [("prefix", [20, 20]), ("round_robin", [0, 0])])
def test_the_prefix_rule_sends_a_prompt_where_its_prefix_went(rule, hits):
    """Two prompts over two heads, one on each replica; then the heads again in the other order: the prefix
    rule finds each head where it went (20 tokens cached), round robin sends each to the other replica."""
    replicas = ReplicatedEngine(mi.EngineConfig(num_blocks=128, block_size=4, enable_prefix_caching=True,
                                                data_parallel_size=2, router=rule))
    heads = [list(range(10, 30)), list(range(500, 520))]
    try:
        busy = mi.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        for head in heads:
            replicas.add_request(head + [40], busy)
        while not all(len(o.token_ids) > 1 for o in replicas.step()):  # both prompts computed
            pass
        again = replicas.generate([heads[1] + [41], heads[0] + [42]], mi.SamplingParams(max_tokens=2), use_tqdm=False)
        assert [o.num_cached_tokens for o in again] == hits and replicas.router.placed == [2, 2]
        while replicas.has_unfinished_requests():
            replicas.step()
    finally:
        replicas.close()


def test_a_killed_replica_fails_its_own_requests_and_the_others_serve_on():
    replicas = ReplicatedEngine(mi.EngineConfig(num_blocks=128, block_size=4, data_parallel_size=2,
                                                router="round_robin"))
    router = replicas.router
    try:
        long = mi.SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
        ids = [replicas.add_request(p, long) for p in ("def f(x):\n", "import os\n")]  # one each
        while not any(len(o.token_ids) > 2 for o in replicas.step()):
            pass
        os.kill(router.clients[1].process.pid, signal.SIGKILL)
        final = {}
        while replicas.has_unfinished_requests():
            final.update({o.request_id: o for o in replicas.step() if o.finished})
        assert final[ids[0]].finish_reason == "length" and len(final[ids[0]].token_ids) == 60
        assert final[ids[1]].finish_reason == "error" and final[ids[1]].error == "replica 1 ended (exit code -9)"
        later = replicas.generate(["a", "b", "c"], mi.SamplingParams(max_tokens=3), use_tqdm=False)
        assert [o.finish_reason for o in later] == ["length"] * 3 and router.placed == [4, 1]
        os.kill(router.clients[0].process.pid, signal.SIGKILL)
        last = replicas.generate(["x"], mi.SamplingParams(max_tokens=3), use_tqdm=False)[0]
        assert last.finish_reason == "error" and "every replica has ended" in last.error
    finally:
        replicas.close()
    assert not any(c.process.is_alive() for c in router.clients.values())


def test_the_server_serves_through_replicas():
    """AsyncLLMEngine serves Replicas(config) through a router (as `miniinfer serve --data-parallel-size` does)."""
    import asyncio

    config = mi.EngineConfig(num_blocks=64, block_size=4, data_parallel_size=2, router="least_loaded")
    one = mi.LLMEngine(dataclasses.replace(config, data_parallel_size=1))
    prompts = ["def add(a, b):\n", "import os\n", "class Stack:\n"]
    greedy = mi.SamplingParams(max_tokens=12, temperature=0)
    want = [o.text for o in one.generate(prompts, greedy, use_tqdm=False)]

    async def serve() -> list[str]:
        engine = mi.AsyncLLMEngine(Replicas(config))
        try:
            async def text(p):
                return [o async for o in engine.generate(p, greedy)][-1].text
            return await asyncio.gather(*(text(p) for p in prompts))
        finally:
            engine.close()
    assert asyncio.run(serve()) == want


def test_served_by_replicas_the_openai_client_gets_one_engines_text(tmp_path):
    """`miniinfer serve --data-parallel-size 2 --router prefix`: whole and streamed completions equal one
    engine's greedy text; SIGTERM leaves no process and no traceback."""
    from test_server import serves_one_engines_text_and_ends_cleanly

    serves_one_engines_text_and_ends_cleanly(tmp_path / "server.log", "--data-parallel-size", "2", "--router", "prefix")


def test_bad_replica_setups_are_refused_with_the_knob_to_turn(monkeypatch):
    with pytest.raises(ValueError, match="data_parallel_size must be a positive int"):
        mi.EngineConfig(data_parallel_size=0)
    with pytest.raises(ValueError, match="router must be one of"):
        mi.EngineConfig(router="random")
    with pytest.raises(ValueError, match="ReplicatedEngine"):
        mi.LLMEngine(mi.EngineConfig(data_parallel_size=2))
    with pytest.raises(ValueError, match="data_parallel_size >= 2"):
        ReplicatedEngine(mi.EngineConfig())
    from miniinfer.engine.disaggregated import DisaggregatedConfig
    with pytest.raises(ValueError, match="speculation and replicas are not supported"):
        DisaggregatedConfig(mi.EngineConfig(data_parallel_size=2), mi.EngineConfig())
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="would take the same GPUs"):
        replica_configs(mi.EngineConfig(device="cuda", data_parallel_size=2, tensor_parallel_size=2))
    own = replica_configs(mi.EngineConfig(device="cuda", data_parallel_size=2))
    assert [c.device for c in own] == ["cuda:0", "cuda:1"] and {c.data_parallel_size for c in own} == {1}
    shared = replica_configs(mi.EngineConfig(device="cuda", data_parallel_size=4, gpu_memory_utilization=0.8))
    assert [round(c.gpu_memory_utilization, 3) for c in shared] == [0.2, 0.4, 0.6, 0.8]


loads_and_matches = st.integers(1, 6).flatmap(lambda r: st.tuples(
    st.lists(st.integers(0, 9), min_size=r, max_size=r), st.lists(st.integers(0, 40), min_size=r, max_size=r)))


@given(loads_and_matches, st.integers(0, 100), st.integers(0, 30))
def test_the_rules_pick_as_their_formulas_say(case, n, balance):
    matched, loads = case
    r = len(loads)
    assert round_robin(matched, loads, n) == n % r
    assert loads[least_loaded(matched, loads, n)] == min(loads)
    chosen = cache_aware(matched, loads, n, balance)
    if max(loads) - min(loads) > balance:
        assert loads[chosen] == min(loads)
    else:
        assert matched[chosen] == max(matched)
        assert loads[chosen] == min(loads[i] for i in range(r) if matched[i] == max(matched))


@given(st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=14), min_size=1, max_size=8), st.integers(1, 6))
def test_the_cache_guess_holds_the_newest_blocks_and_matches_whole_prefixes(prompts, capacity):
    guess = CacheGuess(block_size=2, capacity=capacity)
    added: list[int] = []
    for p in prompts:
        keys = guess.keys(p)
        guess.add(keys)
        added = [k for k in added if k not in keys] + keys
    assert list(guess.hashes) == added[-capacity:]
    last = guess.keys(prompts[-1])
    held = guess.matched(last)
    assert last[:held] == [k for k in last[:held] if k in guess.hashes]
    assert held == len(last) or last[held] not in guess.hashes


def test_routed_over_http_two_servers_give_one_engines_text_and_survive_one_dying(tmp_path):
    """`miniinfer route` in front of two `miniinfer serve` (two "machines" on this one): whole and streamed
    completions and chats equal one engine's text; the prefix rule sends a prompt's longer versions to the
    worker its first went to; with one worker killed, every later request is answered by the other."""
    import subprocess
    import sys

    import httpx
    from test_server import free_port, gives_one_engines_text, start_server

    workers = [start_server(tmp_path / f"worker{i}.log", "--num-blocks", "200", "--block-size", "8",
                            "--enable-prefix-caching") for i in range(2)]
    port = free_port()
    route = subprocess.Popen([sys.executable, "-m", "miniinfer", "route", "--port", str(port), "--router", "prefix",
                              *[a for _, url in workers for a in ("--worker", url)]],
                             stdout=open(tmp_path / "route.log", "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        client = gives_one_engines_text(url, 16, num_blocks=200, block_size=8)
        prompts = ["def add(a, b):\n", "import os\n", "class Stack:\n"]
        chat = client.chat.completions.create(model="pycoder", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=8, temperature=0)
        assert chat.choices[0].message.content is not None
        assert [m.id for m in client.models.list().data] == ["pycoder"]

        def served() -> list[int]:
            return [int(re.search(r"^miniinfer_prompt_tokens_total (\d+)", httpx.get(u + "/metrics").text, re.M)[1])
                    for _, u in workers]
        head = "# a long shared head, more than one block of text: " + "x = 1\n" * 30
        before = served()
        for i in range(4):
            client.completions.create(model="pycoder", prompt=head + f"y{i} = ", max_tokens=2)
        grew = [a - b for a, b in zip(served(), before)]
        assert sorted(g > 0 for g in grew) == [False, True], grew  # all four where the first went
        os.killpg(workers[0][0].pid, signal.SIGKILL)
        later = [client.completions.create(model="pycoder", prompt=p, max_tokens=4, temperature=0).choices[0]
                 .finish_reason for p in prompts * 2]  # greedy: sampled, a prompt's end could come within 4 tokens
        assert later == ["length"] * 6
    finally:
        route.terminate()
        route.wait(30)
        for proc, _ in workers:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(60)
