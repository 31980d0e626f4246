"""Chapter 16: pipeline parallelism on the CPU, stages as gloo processes. Each stage loads only its
layers; greedy tokens with two stages equal transformers' (preemption, prefix caching, chunked
prefill), stages compose with tensor ranks, the scheduler keeps the stages' steps disjoint and
balanced, a stage that dies ends the engine's requests with the reason, and bad setups are refused
before any process starts."""

import itertools

import pytest
from conftest import started_below
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine import oracle
from test_parallel import rank_dies, refused_before_any_process, serve_twice

import miniinfer as mi
from miniinfer.core.block_manager import BlockManager, blocks_needed
from miniinfer.core.sequence import Sequence
from miniinfer.course.parity import shared_workload
from miniinfer.distributed.pipeline import compact_stage, keep_stage, split_layers


def test_two_stages_equal_transformers(hf_checkpoint):
    """Llama (one layer a stage), Qwen2 and Qwen3 (tied embeddings: the last stage keeps the embedding as its
    head; two tensor ranks a stage for both): two rounds of a shared-prefix workload under preemption (swap),
    prefix caching and chunked prefill; every block back, no process left."""
    kind, folder, hf = hf_checkpoint
    prompts, params = shared_workload()
    tp = 1 if kind == "llama" else 2
    served_twice_by_stages(folder, prompts, params, oracle((kind, "shared"), hf, prompts, params), tp)


def test_the_course_model_on_two_stages_of_two_tensor_ranks_equals_one_engine():
    """The course model on 2 x 2 ranks (on two stages of one rank: the dying-stage and two-machine tests)."""
    prompts, params = shared_workload(n=8, vocab=4096)
    want = [o.token_ids for o in mi.LLMEngine(mi.EngineConfig()).generate(prompts, params, use_tqdm=False)]
    served_twice_by_stages(None, prompts, params, want, tp=2)


def served_twice_by_stages(folder, prompts, params, expected, tp: int) -> None:
    num_blocks = max(blocks_needed(len(p) + sp.max_tokens, 4) for p, sp in zip(prompts, params)) * 3 // 2
    engine = mi.LLMEngine(mi.EngineConfig(
        model=folder, pipeline_parallel_size=2, tensor_parallel_size=tp, block_size=4, num_blocks=num_blocks,
        max_num_seqs=4, max_num_batched_tokens=5, preemption_mode="swap", enable_prefix_caching=True,
        enable_chunked_prefill=True))
    try:
        assert type(engine.executor).__name__ == "PipelineExecutor" and engine.depth == 2
        assert len(engine.executor.procs) == 2 * tp and engine.executor.answering == tp
        preempted, cached = serve_twice(engine, prompts, params, expected)
        assert preempted > 0 and cached > 0
    finally:
        engine.close()
    assert not any(p.is_alive() for p in engine.executor.procs)


def test_a_stage_keeps_and_loads_only_its_layers(hf_checkpoint):
    """keep_stage before loading: the loader reads only the stage's tensors (no embedding past the first
    stage unless tied to the head, no head before the last); compact_stage numbers its layers from 0."""
    kind, folder, hf = hf_checkpoint
    tied = hf.config.tie_word_embeddings
    for stage, layers in enumerate([range(0, 1), range(1, 2)]):
        model = mi.load_model(folder, prepare=lambda m, layers=layers, s=stage: keep_stage(m, layers, s == 0, s == 1))
        names = set(model.state_dict())
        assert ("model.embed_tokens.weight" in names) == (stage == 0 or tied)
        assert ("lm_head.weight" in names) == (stage == 1)
        assert {n.split(".")[2] for n in names if n.startswith("model.layers.")} == {str(layers.start)}
        compact_stage(model, layers)
        assert len(model.model.layers) == model.cfg.num_layers == 1


