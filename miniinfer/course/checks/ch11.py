"""The checks of problem set 11 (tensor parallelism): each answer against the reference, on random inputs.

Hand-written module (chapter 11)."""

from __future__ import annotations

from typing import Callable

import torch

from miniinfer.course.checks.harness import check, exercise, randint, run_answer
from miniinfer.model.transformer import apply_rope, causal_attention, rope_cos_sin


def _shard_linear_ref(w, rank, size, by):
    from miniinfer.layers.parallel import Shard

    share = Shard(rank, size).part(w.shape[0 if by == "output" else 1])
    return w[share] if by == "output" else w[:, share]


@exercise("11", 1, "shard_linear")
def check_shard_linear(fn: Callable) -> None:
    """fn(w [N, K], rank, size, by) -> rank's share of w: by="output" its N/size consecutive rows
    (column-parallel), by="input" its K/size consecutive columns (row-parallel)."""
    def inputs(gen, case):
        size = (2, 3, 4)[case % 3]
        w = torch.randn(size * randint(gen, 1, 5), size * randint(gen, 1, 5), generator=gen)
        return w, randint(gen, 0, size - 1), size, ("output", "input")[case % 2]
    check("shard_linear", fn, _shard_linear_ref, inputs, cases=12, rtol=0, atol=0)


@exercise("11", 2, "vocab_lookup")
def check_vocab_lookup(fn: Callable) -> None:
    """fn(ids [B, T], share [V/size, H], start) -> [B, T, H]: the embedding of each id that falls in
    this rank's rows start .. start + len(share) - 1, and zeros for every other id (the ranks' results
    are then added up)."""
    from miniinfer.layers.parallel import share_lookup

    def inputs(gen, case):
        size, per = randint(gen, 2, 4), randint(gen, 1, 9)
        rank = randint(gen, 0, size - 1)
        start, vocab = rank * per, size * per
        ids = torch.randint(0, vocab, (randint(gen, 1, 3), randint(gen, 4, 7)), generator=gen)
        # the share's first and last rows, and the ids just outside it
        ids[0, :4] = torch.tensor([max(start - 1, 0), start, start + per - 1, min(start + per, vocab - 1)])
        return ids, torch.randn(per, randint(gen, 1, 6), generator=gen), start
    check("vocab_lookup", fn, share_lookup, inputs, cases=12, rtol=0, atol=0)


# What follows each module when its layer is split over ranks (None: its output stays split).
COLLECTIVES = {"embed_tokens": "all_reduce", "qkv_proj": None, "o_proj": "all_reduce", "gate_up_proj": None,
               "down_proj": "all_reduce", "lm_head": "all_gather"}


@exercise("11", 3, "collective_after")
def check_collective_after(fn: Callable) -> None:
    """fn(module) -> the collective the ranks run on `module`'s output: "all_reduce", "all_gather", or
    None where each rank's share of the output is all that the next op needs."""
    for module, want in COLLECTIVES.items():
        got = run_answer(fn, (module,), f"collective_after({module!r})")
        if got != want:
            raise AssertionError(
                f"collective_after({module!r}) is {got!r}: wrong. Ask what each rank holds after {module} (a slice "
                "of the output, or a partial sum of all of it) and what the next op needs")
    print(f"passed: collective_after is right for all {len(COLLECTIVES)} modules")


@exercise("11", 4, "kv_heads_for")
def check_kv_heads_for(fn: Callable) -> None:
    """fn(rank, size, num_kv_heads) -> (start, stop): the KV heads rank keeps: its even share, or, with
    fewer KV heads than ranks, the one head that its query heads read."""
    from miniinfer.layers.parallel import Shard

    cases = [(r, s, n) for s in (1, 2, 4, 8) for n in (1, 2, 4, 8, 16) if n % s == 0 or s % n == 0 for r in range(s)]
    for rank, size, n in cases:
        heads = Shard(rank, size).kv_heads(n)
        got = run_answer(fn, (rank, size, n), f"kv_heads_for({rank}, {size}, {n})")
        if tuple(got) != (heads.start, heads.stop):
            raise AssertionError(f"kv_heads_for({rank}, {size}, {n}) is {tuple(got)}, expected "
                                 f"{(heads.start, heads.stop)}")
    print(f"passed: kv_heads_for is right on {len(cases)} (rank, size, KV heads)")


