"""The checks of problem set 14 (latent attention): each answer against the reference, on random inputs.

Hand-written module (chapter 14)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from miniinfer.course.checks.harness import DTYPES, as_tensor, check, exercise, randint, saved_checkpoint, serve_through


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


@exercise("14", 3, "absorb_query")
def check_absorb_query(fn: Callable) -> None:
    """fn(q_nope [T, H, nope], w_uk [H, nope, r]) -> [T, H, r]: each head's query times its W_UK, so that
    its product with a latent equals its product with the key W_UK rebuilds from that latent."""
    def inputs(gen, case):
        T, H, nope, r = randint(gen, 1, 7), randint(gen, 1, 5), randint(gen, 1, 12), randint(gen, 2, 24)
        dtype = DTYPES[case % 3]
        return torch.randn(T, H, nope, generator=gen).to(dtype), torch.randn(H, nope, r, generator=gen).to(dtype)

    def reference(q_nope, w_uk):  # in float32, rounded once to the inputs' dtype
        return torch.einsum("thn,hnr->thr", q_nope.float(), w_uk.float()).to(q_nope.dtype)
    check("absorb_query", fn, reference, inputs, cases=18)


def _latent_decode_ref(q_latent, q_rope, latent, k_rope, w_uv, scale):
    scores = (q_latent @ latent.T + q_rope @ k_rope.T) * scale
    return torch.einsum("hvr,hr->hv", w_uv, scores.softmax(-1) @ latent)


@exercise("14", 4, "latent_decode")
def check_latent_decode(fn: Callable) -> None:
    """fn(q_latent [H, r], q_rope [H, rope], latent [L, r], k_rope [L, rope], w_uv [H, v, r], scale) ->
    [H, v]: one decode token's attention over L cached tokens in the latent's space (scores: q_latent .
    latent + q_rope . k_rope, times scale; softmax; the weighted sum of the latents), then each head's W_UV."""
    def inputs(gen, case):
        H, r, rope, v, L = randint(gen, 1, 6), randint(gen, 2, 24), 2 * randint(gen, 1, 4), randint(gen, 1, 12), \
            randint(gen, 1, 20)
        return (torch.randn(H, r, generator=gen), torch.randn(H, rope, generator=gen), torch.randn(L, r, generator=gen),
                torch.randn(L, rope, generator=gen), torch.randn(H, v, r, generator=gen), (r + rope) ** -0.5)
    check("latent_decode", fn, _latent_decode_ref, inputs, cases=16)


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


@exercise("14", 5, "your_attention")
def check_your_attention(your_attention: Callable) -> None:
    """The last part: your_attention(model) sets each layer's absorb_query to yours (and absorb_output);
    the engine then serves three requests (blocks of 4, prompts in pieces of a 6-token budget, the pool
    small enough to preempt) with the package engine's tokens, every block back."""
    __tracebackhide__ = True
    serve_through("14", mla_checkpoint(), your_attention, "through your absorbed attention")
