"""The checks of problem set 14 (latent attention): each answer against the reference, on random inputs in
the dtypes the engine runs, and the last part: the engine's prompts and decodes through the student's
pieces.

Hand-written module (chapter 14)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from miniinfer.course.checks.harness import (
    DTYPES,
    as_tensor,
    check,
    device,
    exercise,
    randint,
    run_answer,
    saved_checkpoint,
    serve_through,
)
from miniinfer.course.checks.speed import kernel_ratio, needs_gpu, speed_item


def _config(gen, case) -> dict:
    """A whole config.json dict as transformers writes it, every key of its family: Qwen2's multi-head or
    Mixtral's grouped-query attention (no head_dim: hidden_size // heads), Qwen3's grouped-query with its
    own head_dim, or DeepSeek-V2's and V3's latent attention (whose dicts also name num_key_value_heads
    and head_dim, which the latent makes moot)."""
    import transformers
    heads = randint(gen, 1, 8)
    divisors = [h for h in range(1, heads + 1) if heads % h == 0]
    kv = divisors[randint(gen, 0, len(divisors) - 1)]
    common: dict[str, Any] = dict(vocab_size=100, hidden_size=8 * heads, intermediate_size=16,
                                  num_hidden_layers=randint(gen, 1, 6), num_attention_heads=heads)
    kind = case % 5
    config: Any
    if kind == 0:
        config = transformers.Qwen2Config(**common, num_key_value_heads=heads)
    elif kind == 1:
        config = transformers.MixtralConfig(**common, num_key_value_heads=kv, num_local_experts=4)
    elif kind == 2:
        config = transformers.Qwen3Config(**common, num_key_value_heads=kv, head_dim=2 * randint(gen, 2, 20))
    else:
        family = transformers.DeepseekV2Config if kind == 3 else transformers.DeepseekV3Config
        config = family(**common, num_key_value_heads=heads, kv_lora_rank=randint(gen, 4, 64), q_lora_rank=None,
                        qk_nope_head_dim=randint(gen, 2, 16), qk_rope_head_dim=2 * randint(gen, 1, 8),
                        v_head_dim=randint(gen, 2, 16), n_routed_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=8, n_group=1, topk_group=1)
    return config.to_dict()


def _cache_bytes_ref(cfg: dict, itemsize: int) -> int:
    import miniinfer as mi
    return mi.read_config(cfg).cache_bytes_per_token(itemsize)


@exercise("14", 1, "cache_bytes")
def check_cache_bytes(fn: Callable) -> None:
    """fn(cfg: a config.json dict, itemsize) -> the bytes one token leaves in the cache over all layers:
    a key and a value per KV head (num_key_value_heads, else one per head; head_dim, else hidden_size //
    heads), or, with latent attention (kv_lora_rank), one latent and one rotary key of qk_rope_head_dim."""
    check("cache_bytes", as_tensor(fn), as_tensor(_cache_bytes_ref),
          lambda gen, case: (_config(gen, case), (1, 2, 4)[randint(gen, 0, 2)]), cases=25)


def _latent_inputs(gen, case):
    """A cache's latents and rotary keys and kv_b_proj's weight, in float32, float16 or bfloat16."""
    T, H, r, rope = randint(gen, 1, 7), randint(gen, 1, 5), randint(gen, 2, 24), 2 * randint(gen, 1, 4)
    nope, v = randint(gen, 1, 12), randint(gen, 1, 12)
    dtype = DTYPES[case % 3]
    return (torch.randn(T, r, generator=gen).to(dtype), torch.randn(T, rope, generator=gen).to(dtype),
            (torch.randn(H * (nope + v), r, generator=gen) / r ** 0.5).to(dtype), H, nope, v)


def _decompress_ref(latent, k_rope, kv_b, num_heads, nope_dim, v_dim):
    """In float32, each result rounded once to the inputs' dtype (as a matmul that accumulates in float32)."""
    T, rope = k_rope.shape
    kv = torch.einsum("tr,hdr->thd", latent.float(), kv_b.float().view(num_heads, nope_dim + v_dim, -1))
    k_nope, values = kv.to(latent.dtype).split([nope_dim, v_dim], dim=-1)
    return torch.cat([k_nope, k_rope[:, None].expand(T, num_heads, rope)], dim=-1), values