@torch.no_grad()
def simulated_ranks(model, size: int, answers: dict[str, Callable], prompt: list[int], n: int) -> list[int]:
    """n greedy tokens of a Llama-shaped model (the course model) computed as `size` ranks compute
    them, one rank after another in this process: each rank multiplies by only the shards that
    answers["shard_linear"] and answers["kv_heads_for"] cut, looks up its vocabulary rows with
    answers["vocab_lookup"], and the ranks' results meet as answers["collective_after"] says (a sum
    for an all-reduce, a concatenation for an all-gather, nothing for None)."""
    import torch.nn.functional as F

    from miniinfer.model.transformer import add_rms_norm, silu_and_mul

    shard, lookup, after, kv_for = (answers[k] for k in ("shard_linear", "vocab_lookup", "collective_after",
                                                        "kv_heads_for"))
    cfg, D = model.cfg, model.cfg.head_dim
    assert not (cfg.qkv_bias or cfg.qk_norm or cfg.o_bias or cfg.mlp_bias), "a Llama-shaped model only"
    per = -(-cfg.vocab_size // size)
    pad = (0, 0, 0, per * size - cfg.vocab_size)
    emb, lm = F.pad(model.model.embed_tokens.weight, pad), F.pad(model.lm_head.weight, pad)
    ranks = range(size)

    def meet(module: str, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        how = after(module)
        if how == "all_reduce":
            return [sum(parts)] * size  # type: ignore[list-item]
        if how == "all_gather":
            return [torch.cat(parts, dim=-1)] * size
        return parts

    tokens = list(prompt)
    for _ in range(n):
        ids, T = torch.tensor([tokens]), len(tokens)
        cos, sin = rope_cos_sin(torch.arange(T)[None], model.inv_freq)
        h = meet("embed_tokens", [lookup(ids, emb[r * per:(r + 1) * per], r * per) for r in ranks])
        x = [torch.zeros_like(h[0])] * size
        for layer in model.model.layers:
            attn, mlp, n1, n2 = layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm
            q_w, k_w, v_w = attn.qkv_proj.weight.split(attn.sizes)
            qkv, gate_ups = [], []
            for r in ranks:
                hn, x[r] = add_rms_norm(h[r], x[r], n1.weight, n1.eps)
                start, stop = kv_for(r, size, cfg.num_kv_heads)
                w = torch.cat([shard(q_w, r, size, "output"), k_w[start * D:stop * D], v_w[start * D:stop * D]])
                qkv.append(hn @ w.T)
            qkv = meet("qkv_proj", qkv)
            outs = []
            for r in ranks:
                kv = qkv[r].shape[-1] - cfg.num_heads * D // size
                q, k, v = (t.view(1, T, -1, D) for t in qkv[r].split([cfg.num_heads * D // size, kv // 2, kv // 2], -1))
                q, k = apply_rope(q, k, cos, sin)
                o = causal_attention(q, k, v, D ** -0.5).reshape(1, T, -1)
                outs.append(o @ shard(attn.o_proj.weight, r, size, "input").T)
            h = meet("o_proj", outs)
            for r in ranks:
                hn, x[r] = add_rms_norm(h[r], x[r], n2.weight, n2.eps)
                gate, up = mlp.gate_up_proj.weight.chunk(2)
                gate_ups.append(hn @ torch.cat([shard(gate, r, size, "output"), shard(up, r, size, "output")]).T)
            gate_up = meet("gate_up_proj", gate_ups)
            h = meet("down_proj", [silu_and_mul(gate_up[r]) @ shard(mlp.down_proj.weight, r, size, "input").T
                                   for r in ranks])
        norm = model.model.norm
        last = [add_rms_norm(h[r], x[r], norm.weight, norm.eps)[0][0, -1] for r in ranks]
        logits = meet("lm_head", [last[r] @ lm[r * per:(r + 1) * per].T for r in ranks])[0]
        tokens.append(int(logits[:cfg.vocab_size].argmax()))
    return tokens[len(prompt):]
