"""Chapter 13: mixtures of experts (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral) read from
ordinary checkpoints give transformers' greedy tokens through the engine; the align step and the fused
experts kernels (under the CPU interpreter) equal the reference."""

import re

import pytest
import torch
from conftest import saved
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine import oracle
from test_parallel import on_two_ranks, serve_twice

import miniinfer as mi
from miniinfer.core.block_manager import blocks_needed
from miniinfer.course.parity import COMMON, MOE_SHAPES, hf_greedy, make_moe_model, shared_workload
from miniinfer.kernels.moe import align, fused_experts, fused_route, row_piece
from miniinfer.layers.moe import EXPERT_IMPLS, ROUTERS, MoEConfig, SparseMoE, experts_reference, route


@pytest.fixture(scope="module", params=list(MOE_SHAPES))
def moe_checkpoint(request, tmp_path_factory):
    return saved(request.param, make_moe_model(request.param), tmp_path_factory)


def test_layers_and_logits_match_transformers(moe_checkpoint):
    kind, folder, hf = moe_checkpoint
    model = mi.load_model(folder)
    sparse = [isinstance(layer.mlp, SparseMoE) for layer in model.model.layers]
    assert sparse == ([True, True, True] if kind == "mixtral" else [True, False, True])
    assert isinstance(model.model.layers[0].mlp.gate, torch.nn.Linear)
    ids = torch.randint(0, COMMON["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("impl", ["reference", "fused"])
def test_greedy_equals_transformers_twice_under_preemption(moe_checkpoint, impl):
    """Two rounds of a shared-prefix workload under preemption, prefix caching and chunked prefill,
    through the reference router and experts and (Qwen2-MoE: top-3 and the shared expert; under the CPU
    interpreter on two requests, still preempted and still cached: 8 s, against 19 s with four and 134 s
    with all eight) the fused kernels; every block back."""
    kind, folder, hf = moe_checkpoint
    if impl == "fused" and kind != "qwen2_moe":
        pytest.skip("the fused kernels in the engine: one model (they equal the reference below)")
    def prepare(engine):
        for layer in engine.model.model.layers:
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.route, layer.mlp.experts.impl = ROUTERS[impl], EXPERT_IMPLS[impl]
    serve_under_preemption(kind, folder, hf, prepare, n=2 if impl == "fused" else 8)


def serve_under_preemption(kind: str, folder, hf, prepare=None, n: int = 8, **config) -> None:
    """Two rounds of n shared-prefix requests in a pool of 1.5 requests' blocks (pieces of 7 tokens,
    preemption by recompute unless config says, prefix caching), transformers' greedy tokens and every
    block back each time; prepare(engine) first, if given."""
    prompts, params = shared_workload(n=n)
    expected = oracle((kind, f"shared{n}"), hf, prompts, params)
    num_blocks = max(blocks_needed(len(p) + sp.max_tokens, 4) for p, sp in zip(prompts, params)) * 3 // 2
    engine = mi.LLMEngine(mi.EngineConfig(
        model=folder, block_size=4, num_blocks=num_blocks, max_num_seqs=4, max_num_batched_tokens=7,
        enable_prefix_caching=True, enable_chunked_prefill=True, **{"preemption_mode": "recompute", **config}))
    if prepare is not None:
        prepare(engine)
    preempted, cached = serve_twice(engine, prompts, params, expected)
    assert preempted > 0 and cached > 0


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_align_sorts_every_pair_into_one_experts_blocks(data):
    T = data.draw(st.integers(1, 40))
    E = data.draw(st.integers(1, 9))
    k = data.draw(st.integers(1, E))
    block = data.draw(st.sampled_from([1, 3, 4, 16]))
    skip = data.draw(st.booleans())  # ids >= E: pairs another rank serves
    ids = torch.stack([torch.randperm(E + 2 * skip, generator=torch.Generator().manual_seed(t))[:k] for t in range(T)])
    pairs, expert = align(ids, E, block)
    assert all(torch.equal(a, b) for a, b in zip(align(ids.int(), E, block), (pairs, expert)))  # any int ids
    n = T * k
    assert pairs.numel() == -(-(n + E * (block - 1)) // block) * block == expert.numel() * block
    flat = ids.flatten()
    served = pairs < n
    assert sorted(pairs[served].tolist()) == [i for i in range(n) if flat[i] < E]  # each served pair once
    row_expert = expert.long().repeat_interleave(block)
    assert torch.equal(flat[pairs[served].long()], row_expert[served])  # in a block of its own expert
    for e in range(E):  # each expert's pairs in order, in as few whole blocks as hold them
        mine = pairs[row_expert == e]
        assert mine.numel() == -(-(flat == e).sum().item() // block) * block
        assert torch.equal(mine[mine < n], (flat == e).nonzero().flatten().int())
    used = expert[expert >= 0]
    assert torch.equal(used, used.sort().values) and (expert[used.numel():] == -1).all()


@pytest.mark.parametrize("T, E, k, H, I, first, local", [
    (1, 8, 1, 24, 16, 0, 8), (5, 8, 2, 40, 24, 0, 8), (13, 10, 8, 33, 20, 0, 10), (7, 64, 8, 16, 24, 0, 64),
    (9, 8, 2, 24, 40, 4, 3)])  # the last: a rank holding experts 4-6 of 8
def test_fused_experts_equal_the_reference(T, E, k, H, I, first, local):
    """Odd token counts, experts with no tokens (64 experts, 7 tokens), top-k 1, 2 and 8, and a rank's share;
    the sorted, tiled kernel and the one with a program per pair."""
    g = torch.Generator().manual_seed(T * E + k)
    x = torch.randn(T, H, generator=g)
    weights, ids = route(torch.randn(T, E, generator=g), k, renormalize=k > 1)
    w13 = torch.randn(local, 2 * I, H, generator=g) / H ** 0.5
    w2 = torch.randn(local, H, I, generator=g) / I ** 0.5
    ref = experts_reference(x, weights, ids, w13, w2, first)
    for config in (None, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64), dict(BLOCK_N=16, BLOCK_K=32)):  # rule, both
        torch.testing.assert_close(fused_experts(x, weights, ids, w13, w2, first, config), ref, atol=1e-5, rtol=1e-5)
    if first:
        assert ref.any() and not experts_reference(x, weights, ids, w13[:0], w2[:0], first).any()


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_fused_route_equals_route(data):
    """Any expert count (not a power of two too), top-k 1..8, with and without renormalizing; bfloat16
    logits as the router gives them. Equal logits: the first of them."""
    T, E = data.draw(st.integers(1, 9)), data.draw(st.integers(1, 70))
    k, renormalize = data.draw(st.integers(1, min(E, 8))), data.draw(st.booleans())
    scale = data.draw(st.sampled_from([0.1, 3.0]))
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(T * E + k)) * scale
    weights, ids = fused_route(logits, k, renormalize)
    expected = route(logits, k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    torch.testing.assert_close((weights, ids), expected)
    bf16 = logits.bfloat16()
    ours, theirs = fused_route(bf16, k, renormalize)[0], route(bf16, k, renormalize)[0]
    torch.testing.assert_close(ours.sort().values, theirs.sort().values)  # equal logits: any order among them
    weights, ids = fused_route(torch.zeros(T, E), k, renormalize)
    assert (ids == torch.arange(k)).all()
    assert torch.allclose(weights, torch.full_like(weights, 1 / (k if renormalize else E)))


def test_row_piece_divides_the_rows_where_a_long_piece_does():
    pieces = [row_piece(768, 1024), row_piece(2048, 1024), row_piece(1536, 512), row_piece(33, 64)]
    assert pieces == [256, 1024, 512, 64]


def test_config_reads_each_architecture_and_refuses_a_bad_top_k():
    base = dict(num_hidden_layers=6, num_experts_per_tok=2, moe_intermediate_size=8, intermediate_size=32)
    qwen = MoEConfig.from_hf(dict(base, model_type="qwen3_moe", num_experts=4, decoder_sparse_step=2,
                                  mlp_only_layers=[3]))  # the hub's name for the count; every second layer
    assert (qwen.num_experts, qwen.sparse_layers, qwen.renormalize, qwen.intermediate_size) == (4, (1, 5), False, 8)
    mixtral = MoEConfig.from_hf(dict(base, model_type="mixtral", num_local_experts=8))
    assert (mixtral.sparse_layers, mixtral.renormalize, mixtral.intermediate_size) == (tuple(range(6)), True, 32)
    assert mixtral.packed_modules()["mlp.gate"] == ["block_sparse_moe.gate"]
    with pytest.raises(ValueError, match="num_experts_per_tok=5 with 4 experts"):
        MoEConfig.from_hf(dict(base, model_type="qwen2_moe", num_experts=4, num_experts_per_tok=5))
    with pytest.raises(KeyError, match="shared_expert_intermediate_size"):  # its weights would go unread
        MoEConfig.from_hf(dict(base, model_type="qwen2_moe", num_experts=4))


def test_expert_parallel_on_two_ranks_equals_transformers(moe_checkpoint):
    """Experts split over two gloo ranks (7 of them: 3 and 4; Mixtral's 5: 2 and 3; Qwen2-MoE's shared
    expert split by channels): two rounds under preemption (swap), prefix caching and chunked prefill."""
    kind, folder, hf = moe_checkpoint
    prompts, params = shared_workload(n=8)
    on_two_ranks(folder, prompts, params, oracle((kind, "shared8"), hf, prompts, params), enable_expert_parallel=True)


def test_bad_parallel_configurations_are_refused_before_any_process_starts(moe_checkpoint):
    _, folder, _ = moe_checkpoint
    cases = [(dict(model=folder, tensor_parallel_size=2), "enable_expert_parallel=False for a model with experts"),
             (dict(tensor_parallel_size=2, enable_expert_parallel=True), "for a model without experts"),
             (dict(model=folder, enable_expert_parallel=True), "got tensor_parallel_size=1"),
             (dict(model=folder, tensor_parallel_size=2, enable_expert_parallel=True, quantization="int8"),
              "quantization='int8'"),
             (dict(model=folder, tensor_parallel_size=8, enable_expert_parallel=True), "do not split over")]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            mi.LLMEngine(mi.EngineConfig(**kwargs))


def test_speculation_and_quantization_compose_with_experts(moe_checkpoint):
    """n-gram speculation's verified tokens equal transformers' greedy ones; int8 on load quantizes the
    attention, the dense layers and the shared expert, and leaves the router and the experts as they are."""
    kind, folder, hf = moe_checkpoint
    prompts, params = shared_workload(n=6)
    engine = mi.LLMEngine(mi.EngineConfig(model=folder, speculative_method="ngram", num_speculative_tokens=3,
                                          block_size=4, num_blocks=64, enable_prefix_caching=True))
    assert [o.token_ids for o in engine.generate(prompts, params, use_tqdm=False)] == \
        [hf_greedy(hf, p, sp.max_tokens) for p, sp in zip(prompts, params)]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    from miniinfer.layers.quantization import IntLinear
    model = mi.load_model(folder, quantization="int8")
    moe = model.model.layers[0].mlp
    assert type(moe.gate) is torch.nn.Linear and moe.experts.gate_up_proj.weight.dtype == torch.float32
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, IntLinear)
    assert kind == "mixtral" or isinstance(model.model.layers[1].mlp.down_proj, IntLinear)
    assert kind != "qwen2_moe" or isinstance(moe.shared_expert.gate_up_proj, IntLinear)


def test_a_malformed_checkpoint_names_the_expert(moe_checkpoint, tmp_path):
    """An expert's matrix of the wrong shape, or one missing: a CheckpointError that names it."""
    import shutil

    from safetensors.torch import load_file, save_file

    kind, folder, _ = moe_checkpoint
    tensors = load_file(folder / "model.safetensors")
    block, up = ("block_sparse_moe", "w3") if kind == "mixtral" else ("mlp", "up_proj")
    name = f"model.layers.0.{block}.experts.3.{up}.weight"
    for broken, says in ((dict(tensors, **{name: tensors[name][:-1]}), r"\(expert 3\) has shape"),
                         ({k: v for k, v in tensors.items() if k != name}, re.escape(name))):
        shutil.copytree(folder, tmp_path / "bad", dirs_exist_ok=True)
        save_file(broken, tmp_path / "bad" / "model.safetensors")
        with pytest.raises(mi.model.loader.CheckpointError, match=says):
            mi.load_model(tmp_path / "bad")
