"""Wrong answers to problem set 13 that its checks must reject: each named (or documented) for its mistake."""

import torch
import torch.nn.functional as F

from miniinfer.course import checks as testing
from miniinfer.kernels.moe import align
from miniinfer.layers.moe import experts_reference, route


def softmax_over_the_top_k_only(logits, top_k, renormalize):
    """Picks the top k logits, then softmaxes those alone: always renormalized, even when not asked."""
    top, ids = logits.topk(top_k, dim=-1)
    return top.float().softmax(-1), ids


def never_renormalized(logits, top_k, renormalize):
    """Ignores `renormalize`: the top k keep their share of the softmax over all experts."""
    return route(logits, top_k, False)


def weights_from_the_logits(logits, top_k, renormalize):
    """Returns the raw logits of the top k as their weights, without the softmax."""
    top, ids = logits.float().topk(top_k, dim=-1)
    return (top / top.sum(-1, keepdim=True) if renormalize else top), ids


def pairs_by_token_not_expert(ids, num_experts, block):
    """Skips the sort: the pairs in token order, each expert's run padded as if they were sorted."""
    pairs, expert = align(ids, num_experts, block)
    flat = ids.flatten()
    real = pairs < flat.numel()
    pairs[real] = pairs[real].sort().values
    return pairs.tolist(), expert.tolist()


def padded_once_at_the_end(ids, num_experts, block):
    """Pads all experts' runs together at the end instead of each to whole blocks: a block holds two experts."""
    order = ids.flatten().argsort(stable=True)
    size = -(-(ids.numel() + num_experts * (block - 1)) // block) * block
    pairs = order.tolist() + [ids.numel()] * (size - ids.numel())
    firsts = ids.flatten()[order].tolist()
    expert = [firsts[b * block] if b * block < len(firsts) else -1 for b in range(size // block)]
    return pairs, expert


def empty_experts_get_a_block(ids, num_experts, block):
    """Gives an expert with no pairs a block of padding too: blocks for no work, the others shifted."""
    flat = ids.flatten().tolist()
    pairs, expert = [], []
    for e in range(num_experts):
        mine = [i for i, x in enumerate(flat) if x == e]
        run = mine + [len(flat)] * (-len(mine) % block or (block if not mine else 0))
        pairs += run
        expert += [e] * (len(run) // block)
    size = -(-(len(flat) + num_experts * (block - 1)) // block) * block
    return (pairs + [len(flat)] * (size - len(pairs)))[:size], (expert + [-1] * (size // block))[:size // block]


def experts_unweighted(x, weights, ids, w13, w2):
    """Adds the k experts' outputs as they are, without their routing weights."""
    return experts_reference(x, torch.ones_like(weights), ids, w13, w2)


def halves_swapped(x, weights, ids, w13, w2):
    """Takes up as the first half of w13 and gate as the second: silu(up) * gate."""
    inter = w13.shape[1] // 2
    return experts_reference(x, weights, ids, torch.cat([w13[:, inter:], w13[:, :inter]], dim=1), w2)


def weighted_before_the_expert(x, weights, ids, w13, w2):
    """Scales the token by its weight before the expert: the SwiGLU is not linear, so the result differs."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            gate, up = F.linear(x[t] * weights[t, j], w13[e]).chunk(2)
            out[t] += F.linear(F.silu(gate) * up, w2[e])
    return out


def ranks_take_experts_in_turn(ids, num_experts, rank, size):
    """Deals the experts out in turn (expert e on rank e % size), not in consecutive shares."""
    return [i for i, e in enumerate(ids.flatten().tolist()) if e % size == rank]


def ranks_drop_the_remainder(ids, num_experts, rank, size):
    """Gives each rank num_experts // size experts: the last num_experts % size belong to no rank."""
    share = num_experts // size
    return [i for i, e in enumerate(ids.flatten().tolist()) if rank * share <= e < (rank + 1) * share]


def ranks_list_tokens_not_pairs(ids, num_experts, rank, size):
    """Returns the tokens (t) whose experts the rank holds, not the pairs (t * k + j)."""
    return [i // ids.shape[1] for i in testing._rank_pairs_ref(ids, num_experts, rank, size)]


# (the check, the wrong answer)
MUTANTS = [
    (testing.check_route_tokens, softmax_over_the_top_k_only),
    (testing.check_route_tokens, never_renormalized),
    (testing.check_route_tokens, weights_from_the_logits),
    (testing.check_align_pairs, pairs_by_token_not_expert),
    (testing.check_align_pairs, padded_once_at_the_end),
    (testing.check_align_pairs, empty_experts_get_a_block),
    (testing.check_experts_forward, experts_unweighted),
    (testing.check_experts_forward, halves_swapped),
    (testing.check_experts_forward, weighted_before_the_expert),
    (testing.check_rank_pairs, ranks_take_experts_in_turn),
    (testing.check_rank_pairs, ranks_drop_the_remainder),
    (testing.check_rank_pairs, ranks_list_tokens_not_pairs),
]