@exercise("14", 2, "decompress")
def check_decompress(fn: Callable) -> None:
    """fn(latent [T, r], k_rope [T, rope], kv_b [H * (nope + v), r], num_heads, nope_dim, v_dim) ->
    (keys [T, H, nope + rope], values [T, H, v]): kv_b's rows per head are nope_dim rows of W_UK, then
    v_dim rows of W_UV; each head's key is its W_UK times the latent, then the shared rotary key."""
    check("decompress", fn, _decompress_ref, _latent_inputs, cases=18)


def _absorb_inputs(gen, case, right: bool):
    """A step's queries (or outputs) [T, H, n] (every third case [B, T, H, n], as the engine passes them)
    and each head's matrix: w_uk [H, nope, r] (right: w_uv [H, v, r]), in float32, float16 or bfloat16."""
    T, H, n, r = randint(gen, 1, 7), randint(gen, 1, 5), randint(gen, 1, 12), randint(gen, 2, 24)
    lead = (randint(gen, 1, 3), T) if case % 3 == 2 else (T,)
    dtype = DTYPES[case % 3]
    x = torch.randn(*lead, H, r if right else n, generator=gen).to(dtype)
    return x, torch.randn(H, n, r, generator=gen).to(dtype)


@exercise("14", 3, "absorb_query")
def check_absorb_query(fn: Callable) -> None:
    """fn(q_nope [..., H, nope], w_uk [H, nope, r]) -> [..., H, r] in the inputs' dtype: each head's query
    times its W_UK, so that its product with a latent equals its product with the key W_UK rebuilds."""
    def reference(q_nope, w_uk):  # in float32, rounded once to the inputs' dtype
        return torch.einsum("...hn,hnr->...hr", q_nope.float(), w_uk.float()).to(q_nope.dtype)
    check("absorb_query", fn, reference, lambda gen, case: _absorb_inputs(gen, case, False), cases=18)


@exercise("14", 4, "absorb_output")
def check_absorb_output(fn: Callable) -> None:
    """fn(out [..., H, r], w_uv [H, v, r]) -> [..., H, v] in the inputs' dtype: each head's weighted sum of
    latents out of the latent's space through its W_UV, what its rebuilt values would have given."""
    def reference(out, w_uv):  # in float32, rounded once to the inputs' dtype
        return torch.einsum("...hr,hvr->...hv", out.float(), w_uv.float()).to(out.dtype)
    check("absorb_output", fn, reference, lambda gen, case: _absorb_inputs(gen, case, True), cases=18)


# Triton 3.6's CPU interpreter multiplies bfloat16 blocks in tl.dot as their raw 16-bit patterns (numpy has no
# bfloat16): the kernel's check runs bfloat16 on a GPU only.
KERNEL_DTYPES = DTYPES if torch.cuda.is_available() else DTYPES[:2]
# The kernel rounds each tile's softmax weights to the cache's dtype before the weighted sum, as chapter 05's.
DECODE_TOLERANCES = {torch.float16: (1e-2, 1e-2), torch.bfloat16: (5e-2, 5e-2)}