@given(st.lists(st.integers(1, 9), min_size=1, max_size=7), st.integers(0, 20), st.integers(1, 7))
def test_the_split_is_in_order_and_its_costliest_stage_is_the_cheapest_possible(costs, head, stages):
    """Against every way to cut the layers into `stages` runs of one or more."""
    stages = min(stages, len(costs))
    plan = split_layers(costs, head, stages)
    assert [i for p in plan for i in p] == list(range(len(costs))) and all(len(p) for p in plan)
    worst = lambda cut: max(sum(costs[a:b]) + head * (b == len(costs)) for a, b in zip((0,) + cut, cut + (len(costs),)))
    best = min(worst(cut) for cut in itertools.combinations(range(1, len(costs)), stages - 1))
    assert worst(tuple(p.start for p in plan[1:])) == best


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=9), st.integers(2, 4), st.data())
def test_the_stages_steps_are_disjoint_and_balanced(lengths, stages, data):
    """A scheduler of `stages` micro-batches, driven as the engine drives it (`stages` steps under way,
    the oldest read first): no request is in two steps under way, a step takes at most its share of the
    unfinished requests, every request ends, every block comes back."""
    bm = BlockManager(64, 4)
    sched = mi.Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=32, micro_batches=stages)
    for i, n in enumerate(lengths):
        sched.add(Sequence(str(i), [1] * n, mi.SamplingParams(max_tokens=data.draw(st.integers(1, 5))), 0, i, 0))
    under_way: list = []
    for _ in range(500):
        if not sched.has_unfinished():
            break
        while len(under_way) < stages:
            share = -(-len(sched.requests) // stages)
            out = sched.schedule()
            ran = set(out.num_new_tokens)
            assert not ran & {r for o in under_way for r in o.num_new_tokens}
            assert len(ran) <= share
            under_way.append(out)
        out = under_way.pop(0)
        sched.update_from_output(out, {r: [5] for r in out.num_new_tokens
                                       if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens})
    assert not sched.has_unfinished() and bm.num_free_blocks == bm.num_blocks


def test_a_stage_that_dies_fails_the_requests_and_leaves_no_process():
    rank_dies(mi.EngineConfig(pipeline_parallel_size=2), "pipeline parallelism failed: rank 1 died")


@pytest.mark.parametrize("config, match", [
    (dict(pipeline_parallel_size=7), "7 pipeline stages for a model of 6 layers"),
    (dict(pipeline_parallel_size=2, device="cuda"), "this one has 0"),
    (dict(pipeline_parallel_size=2, executor="multiprocess"), "executor='pipeline' runs"),
    (dict(executor="pipeline"), "executor='pipeline' runs"),
    (dict(pipeline_parallel_size=2, speculative_method="ngram"), "with speculation"),
    (dict(pipeline_parallel_size=0), "positive int"),
    (dict(nnodes=2), "1 ranks .* over nnodes=2"),
    (dict(tensor_parallel_size=2, nnodes=2, executor="multiprocess"), "ranks on nnodes >= 2 machines"),
    (dict(pipeline_parallel_size=2, nnodes=4), "equal share"),
    (dict(pipeline_parallel_size=2, nnodes=2, node_rank=2), "node_rank in 0..1"),
])
def test_bad_pipelines_are_refused_before_any_process_starts(config, match):
    refused_before_any_process(config, match)
    with pytest.raises(ValueError, match="worker processes"):
        mi.DisaggregatedConfig(prefill=mi.EngineConfig(pipeline_parallel_size=2), decode=mi.EngineConfig())


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node(port: int, rank: int, *more: str):
    """`miniinfer serve` as machine `rank` of two, one stage each, meeting at this machine's `port`."""
    import subprocess
    import sys
    return subprocess.Popen([sys.executable, "-m", "miniinfer", "serve", "--pipeline-parallel-size", "2",
                             "--nnodes", "2", "--node-rank", str(rank), "--master-port", str(port), *more])


def test_two_machines_served_give_the_openai_client_one_engines_text(tmp_path):
    """Two 'machines' as two process trees here: `miniinfer serve --nnodes 2 --node-rank 1` (its stage's rank
    alone) and node 0's server, which the openai client asks for whole and streamed completions; node 0's
    SIGTERM leaves no process there, and node 1 ends by itself."""
    from test_server import serves_one_engines_text_and_ends_cleanly
    port = free_port()
    other = node(port, 1)
    serves_one_engines_text_and_ends_cleanly(tmp_path / "server.log", "--pipeline-parallel-size", "2", "--nnodes", "2",
                                             "--node-rank", "0", "--master-port", str(port))
    assert other.wait(30) == 0


def test_a_machine_that_dies_fails_the_engines_requests_cleanly():
    """Node 1's rank killed mid-run: the engine on node 0 fails its requests with the reason, gives every block
    back and leaves no process of its own."""
    port = free_port()
    other = node(port, 1)
    engine = mi.LLMEngine(mi.EngineConfig(pipeline_parallel_size=2, nnodes=2, master_port=port))
    try:
        assert len(engine.executor.procs) == 1 and len(engine.executor.conns) == 2
        engine.add_request([7] * 10, mi.SamplingParams(max_tokens=500, ignore_eos=True))
        engine.step()
        for child in started_below(other.pid):
            child.kill()
        with pytest.raises(RuntimeError, match="rank 1: the process ended"):
            for _ in range(500):
                engine.step()
        assert not engine.requests and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        engine.close()
    other.wait(30)
    assert not any(p.is_alive() for p in engine.executor.procs)
