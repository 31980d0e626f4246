"""Hand-written, not from a notebook: what a greedy parity check needs, shared by the tests and the
GPU parity runs (tools/gpu_parity.py): small random Hugging Face checkpoints of every family the
loader reads (dense, experts, latent attention), transformers' greedy tokens as the oracle, a
workload over shared prefixes, an engine stepped until it is idle, and chapter 05's kernels
against their references on random odd cases.

Hand-written module (chapter 07)."""

import random
from typing import Any

import torch

# Odd sizes and grouped-query attention everywhere: shapes that powers of two would hide.
COMMON: dict[str, Any] = dict(vocab_size=301, hidden_size=72, intermediate_size=100, num_hidden_layers=2,
              num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
              tie_word_embeddings=False, rms_norm_eps=1e-5)
SHAPES: dict[str, dict[str, Any]] = {
    "llama": dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
                                   "rope_theta": 500000.0}),
    "qwen2": dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen3": dict(head_dim=20, tie_word_embeddings=True),  # head_dim != hidden / heads, q/k norm
}


def make_hf_model(kind: str, **overrides):
    """A random-init transformers model of the given architecture (float32, eval mode)."""
    import transformers

    cls = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[kind]
    config = getattr(transformers, f"{cls}Config")(**{**COMMON, **SHAPES[kind], **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, f"{cls}ForCausalLM")(config).eval()
    with torch.no_grad():  # random biases and norm weights, so that a missed one shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
    return model


# Odd sizes; a dense layer among the sparse ones (mlp_only_layers); weights large enough that the
# experts' outputs move the logits (the default initializer's make them ~1e-3); no EOS id, which the
# oracle's min_new_tokens would suppress (Mixtral's default, 2, is a greedy token of the workload).
MOE_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": ("Qwen3Moe", dict(num_experts=7, num_experts_per_tok=2, moe_intermediate_size=40, head_dim=20,
                                   norm_topk_prob=True, mlp_only_layers=[1])),
    "qwen2_moe": ("Qwen2Moe", dict(num_experts=7, num_experts_per_tok=3, moe_intermediate_size=40,
                                   shared_expert_intermediate_size=56, mlp_only_layers=[1])),
    "mixtral": ("Mixtral", dict(num_local_experts=5, num_experts_per_tok=2)),
}


def make_moe_model(kind: str):
    """A random-init transformers mixture of experts (float32, eval mode), a dense layer among its three
    where the family has one."""
    import transformers

    cls, shape = MOE_SHAPES[kind]
    config = getattr(transformers, f"{cls}Config")(**{**COMMON, "num_hidden_layers": 3, "initializer_range": 0.2,
                                                      "eos_token_id": None, **shape})
    torch.manual_seed(0)
    return getattr(transformers, f"{cls}ForCausalLM")(config).eval()


# Odd sizes; a dense first layer; V2 without the query bottleneck, routed by groups, YaRN with the
# attention factor 1 (as V2-Lite); V3 with the bottleneck, sigmoid routing with a random bias, YaRN
# with an attention factor; no EOS id (the oracle's min_new_tokens would suppress it).
MLA_COMMON: dict[str, Any] = dict(
    vocab_size=301, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
    num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=3, first_k_dense_replace=1, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_group=4, topk_group=2, initializer_range=0.2,
    eos_token_id=None, max_position_embeddings=256)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64)
MLA_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "deepseek_v2": ("DeepseekV2", dict(q_lora_rank=None, n_shared_experts=2, topk_method="group_limited_greedy",
                                       rope_parameters=dict(YARN, mscale=0.707, mscale_all_dim=0.707))),
    "deepseek_v3": ("DeepseekV3", dict(q_lora_rank=24, n_shared_experts=1, routed_scaling_factor=2.5,
                                       rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=0.8))),
}


def make_mla_model(kind: str):
    """A random-init transformers DeepSeek-V2 or -V3 (float32, eval mode)."""
    import transformers

    cls, shape = MLA_SHAPES[kind]
    torch.manual_seed(0)
    hf = getattr(transformers, f"{cls}ForCausalLM")(getattr(transformers, f"{cls}Config")(**MLA_COMMON, **shape)).eval()
    if kind == "deepseek_v3":  # a bias that changes the choice (a new model's is zeros)
        with torch.no_grad():
            for layer in hf.model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    return hf

def hf_greedy(hf, prompt: list[int], n: int = 32) -> list[int]:
    """The oracle: n greedy tokens from transformers' generate, EOS ignored."""
    return hf.generate(torch.tensor([prompt], device=hf.device), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False)[0, len(prompt):].tolist()


def shared_workload(n: int = 14, seed: int = 0, vocab: int = 301):
    """Requests over three shared prefixes of 17-33 tokens (some requests are a bare prefix, so
    they are cached whole the second time), with random outputs (greedy, EOS ignored)."""
    from miniinfer.core.sampling_params import SamplingParams

    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randint(17, 33))] for _ in range(3)]
    prompts = [prefixes[i % 3] + [rng.randrange(vocab) for _ in range(rng.randint(0, 12) * (i > 2))]
               for i in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 16), ignore_eos=True) for _ in range(n)]
    return prompts, params


