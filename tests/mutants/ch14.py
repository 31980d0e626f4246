"""Wrong answers to problem set 14 that its checks must reject: each named (or documented) for its mistake."""

import torch

from miniinfer.course import checks as testing
from miniinfer.kernels.mla import latent_decode


def values_not_counted(cfg, itemsize):
    """Counts a key per KV head and no value: half the bytes of a grouped-query cache."""
    if "kv_lora_rank" in cfg:
        return cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * itemsize
    heads = cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * (cfg.get("num_key_value_heads") or heads) * \
        (cfg.get("head_dim") or cfg["hidden_size"] // heads) * itemsize


def latent_without_rotary_key(cfg, itemsize):
    """Keeps the latent alone: the rotary key, cached beside it, is forgotten."""
    if "kv_lora_rank" in cfg:
        return cfg["num_hidden_layers"] * cfg["kv_lora_rank"] * itemsize
    heads = cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * (cfg.get("num_key_value_heads") or heads) * \
        (cfg.get("head_dim") or cfg["hidden_size"] // heads) * itemsize


def query_heads_not_kv_heads(cfg, itemsize):
    """Counts a key and a value per attention head, as if every model were multi-head."""
    if "kv_lora_rank" in cfg:
        return cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * itemsize
    heads = cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * heads * (cfg.get("head_dim") or cfg["hidden_size"] // heads) * itemsize


def kv_heads_checked_first(cfg, itemsize):
    """Reads num_key_value_heads before kv_lora_rank: DeepSeek's config.json names both, and its cache holds latents."""
    if "num_key_value_heads" in cfg:
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * itemsize
    return cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * itemsize


def decompressed_in_float32(latent, k_rope, kv_b, num_heads, nope_dim, v_dim):
    """Upcasts to compute and returns the float32 keys and values: the attention after it runs in the model's dtype."""
    T, rope = k_rope.shape
    kv = torch.einsum("tr,hdr->thd", latent.float(), kv_b.float().view(num_heads, nope_dim + v_dim, -1))
    k_nope, values = kv.split([nope_dim, v_dim], dim=-1)
    return torch.cat([k_nope, k_rope.float()[:, None].expand(T, num_heads, rope)], dim=-1), values


def values_before_keys(latent, k_rope, kv_b, num_heads, nope_dim, v_dim):
    """Reads each head's rows as v_dim of W_UV first, then nope_dim of W_UK: the halves swapped."""
    T, rope = k_rope.shape
    w = kv_b.view(num_heads, nope_dim + v_dim, -1)
    values = torch.einsum("tr,hvr->thv", latent, w[:, :v_dim])
    k_nope = torch.einsum("tr,hnr->thn", latent, w[:, v_dim:])
    return torch.cat([k_nope, k_rope[:, None].expand(T, num_heads, rope)], dim=-1), values


def rows_split_by_kind_first(latent, k_rope, kv_b, num_heads, nope_dim, v_dim):
    """Takes all heads' key rows first, then all heads' value rows, not each head's rows together."""
    T, rope = k_rope.shape
    r = kv_b.shape[1]
    w_uk = kv_b[:num_heads * nope_dim].view(num_heads, nope_dim, r)
    w_uv = kv_b[num_heads * nope_dim:].view(num_heads, v_dim, r)
    k_nope = torch.einsum("tr,hnr->thn", latent, w_uk)
    return torch.cat([k_nope, k_rope[:, None].expand(T, num_heads, rope)], dim=-1), \
        torch.einsum("tr,hvr->thv", latent, w_uv)


def rotary_key_first(latent, k_rope, kv_b, num_heads, nope_dim, v_dim):
    """Puts the rotary key before the rebuilt part of each key."""
    T, rope = k_rope.shape
    w = kv_b.view(num_heads, nope_dim + v_dim, -1)
    k_nope = torch.einsum("tr,hnr->thn", latent, w[:, :nope_dim])
    return torch.cat([k_rope[:, None].expand(T, num_heads, rope), k_nope], dim=-1), \
        torch.einsum("tr,hvr->thv", latent, w[:, nope_dim:])


def one_heads_w_uk_for_all(q_nope, w_uk):
    """Absorbs head 0's W_UK into every head's query."""
    return torch.einsum("...hn,nr->...hr", q_nope, w_uk[0])


def w_uk_summed_over_heads(q_nope, w_uk):
    """Sums the heads' W_UK into one matrix before absorbing."""
    return torch.einsum("...hn,nr->...hr", q_nope, w_uk.sum(0))


def heads_reversed(q_nope, w_uk):
    """Pairs head h's query with the last-but-h head's W_UK: the heads' order lost."""
    return torch.einsum("...hn,hnr->...hr", q_nope, w_uk.flip(0))


def one_heads_w_uv_for_all(out, w_uv):
    """Takes every head's output out of the latent through head 0's W_UV."""
    return torch.einsum("...hr,vr->...hv", out, w_uv[0])


def w_uv_heads_reversed(out, w_uv):
    """Pairs head h's weighted sum with the last-but-h head's W_UV."""
    return torch.einsum("...hr,hvr->...hv", out, w_uv.flip(0))


def output_in_float32(out, w_uv):
    """Upcasts to multiply and returns float32: the output projection after it runs in the model's dtype."""
    return torch.einsum("...hr,hvr->...hv", out.float(), w_uv.float())


def no_rotary_scores(q, kv_cache, block_tables, context_lens, scale):
    """Scores from the latent alone: the rotary query and key, which carry the positions, are left out."""
    R = 1 << (q.shape[-1].bit_length() - 1)
    return latent_decode(torch.cat([q[..., :R], torch.zeros_like(q[..., R:])], -1), kv_cache, block_tables,
                         context_lens, scale)


def unscaled_scores(q, kv_cache, block_tables, context_lens, scale):
    """Forgets the scale: the softmax of the raw products, too peaked."""
    return latent_decode(q, kv_cache, block_tables, context_lens, 1.0)


def blocks_in_pool_order(q, kv_cache, block_tables, context_lens, scale):
    """Reads each sequence's blocks in the pool's order (its table sorted), not in the order its table gives."""
    return latent_decode(q, kv_cache, block_tables.sort(dim=1).values, context_lens, scale)


def newest_token_left_out(q, kv_cache, block_tables, context_lens, scale):
    """Stops one token early (a `<=` read as `<`): the newest token's row, stored before the step, is not attended."""
    return latent_decode(q, kv_cache, block_tables, (context_lens - 1).clamp(min=1), scale)


class KernelWithoutScale:
    """latent_decode_kernel as a student's that forgets the scale (it writes what such a kernel would into
    `out`): `kernel[grid](...)` as a Triton kernel is called."""

    def __getitem__(self, grid):
        def launch(q, kv_cache, tables, lens, out, scale, *args, **kwargs):
            out.copy_(testing.latent_attention_ref(q, kv_cache, tables, lens, 1.0))
        return launch


# (the check, the wrong answer)
MUTANTS = [
    (testing.check_cache_bytes, values_not_counted),
    (testing.check_cache_bytes, latent_without_rotary_key),
    (testing.check_cache_bytes, query_heads_not_kv_heads),
    (testing.check_cache_bytes, kv_heads_checked_first),
    (testing.check_decompress, values_before_keys),
    (testing.check_decompress, decompressed_in_float32),
    (testing.check_decompress, rows_split_by_kind_first),
    (testing.check_decompress, rotary_key_first),
    (testing.check_absorb_query, one_heads_w_uk_for_all),
    (testing.check_absorb_query, w_uk_summed_over_heads),
    (testing.check_absorb_query, heads_reversed),
    (testing.check_absorb_output, one_heads_w_uv_for_all),
    (testing.check_absorb_output, w_uv_heads_reversed),
    (testing.check_absorb_output, output_in_float32),
    (testing.check_latent_decode, no_rotary_scores),
    (testing.check_latent_decode, unscaled_scores),
    (testing.check_latent_decode, blocks_in_pool_order),
    (testing.check_latent_decode, newest_token_left_out),
]
