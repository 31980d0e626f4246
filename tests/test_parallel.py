"""Chapter 11: tensor parallelism on the CPU, ranks as gloo processes. Each rank loads only its slices,
greedy tokens with 2 and 4 ranks equal transformers' (continuous batching, preemption, prefix caching,
chunked prefill), a rank that dies or fails ends the engine's requests with the reason and leaves
no process behind, and bad configurations are refused before any process starts."""

import dataclasses
import json
import multiprocessing
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from conftest import started_below
from test_engine import oracle

import miniinfer as mi
from miniinfer.core.block_manager import blocks_needed
from miniinfer.course.parity import make_hf_model, run_steps, shared_workload
from miniinfer.layers.parallel import Shard, shard_model
from miniinfer.worker.components import build_components
from miniinfer.worker.model_runner import ModelRunner

# 8 query heads and 2 KV heads: 4 ranks split them (each KV head on two ranks)
FOUR_WAY = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=10)


def load_rank(folder, rank: int, size: int) -> mi.Transformer:
    return mi.load_model(folder, prepare=lambda m: shard_model(m, Shard(rank, size)))


@pytest.mark.parametrize("size", [2, 4])
def test_the_ranks_slices_make_up_the_checkpoint(tmp_path, size):
    """Without any process: the ranks' q/k/v, o, MLP and vocabulary shares, put back together, are the
    checkpoint's tensors (with 4 ranks over 2 KV heads, each KV head is on two ranks)."""
    hf = make_hf_model("llama", **FOUR_WAY)
    hf.save_pretrained(tmp_path)
    full = mi.load_model(tmp_path)
    ranks = [load_rank(tmp_path, r, size) for r in range(size)]
    D, Hq, Hk = full.cfg.head_dim, full.cfg.num_heads, full.cfg.num_kv_heads
    q, k, v = full.model.layers[1].self_attn.qkv_proj.weight.split([Hq * D, Hk * D, Hk * D])
    parts = [m.model.layers[1].self_attn.qkv_proj.weight.split(m.model.layers[1].self_attn.sizes) for m in ranks]
    assert torch.equal(torch.cat([p[0] for p in parts]), q)
    per = max(1, size // Hk)  # ranks that hold the same KV head
    assert torch.equal(torch.cat([p[1] for p in parts[::per]]), k)
    assert torch.equal(torch.cat([p[2] for p in parts[::per]]), v)
    assert torch.equal(torch.cat([m.model.layers[1].mlp.down_proj.weight for m in ranks], dim=1),
                       full.model.layers[1].mlp.down_proj.weight)
    emb = torch.cat([m.model.embed_tokens.weight for m in ranks])
    assert torch.equal(emb[:full.cfg.vocab_size], full.model.embed_tokens.weight)
    assert not emb[full.cfg.vocab_size:].any()  # the padding rows
    assert ranks[0].cfg.num_kv_heads == max(1, Hk // size) and ranks[0].cfg.vocab_size == full.cfg.vocab_size


def test_greedy_with_two_ranks_equals_transformers(hf_checkpoint):
    """Llama, Qwen2 (q/k/v biases), Qwen3 (q/k norms, tied embeddings): two rounds of a shared-prefix
    workload under preemption (swap), prefix caching and chunked prefill; every block back."""
    kind, folder, hf = hf_checkpoint
    prompts, params = shared_workload()
    on_two_ranks(folder, prompts, params, oracle((kind, "shared"), hf, prompts, params))


def test_sums_in_the_layers_give_the_same_tokens(hf_checkpoint):
    """all_reduce="one_shot": each row-parallel layer and the embedding sum their own outputs (on CPUs by
    gloo), where by default (the tests above) `sum_at_norms` leaves the sums to the norm after each.
    Qwen2: q/k/v biases, the others' as above."""
    kind, folder, hf = hf_checkpoint
    if kind != "qwen2":
        pytest.skip("one shape: the path differs from the default only in where the sums are")
    prompts, params = shared_workload()
    on_two_ranks(folder, prompts, params, oracle((kind, "shared"), hf, prompts, params), all_reduce="one_shot")


def on_two_ranks(folder, prompts, params, expected, **config) -> None:
    """Serve a workload twice on two ranks (more config: `config`) under preemption (swap), prefix caching
    and chunked prefill: tokens, blocks, preemptions and cache hits checked, and no process left."""
    num_blocks = max(blocks_needed(len(p) + sp.max_tokens, 4) for p, sp in zip(prompts, params)) * 3 // 2
    engine = mi.LLMEngine(mi.EngineConfig(
        model=folder, tensor_parallel_size=2, block_size=4, num_blocks=num_blocks, max_num_seqs=4,
        max_num_batched_tokens=5, preemption_mode="swap", enable_prefix_caching=True,
        enable_chunked_prefill=True, **config))
    try:
        preempted, cached = serve_twice(engine, prompts, params, expected)
        assert preempted > 0 and cached > 0
    finally:
        engine.close()
    assert not any(p.is_alive() for p in engine.executor.procs)


def serve_twice(engine, prompts, params, expected) -> tuple[int, int]:
    """Two rounds of a workload, tokens and blocks checked each time: (preemptions, cached tokens)."""
    preempted, cached = 0, 0
    for _ in range(2):
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        final, n = run_steps(engine)
        preempted += n
        cached += sum(final[i].num_cached_tokens for i in ids)
        assert [final[i].token_ids for i in ids] == expected
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return preempted, cached


def test_four_ranks_with_replicated_kv_heads_equal_transformers(tmp_path):
    """8 query heads, 2 KV heads on 4 ranks (each KV head on two), recompute preemption this time."""
    hf = make_hf_model("llama", **FOUR_WAY)
    hf.save_pretrained(tmp_path)
    prompts, params = shared_workload(n=8)
    expected = oracle(("llama-four-way", "shared"), hf, prompts, params)
    num_blocks = max(blocks_needed(len(p) + sp.max_tokens, 8) for p, sp in zip(prompts, params)) * 3 // 2
    engine = mi.LLMEngine(mi.EngineConfig(
        model=tmp_path, tensor_parallel_size=4, block_size=8, num_blocks=num_blocks, max_num_seqs=3,
        max_num_batched_tokens=7, enable_prefix_caching=True, enable_chunked_prefill=True))
    try:
        preempted, cached = serve_twice(engine, prompts, params, expected)
        assert preempted > 0 and cached > 0
    finally:
        engine.close()


def test_the_course_model_on_two_ranks_equals_one():
    prompts = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self,"]
    greedy = mi.SamplingParams(temperature=0, max_tokens=24)
    one = mi.LLMEngine(mi.EngineConfig()).generate(prompts, greedy, use_tqdm=False)
    engine = mi.LLMEngine(mi.EngineConfig(tensor_parallel_size=2))
    try:
        outs = engine.generate(prompts, greedy, use_tqdm=False)
        assert [o.token_ids for o in outs] == [o.token_ids for o in one]
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        engine.close()


def test_a_rank_that_dies_fails_the_requests_and_leaves_no_process():
    rank_dies(mi.EngineConfig(tensor_parallel_size=2), "tensor parallelism failed: rank 1 died")


def rank_dies(config: mi.EngineConfig, says: str) -> None:
    """Rank 1 killed while a request runs: the engine fails it with `says`, gives every block back, leaves no
    process, and refuses to go on, clearly (chapter 16's stages too)."""
    engine = mi.LLMEngine(config)
    procs = engine.executor.procs
    long = engine.add_request([7] * 10, mi.SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    engine.step()
    os.kill(procs[1].pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=says):
        for _ in range(200):
            engine.step()
    assert long not in engine.requests and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not any(p.is_alive() for p in procs)
    engine.add_request([1, 2, 3], mi.SamplingParams(max_tokens=2))  # the engine refuses to go on, clearly
    with pytest.raises(RuntimeError, match="cannot go on"):
        engine.step()
    assert not engine.requests
    engine.close()


def test_a_rank_that_fails_in_a_step_nobody_waits_on_says_why():
    """Rank 1 answers no step (a launch is answered by none, a collect by rank 0 alone): its error in a
    launch still ends the step, with its reason, and every block comes back."""
    class BreaksOnRank1(ModelRunner):  # defined here: sent to the ranks by value
        def launch(self, out):
            if dist.get_rank() == 1 and out.num_new_tokens:
                raise RuntimeError("rank 1 broke in a launch")
            return super().launch(out)

    config = mi.EngineConfig(tensor_parallel_size=2)
    engine = mi.LLMEngine(config, components=dataclasses.replace(build_components(config), runner=BreaksOnRank1))
    procs = engine.executor.procs
    with pytest.raises(RuntimeError, match="rank 1: RuntimeError: rank 1 broke in a launch"):
        engine.generate([[5, 6, 7]], mi.SamplingParams(max_tokens=4), use_tqdm=False)
    assert not engine.requests and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not any(p.is_alive() for p in procs)
    engine.close()


def test_a_rank_that_fails_to_load_says_why(tmp_path):
    """A checkpoint whose tensors do not fit the config fails in the workers: the error names the tensor."""
    make_hf_model("llama").save_pretrained(tmp_path)
    cfg = (tmp_path / "config.json").read_text().replace('"intermediate_size": 100', '"intermediate_size": 50')
    (tmp_path / "config.json").write_text(cfg)
    with pytest.raises(RuntimeError, match="rank [01]: CheckpointError.*mlp"):  # whichever says so first
        mi.LLMEngine(mi.EngineConfig(model=tmp_path, tensor_parallel_size=2))
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("config, match", [
    (dict(tensor_parallel_size=4), "do not split evenly"),  # the course model's 2 KV heads
    (dict(tensor_parallel_size=2, device="cuda"), "need 2 GPU"),
    (dict(tensor_parallel_size=0), "positive int"),
    (dict(tensor_parallel_size=2, quantization="int4"), "rank's 192 of the attention output's 384 inputs"),
    (dict(tensor_parallel_size=2, executor="in_process"), "need a process per rank"),
    (dict(executor="threads"), "executor"),
])
def test_bad_configurations_are_refused_before_any_process_starts(config, match):
    refused_before_any_process(config, match)
    with pytest.raises(ValueError, match="not a model object"):
        mi.LLMEngine(mi.EngineConfig(tensor_parallel_size=2), model=mi.load_model())


def refused_before_any_process(config: dict, match: str) -> None:
    """EngineConfig(**config) makes no engine: ValueError matching `match`, and no process was started."""
    if "cuda" in config.values() and torch.cuda.is_available():
        pytest.skip("this machine has a GPU: on it the setup may be fine")
    with pytest.raises(ValueError, match=match):
        mi.LLMEngine(mi.EngineConfig(**config))
    assert not multiprocessing.active_children()


def test_executors_are_chosen_by_kind():
    """Unset, the executor is a worker process per rank once there are several, else the engine's own
    process; a config may name either (one rank in a worker process of its own)."""
    assert mi.EngineConfig().executor_kind() == "in_process"
    assert mi.EngineConfig(tensor_parallel_size=2).executor_kind() == "multiprocess"
    greedy = mi.SamplingParams(temperature=0, max_tokens=8)
    alone = mi.LLMEngine(mi.EngineConfig()).generate(["def f(x):"], greedy)[0].token_ids
    engine = mi.LLMEngine(mi.EngineConfig(executor="multiprocess"))
    try:
        assert type(engine.executor).__name__ == "MultiProcessExecutor" and engine.model is None
        assert engine.generate(["def f(x):"], greedy)[0].token_ids == alone
    finally:
        engine.close()
    # The server's setup: the engine in a process of its own, its one rank that process's child.
    import asyncio

    eng = mi.AsyncLLMEngine(mi.EngineConfig(executor="multiprocess"))
    try:
        assert len(started_below(eng.client.process.pid)) == 1

        async def one():
            return [t async for out in eng.generate("def f(x):", greedy) for t in out.new_token_ids]
        assert asyncio.run(asyncio.wait_for(one(), 120)) == alone
    finally:
        eng.close()
    assert not multiprocessing.active_children()
    with pytest.raises(ValueError, match="worker processes"):
        mi.DisaggregatedConfig(prefill=mi.EngineConfig(executor="multiprocess"), decode=mi.EngineConfig())


def test_the_async_engine_in_its_process_fails_its_streams_when_a_rank_dies():
    """The server's setup: the engine in a process of its own, its ranks that process's children.
    A rank killed mid-stream ends the streams with the reason; the engine stops (its process ends),
    so a later request fails at once; close() leaves no process."""
    import asyncio

    eng = mi.AsyncLLMEngine(mi.EngineConfig(tensor_parallel_size=2))
    ranks = started_below(eng.client.process.pid)
    assert len(ranks) == 2
    params = mi.SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def stream(prompt, kill_after=None):
        n = 0
        async for out in eng.generate(prompt, params):
            n += len(out.new_token_ids)
            if kill_after is not None and n >= kill_after:
                ranks[1].kill()
        return n

    async def main():
        got = await asyncio.gather(stream([5, 6, 7], kill_after=3), stream([9, 10]), return_exceptions=True)
        try:
            await stream([1, 2])
        except RuntimeError as err:
            return got, err
        return got, None

    try:
        got, later = asyncio.run(asyncio.wait_for(main(), 120))
        # The engine's loop stopped at the failure and its process ended: what /health reads.
        deadline = time.monotonic() + 30
        while eng.client.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not eng.client.is_alive() and eng.stopped
    finally:
        eng.close()
    assert all(isinstance(g, RuntimeError) and "rank 1 died" in str(g) for g in got), got
    assert isinstance(later, RuntimeError) and "the engine has stopped" in str(later), later
    assert not eng.client.process.is_alive() and not any(p.is_running() and p.status() != "zombie" for p in ranks)


def assert_same_logprobs(ours: list, theirs: list) -> None:
    """Two outputs' log-probabilities: the same tokens and ranks, values within 1e-4."""
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        if a is None or b is None:
            assert a is b
            continue
        assert a.token == b.token and a.rank == b.rank and abs(a.logprob - b.logprob) < 1e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a.top, b.top))


def test_two_ranks_quantized_with_speculation_and_logprobs_give_one_processs_tokens():
    """Features compose: two ranks x int8 quantized on load x n-gram speculation x logprobs and prompt
    logprobs, with chunked prefill, give the tokens of one process with int8 alone, and its
    log-probabilities within 1e-4; guesses are made and kept, and every block comes back."""
    prompts = ["def add(a, b):\n    return a + b\n\n\ndef add3(a, b, c):\n",
               "for i in range(10):\n    print(i)\nfor j in range(10):\n", "import os\n"]
    params = mi.SamplingParams(temperature=0, max_tokens=24, logprobs=2, prompt_logprobs=1)
    base = dict(quantization="int8", quantize_lm_head=None, num_blocks=64, block_size=4, max_num_batched_tokens=2048,
                enable_chunked_prefill=True)  # the head whole in both: two ranks cannot quantize it
    one = mi.LLMEngine(mi.EngineConfig(**base)).generate(prompts, params, use_tqdm=False)
    engine = mi.LLMEngine(mi.EngineConfig(**base, tensor_parallel_size=2, speculative_method="ngram",
                                          num_speculative_tokens=3))
    try:
        outs = engine.generate(prompts, params, use_tqdm=False)
        assert engine.spec is not None and engine.spec.accepted > 0
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        engine.close()
    for a, b in zip(one, outs):
        assert a.token_ids == b.token_ids
        assert_same_logprobs(a.logprobs, b.logprobs)
        assert_same_logprobs(a.prompt_logprobs, b.prompt_logprobs)


def test_checkpoints_stored_quantized_are_refused_with_two_ranks_when_the_config_is_made(tmp_path):
    make_hf_model("llama").save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="stored quantized .*'compressed-tensors'.*quantization='int8'"):
        mi.EngineConfig(model=tmp_path, tensor_parallel_size=2)