def _decode_inputs(gen, case):
    """B sequences' absorbed queries [B, H, R + P] (R a power of two: the latent, P the rotary key) over a
    paged pool of rows [blocks, block_size, 1, R + P] in blocks handed out in no order, with ragged
    lengths; block sizes 1 and 3 first."""
    B, H = randint(gen, 1, 4), randint(gen, 1, 6)
    R, P = (16, 32, 64)[case % 3], 2 * randint(gen, 1, 8)
    size = (1, 3)[case] if case < 2 else randint(gen, 2, 8)
    lens = torch.randint(1, 41, (B,), generator=gen)
    per = [-(-int(n) // size) for n in lens]
    width, total = max(per), sum(per) + 3
    order = torch.randperm(total, generator=gen)
    tables = torch.zeros(B, width, dtype=torch.int32)
    at = 0
    for b, n in enumerate(per):
        tables[b, :n] = order[at:at + n]
        at += n
    dtype = KERNEL_DTYPES[case % len(KERNEL_DTYPES)]
    pool = torch.randn(total, size, 1, R + P, generator=gen).to(dtype)
    q = (torch.randn(B, H, R + P, generator=gen) / 2).to(dtype)
    return q, pool, tables, lens.to(torch.int32), (R + P) ** -0.5


def latent_attention_ref(q, kv_cache, block_tables, context_lens, scale):
    """Chapter 03's paged attention in float32 with the pool as keys and as values, rounded to q's dtype."""
    from miniinfer.worker.paged_cache import paged_attention_ref
    pool = kv_cache.float()
    return paged_attention_ref(q.float(), pool, pool, block_tables.long(), context_lens.long(), scale).to(q.dtype)


@exercise("14", 5, "latent_decode_kernel", argument="latent_decode")
def check_latent_decode(fn: Callable) -> None:
    """fn(q [B, H, D], kv_cache [blocks, block_size, 1, D], block_tables [B, W], context_lens [B], scale)
    launching the kernel -> [B, H, D] in q's dtype: each head's attention over its sequence's cached rows,
    each row both the key and the value; on the GPU when there is one."""
    check("latent_decode", fn, latent_attention_ref, _decode_inputs, cases=12, device=device(),
          tolerances=DECODE_TOLERANCES)


@speed_item("14", 5, "latent_decode_kernel", argument="latent_decode")
def speed_latent_decode(fn: Callable):
    """fn (exercise 5's launcher) on a decode step of DeepSeek-V2-Lite's attention: 256 sequences of 1,024
    cached tokens, 16 heads, rows of 512 + 64 in bfloat16, blocks of 16 in no order, against the package's
    latent_decode (which splits no context at this batch): every cached row read once."""
    if not torch.cuda.is_available():
        return needs_gpu("the latent decode kernel")
    from miniinfer.kernels.mla import latent_decode
    gen = torch.Generator("cuda").manual_seed(0)
    B, H, D, L, size = 256, 16, 576, 1024, 16
    blocks = B * L // size
    pool = torch.randn(blocks, size, 1, D, generator=gen, device="cuda").to(torch.bfloat16)
    tables = torch.randperm(blocks, generator=gen, device="cuda").to(torch.int32).view(B, L // size)
    q = (torch.randn(B, H, D, generator=gen, device="cuda") / 2).to(torch.bfloat16)
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    nbytes = pool.numel() * 2 + 2 * q.numel() * 2
    return kernel_ratio("latent_decode at batch 256 over 1,024 tokens", fn,
                        lambda q, c, t, n, s: latent_decode(q, c, t, n, s), (q, pool, tables, lens, D ** -0.5), nbytes)


def _deepseek_v2():
    import transformers
    return transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(
        vocab_size=301, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3, first_k_dense_replace=1,
        kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        topk_method="group_limited_greedy", n_group=4, topk_group=2, initializer_range=0.2, eos_token_id=None))


def mla_checkpoint() -> str:
    """A small random DeepSeek-V2 (no query bottleneck, experts routed by groups, two shared experts, a
    dense first layer) saved to a temporary folder, made once."""
    return saved_checkpoint("mla", _deepseek_v2)


@exercise("14", 6, "your_attention", "your_attention, YourKernels, cache_bytes")
def check_your_attention(your_attention: Callable, kernels: type, cache_bytes: Callable) -> None:
    """The last part: your_attention(model) sets each layer's decompress, absorb_query and absorb_output to
    yours, and kernels() (an attention-kernels class whose decode runs your kernel) serves the steps'
    decodes; the engine then serves three requests (blocks of 4, prompts in pieces of a 6-token budget, the
    pool small enough to preempt) with the package engine's tokens, every block back: its prompts through
    your decompression, its decodes through your absorption and your kernel. Your cache_bytes must also
    count the bytes a token takes in the engine's pool."""
    __tracebackhide__ = True
    import json
    from pathlib import Path

    from miniinfer.worker.kv_cache import ATTENTION_KERNELS
    folder = mla_checkpoint()
    # With kernels="triton", a latent model's pool runs ATTENTION_KERNELS["latent"]: yours, for this engine
    package = dict.__getitem__(ATTENTION_KERNELS, "latent")
    ATTENTION_KERNELS["latent"] = kernels()
    try:
        _, engine = serve_through("14", folder, your_attention, "through your decompression, absorption and kernel",
                                  kernels="triton")
    finally:
        ATTENTION_KERNELS["latent"] = package
    cfg = json.loads((Path(folder) / "config.json").read_text())
    pools = engine.executor.kv_pools()
    pool_bytes = sum(p.nbytes for p in pools) // (pools[0].shape[1] * pools[0].shape[2])
    itemsize = pools[0].element_size()
    got = run_answer(cache_bytes, (cfg, itemsize), "cache_bytes on the checkpoint's config.json")
    if got != pool_bytes:
        raise AssertionError(f"cache_bytes(the checkpoint's config.json, {itemsize}): the engine's pool holds "
                             f"{pool_bytes} bytes a token, received {got}")
    print(f"passed: cache_bytes counts the {pool_bytes} bytes a token takes in the engine's pool")
