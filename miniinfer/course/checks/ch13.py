"""The checks of problem set 13 (mixture of experts): each answer against the reference, on random inputs.

Hand-written module (chapter 13)."""

from __future__ import annotations

from typing import Callable

import torch

from miniinfer.course.checks.harness import (
    as_tensor,
    check,
    exercise,
    randint,
    random_block_size,
    saved_checkpoint,
    serve_through,
)


def _by_expert(route_fn: Callable) -> Callable:
    """route_fn's (weights, ids) with each token's k choices in expert order: any order is right."""
    def run(logits, top_k, renormalize):
        weights, ids = route_fn(logits, top_k, renormalize)
        order = ids.argsort(dim=-1)
        return weights.gather(-1, order), ids.gather(-1, order)
    return run


def _logits(gen, case):
    T, E = randint(gen, 1, 9), randint(gen, 2, 12)
    k = 1 if case == 0 else E if case == 1 else randint(gen, 1, E)
    return torch.randn(T, E, generator=gen) * 2, k, bool(case % 2)


@exercise("13", 1, "route_tokens")
def check_route_tokens(fn: Callable) -> None:
    """fn(logits [T, E], top_k, renormalize) -> (weights [T, k] float32, ids [T, k] int64): each token's
    top_k experts by the softmax over all E, their probabilities renormalized to sum to 1 if asked."""
    from miniinfer.layers.moe import route
    check("route_tokens", _by_expert(fn), _by_expert(route), _logits, cases=24)


def _align_inputs(gen, case):
    T, E = randint(gen, 1, 12), randint(gen, 1, 8)
    k = randint(gen, 1, E)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    return ids, E, random_block_size(gen, case, 5)


@exercise("13", 2, "align_pairs")
def check_align_pairs(fn: Callable) -> None:
    """fn(ids [T, k], num_experts, block) -> (pairs, expert) as lists: the pairs t * k + j sorted by expert
    (in pair order within one), each expert's run padded with T * k to whole blocks, the rows rounded up
    to T * k + num_experts * (block - 1) and whole blocks; each block's expert, -1 past the last."""
    from miniinfer.kernels.moe import align

    def reference(ids, num_experts, block):
        pairs, expert = align(ids, num_experts, block)
        return pairs.tolist(), expert.tolist()
    check("align_pairs", as_tensor(fn), as_tensor(reference), _align_inputs, cases=30)


def _experts_inputs(gen, case):
    from miniinfer.layers.moe import route
    T, E, H, inter = randint(gen, 1, 9), randint(gen, 2, 8), randint(gen, 3, 12), randint(gen, 2, 10)
    weights, ids = route(torch.randn(T, E, generator=gen), randint(gen, 1, E), bool(case % 2))
    return (torch.randn(T, H, generator=gen), weights, ids, torch.randn(E, 2 * inter, H, generator=gen) / H ** 0.5,
            torch.randn(E, H, inter, generator=gen) / inter ** 0.5)


@exercise("13", 3, "experts_forward")
def check_experts_forward(fn: Callable) -> None:
    """fn(x [T, H], weights [T, k], ids [T, k], w13 [E, 2I, H], w2 [E, H, I]) -> [T, H]: each token's sum
    over its k experts of weight x down(silu(gate(x)) * up(x)), gate the first I rows of w13."""
    from miniinfer.layers.moe import experts_reference
    check("experts_forward", fn, experts_reference, _experts_inputs, cases=16)


def _rank_pairs_ref(ids, num_experts, rank, size):
    lo, hi = rank * num_experts // size, (rank + 1) * num_experts // size
    return [i for i, e in enumerate(ids.flatten().tolist()) if lo <= e < hi]


@exercise("13", 4, "rank_pairs")
def check_rank_pairs(fn: Callable) -> None:
    """fn(ids [T, k], num_experts, rank, size) -> the pairs t * k + j, in order, whose expert rank `rank` of
    `size` holds: experts rank * E // size up to (rank + 1) * E // size - 1."""
    def inputs(gen, case):
        ids, E, _ = _align_inputs(gen, case)
        size = randint(gen, 1, min(E, 4))
        return ids, E, randint(gen, 0, size - 1), size
    check("rank_pairs", as_tensor(fn), as_tensor(_rank_pairs_ref), inputs, cases=30)


def _qwen2_moe():
    import transformers
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        vocab_size=301, hidden_size=72, intermediate_size=100, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, initializer_range=0.2, eos_token_id=None, num_experts=7, num_experts_per_tok=3,
        moe_intermediate_size=40, shared_expert_intermediate_size=56, mlp_only_layers=[1]))


def moe_checkpoint() -> str:
    """A small random Qwen2-MoE (7 experts, top 3, a shared expert, a dense layer between two sparse ones)
    saved to a temporary folder, made once."""
    return saved_checkpoint("moe", _qwen2_moe)


@exercise("13", 5, "your_layers")
def check_your_layers(your_layers: Callable) -> None:
    """The last part: your_layers(model) sets each sparse layer's router to your route_tokens and its
    experts to your experts_forward; the engine then serves three requests (blocks of 4, prompts in
    pieces of a 6-token budget, the pool small enough to preempt) with the package engine's tokens,
    every block back."""
    __tracebackhide__ = True
    serve_through("13", moe_checkpoint(), your_layers, "through your router and experts")
