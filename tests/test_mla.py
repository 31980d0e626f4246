"""Chapter 14: DeepSeek-V2 and -V3 (latent attention in its absorbed form, experts routed by groups with
shared experts) read from ordinary checkpoints give transformers' logits and greedy tokens through the
engine's paged cache, prefix caching, chunked prefill and preemption."""

import re

import pytest
import torch
from conftest import saved
from test_moe import serve_under_preemption

import miniinfer as mi
from miniinfer.course.parity import MLA_COMMON, MLA_SHAPES, make_mla_model
from miniinfer.kernels.mla import LatentAttentionKernels, latent_decode
from miniinfer.layers.mla import DeepseekMoE, LatentAttention, model_config
from miniinfer.worker.paged_cache import paged_attention_ref


@pytest.fixture(scope="module", params=list(MLA_SHAPES))
def mla_checkpoint(request, tmp_path_factory):
    return saved(request.param, make_mla_model(request.param), tmp_path_factory)


def test_layers_and_logits_match_transformers(mla_checkpoint):
    kind, folder, hf = mla_checkpoint
    model = mi.load_model(folder)
    assert [type(layer.mlp) for layer in model.model.layers] == [mi.model.transformer.MLP, DeepseekMoE, DeepseekMoE]
    assert all(isinstance(layer.self_attn, LatentAttention) for layer in model.model.layers)
    assert (model.cfg.num_kv_heads, model.cfg.head_dim, model.cfg.rotary_dim) == (1, 32 + 8, 8)  # the latent's cache
    ids = torch.randint(0, MLA_COMMON["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # 40 positions: past YaRN's original 64 / 4 in the ramp's pairs
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_greedy_equals_transformers_twice_under_preemption(mla_checkpoint, preemption):
    """Two rounds of a shared-prefix workload under preemption (recompute, and swap: the keys-only pool
    to CPU memory and back), prefix caching and chunked prefill (pieces of 7 tokens); every block back."""
    forms = []
    def counted(engine):  # which form each prefill step's layers took
        for layer in engine.executor.runner.model.model.layers:
            rebuild = layer.self_attn.rebuild
            layer.self_attn.rebuild = lambda *a, rebuild=rebuild: forms.append("rebuilt") or rebuild(*a)
    serve_under_preemption(*mla_checkpoint, counted, preemption_mode=preemption)
    assert forms  # and the decodes absorbed, as every test here checks


@pytest.mark.parametrize("block_size", [1, 3])
def test_rebuilt_prefill_through_the_kernels(mla_checkpoint, block_size):
    """Prefixes of ragged lengths, then the prompts' rest after them (the cached prefix read back and
    rebuilt; one sequence decoding, absorbed, in the same step), through chapter 05's prefill kernel
    and chapter 14's decode kernel under the interpreter, and in PyTorch: the logits of the absorbed
    form without a cache (chapter 01's attention)."""
    _, folder, _ = mla_checkpoint
    model = mi.load_model(folder)
    g = torch.Generator().manual_seed(block_size)
    prompts = [torch.randint(0, MLA_COMMON["vocab_size"], (n,), generator=g).tolist() for n in (9, 14, 5)]
    cached = [4, 13, 1]
    widths = [-(-len(p) // block_size) for p in prompts]
    order = torch.randperm(sum(widths) + 3, generator=g)[:sum(widths)].tolist()
    tables = [order[sum(widths[:i]):sum(widths[:i + 1])] for i in range(3)]
    with torch.no_grad():
        want = [torch.stack([model(torch.tensor([p[:n]]))[0, -1] for p, n in zip(prompts, lens)])
                for lens in (cached, [len(p) for p in prompts])]
        for kernels in ("triton", "torch"):
            cache = mi.VarlenKVCache(model.cfg, sum(widths) + 3, block_size, kernels=kernels)
            first = cache.run(model, [p[:c] for p, c in zip(prompts, cached)], tables, [0, 0, 0])
            then = cache.run(model, [p[c:] for p, c in zip(prompts, cached)], tables, cached)
            for got, expected in zip((first, then), want):
                torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_greedy_through_the_latent_kernels(mla_checkpoint):
    """The engine on chapter 14's decode kernel (and chapter 05's store and prefill) under the CPU
    interpreter: the same tokens; V2 only (each model takes a minute there)."""
    kind, folder, hf = mla_checkpoint
    if kind != "deepseek_v2":
        pytest.skip("the kernels in the engine: one model (they equal the reference below)")
    def picked(engine):  # "triton" for a cache whose values are its keys: chapter 14's decode kernel
        assert isinstance(engine.executor.runner.cache.kernels, LatentAttentionKernels)
    serve_under_preemption(kind, folder, hf, picked, n=4, kernels="triton")  # four requests: preempted all the same


@pytest.mark.parametrize("D, block_size, splits, heads", [(40, 1, 1, 5), (72, 3, 3, 5), (40, 3, 3, 20),
                                                          (40, 4, None, 3)])
def test_latent_decode_equals_the_reference(D, block_size, splits, heads):
    """Keys of 32 + 8 and 64 + 8, blocks of 1, 3 and 4, ragged contexts (5, 17, 1), heads in one block and
    in two (20 > 16), the context whole, split in three, and split by the rule."""
    g = torch.Generator().manual_seed(D + block_size)
    lens = torch.tensor([5, 17, 1])
    widths = (lens + block_size - 1) // block_size
    order = torch.randperm(int(widths.sum()) + 4, generator=g)[:int(widths.sum())]
    tables = torch.nn.utils.rnn.pad_sequence(list(order.split(widths.tolist())), batch_first=True)
    pool = torch.randn(int(widths.sum()) + 4, block_size, 1, D, generator=g)
    q = torch.randn(3, heads, D, generator=g)
    torch.testing.assert_close(latent_decode(q, pool, tables, lens, D ** -0.5, num_splits=splits),
                               paged_attention_ref(q, pool, pool, tables, lens, D ** -0.5), atol=1e-5, rtol=1e-5)


def test_the_cache_keeps_keys_alone(mla_checkpoint):
    """One pool per layer of kv_lora_rank + rope_dim a token, read as keys and as values: a block costs
    half of what a keys-and-values pool of that width would, so twice as many fit."""
    _, folder, _ = mla_checkpoint
    engine = mi.LLMEngine(mi.EngineConfig(model=folder, block_size=4, num_cpu_blocks=8))
    runner = engine.executor.runner
    assert runner.cache.v is runner.cache.k and runner.cpu_v is runner.cpu_k
    assert runner.cache.k.shape[1:] == (engine.block_manager.num_blocks, 4, 1, 40)
    assert runner.kv_bytes_per_block() == 3 * 4 * 40 * 4 and runner.cache.nbytes == runner.cache.k.nbytes


def test_an_fp8_latent_cache(mla_checkpoint):
    """Chapter 10's KV dtype on the latent pool: e4m3 numbers, a quarter of float32's bytes a block, the
    requests served and every block back."""
    _, folder, _ = mla_checkpoint
    engines = [mi.LLMEngine(mi.EngineConfig(model=folder, block_size=4, num_blocks=40, kv_cache_dtype=dtype))
               for dtype in (None, torch.float8_e4m3fn)]
    runner = engines[1].executor.runner
    assert runner.cache.k.dtype == torch.float8_e4m3fn and runner.cache.v is runner.cache.k
    assert 4 * runner.kv_bytes_per_block() == engines[0].executor.runner.kv_bytes_per_block()
    params = mi.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = engines[1].generate([[5, 17, 99, 3, 250], [42] * 9], params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [12, 12]
    assert engines[1].block_manager.num_free_blocks == engines[1].block_manager.num_blocks


def test_bad_configurations_are_refused(mla_checkpoint):
    _, folder, hf = mla_checkpoint
    cfg = hf.config.to_dict()
    cases = [(dict(cfg, attention_bias=True), "attention_bias=True"),
             (dict(cfg, n_group=3), "n_group=3 groups"),
             (dict(cfg, topk_group=1, num_experts_per_tok=3), "topk_group=1 of them"),
             (dict(cfg, num_experts_per_tok=9), "num_experts_per_tok=9 with 8 experts")]
    for broken, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            model_config(broken)
    with pytest.raises(ValueError, match="latent attention"):
        mi.LLMEngine(mi.EngineConfig(model=folder, tensor_parallel_size=2))