def run_steps(engine) -> tuple[dict, int]:
    """Step until idle; final outputs by request id and how many preemptions happened."""
    final, preempted = {}, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.request_id not in final
            if o.finished:
                final[o.request_id] = o
        preempted += len(engine.stats.preempted)
        assert len(engine.scheduler.running) <= engine.config.max_num_seqs
    return final, preempted


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def random_paged(rng: random.Random, lens: list[int], Hk: int, D: int, block_size: int, device, dtype):
    """Pools with spare blocks and disjoint, shuffled block tables for sequences of these lengths."""
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + rng.randint(1, 5)
    gen = torch.Generator().manual_seed(rng.randint(0, 2**31))
    pools = [torch.randn(num_blocks, block_size, Hk, D, generator=gen).to(device, dtype) for _ in range(2)]
    perm = torch.randperm(num_blocks, generator=gen)[:sum(need)].split(need)
    tables = torch.full((len(lens), max(need) + rng.randint(0, 2)), num_blocks - 1, dtype=torch.int32)
    for b, blocks in enumerate(perm):
        tables[b, :len(blocks)] = blocks
    return pools, tables.to(device), gen


def random_heads(rng: random.Random):
    """(Hq, Hk, D): head dims 64, 128 and odd ones, GQA groups of 1 to 5."""
    Hk, group = rng.choice([1, 2, 3]), rng.choice([1, 2, 4, 5])
    return Hk * group, Hk, rng.choice([64, 128, 20, 40, 96])


def decode_errors(device="cpu", dtype=torch.float32, cases: int = 10, max_len: int = 5000) -> list[float]:
    """Chapter 05's decode kernel against its float64 reference on random odd cases: relative errors."""
    from miniinfer.kernels.attention import paged_attention
    from miniinfer.worker.paged_cache import paged_attention_ref

    rng = random.Random(0)
    errs = []
    for case in range(cases):
        Hq, Hk, D = random_heads(rng)
        bs = [1, 3, 16, 32][case % 4]
        lens = [rng.choice([1, rng.randint(1, 100), rng.randint(1, max_len)]) for _ in range(rng.randint(1, 4))]
        (k_cache, v_cache), tables, gen = random_paged(rng, lens, Hk, D, bs, device, dtype)
        # q as the model passes it: a strided view into the fused qkv output
        q = torch.randn(len(lens), (Hq + 2 * Hk) * D, generator=gen).to(device, dtype)[:, :Hq * D].view(-1, Hq, D)
        ctx = torch.tensor(lens, dtype=torch.int32, device=device)
        splits = rng.choice([None, 1, rng.randint(2, 9)])
        out = paged_attention(q, k_cache, v_cache, tables, ctx, D ** -0.5, num_splits=splits)
        ref = paged_attention_ref(q.double(), k_cache.double(), v_cache.double(), tables, ctx, D ** -0.5)
        errs.append(rel_err(out, ref))
    return errs


def prefill_errors(device="cpu", dtype=torch.float32, cases: int = 10, max_len: int = 600) -> list[float]:
    """Chapter 05's prefill kernel against its float64 reference on random odd cases (decodes, whole
    prompts, chunks after a cached prefix): relative errors."""
    from miniinfer.kernels.attention import prefill_attention
    from miniinfer.worker.kv_cache import prefill_attention_ref

    rng = random.Random(1)
    errs = []
    for case in range(cases):
        Hq, Hk, D = random_heads(rng)
        bs = [1, 3, 16, 32][case % 4]
        # Decodes, whole prompts, and chunks after a cached prefix that may end mid-block.
        seqs = [(rng.choice([0, 0, rng.randint(1, max_len)]), rng.choice([1, rng.randint(1, max_len // 3)]))
                for _ in range(rng.randint(1, 4))]
        lens = [c + n for c, n in seqs]
        (k_cache, v_cache), tables, gen = random_paged(rng, lens, Hk, D, bs, device, dtype)
        q_lens = torch.tensor([n for _, n in seqs])
        qsl = torch.cat([torch.zeros(1), q_lens.cumsum(0)]).to(device, torch.int32)
        N = int(q_lens.sum())
        q = torch.randn(N, (Hq + 2 * Hk) * D, generator=gen).to(device, dtype)[:, :Hq * D].view(N, Hq, D)
        ctx = torch.tensor(lens, dtype=torch.int32, device=device)
        out = prefill_attention(q, k_cache, v_cache, qsl, ctx, tables, D ** -0.5, int(q_lens.max()))
        ref = prefill_attention_ref(q.double(), k_cache.double(), v_cache.double(), qsl, ctx, tables, D ** -0.5)
        errs.append(rel_err(out, ref))
    return errs
