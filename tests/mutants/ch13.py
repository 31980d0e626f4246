"""Wrong answers to problem set 13 that its checks must reject: each named (or documented) for its mistake."""

import torch

from miniinfer.course import checks as testing
from miniinfer.kernels.moe import _experts_kernel, align, fused_experts
from miniinfer.layers.moe import route
from miniinfer.layers.parallel import Shard


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


def softmax_in_the_logits_dtype(logits, top_k, renormalize):
    """The softmax in the model's half precision, cast to float32 only at the end: weights off by its rounding."""
    weights, ids = logits.softmax(dim=-1).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.float(), ids


def pairs_by_token_not_expert(ids, num_experts, block):
    """Skips the sort: the pairs in token order, each expert's run padded as if they were sorted."""
    pairs, expert = align(ids, num_experts, block)
    real = pairs < ids.numel()
    pairs[real] = pairs[real].sort().values
    return pairs, expert


def padded_once_at_the_end(ids, num_experts, block):
    """Pads all experts' runs together at the end instead of each to whole blocks: a block holds two experts."""
    flat = ids.flatten().clamp(max=num_experts)
    order = flat.argsort(stable=True)
    kept = order[flat[order] < num_experts]
    size = -(-(ids.numel() + num_experts * (block - 1)) // block) * block
    pairs = torch.full((size,), ids.numel(), dtype=torch.int32)
    pairs[:len(kept)] = kept.to(torch.int32)
    firsts = flat[kept].tolist()
    expert = [firsts[b * block] if b * block < len(firsts) else -1 for b in range(size // block)]
    return pairs.to(ids.device), torch.tensor(expert, dtype=torch.int32, device=ids.device)


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
    pairs, expert = (pairs + [len(flat)] * size)[:size], (expert + [-1] * size)[:size // block]
    return (torch.tensor(pairs, dtype=torch.int32, device=ids.device),
            torch.tensor(expert, dtype=torch.int32, device=ids.device))


def skipped_pairs_run_on_the_last_expert(ids, num_experts, block):
    """Clamps an id of num_experts or more to the last expert instead of skipping its pair."""
    return align(ids.clamp(max=num_experts - 1), num_experts, block)


TILES = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64)


def halves_swapped(x, weights, ids, w13, w2, first=0):
    """Takes up as the first half of w13 and gate as the second: silu(up) * gate."""
    inter = w13.shape[1] // 2
    return fused_experts(x, weights, ids, torch.cat([w13[:, inter:], w13[:, :inter]], dim=1), w2, first, TILES)


def experts_unweighted(x, weights, ids, w13, w2, first=0):
    """Adds the k experts' outputs as they are, without their routing weights."""
    return fused_experts(x, torch.ones_like(weights), ids, w13, w2, first, TILES)


def others_experts_not_skipped(x, weights, ids, w13, w2, first=0):
    """Ignores `first`: a rank takes the ids as its own, running its experts 0.. for the first ranks' pairs."""
    return fused_experts(x, weights, ids, w13, w2, 0, TILES)


def result_in_float32(x, weights, ids, w13, w2, first=0):
    """Upcasts in the launcher and returns the float32 result: the engine's next layer expects x's dtype."""
    return fused_experts(x.float(), weights, ids, w13.float(), w2.float(), first, TILES)


class KernelWithHalvesSwapped:
    """experts_kernel as a student's with gate's and up's rows taken in the wrong order (it launches the
    package's kernel on w13's halves swapped): `kernel[grid](...)` as a Triton kernel is called."""

    def __getitem__(self, grid):
        def launch(a, w, out, pairs, expert, weights, num_pairs, N, K, DIV, GATED, PRECISION, **tiles):
            if GATED:
                w = torch.cat([w[:, N:], w[:, :N]], dim=1)
            _experts_kernel[grid](a, w, out, pairs, expert, weights, num_pairs, N, K, a.stride(0), DIV=DIV,
                                  GATED=GATED, PRECISION=PRECISION, **tiles)
        return launch


class SharesDropTheRemainder(Shard):
    """Gives each rank n // size experts: the last n % size belong to no rank."""

    def experts(self, n):
        share = n // self.size
        return range(self.rank * share, (self.rank + 1) * share)


class RemainderToTheLastRank(Shard):
    """Gives each rank n // size experts and the last rank the rest as well: shares of 2, 2 and 4 of 8."""

    def experts(self, n):
        share = n // self.size
        return range(self.rank * share, n if self.rank == self.size - 1 else (self.rank + 1) * share)


class SharesRoundedUp(Shard):
    """Gives each rank ceil(n / size) experts, the last rank what is left: 4 and 3 of 7, not 3 and 4."""

    def experts(self, n):
        share = -(-n // self.size)
        return range(min(n, self.rank * share), min(n, (self.rank + 1) * share))


class SharesAsAList(Shard):
    """Returns the right experts as a list: the engine reads the share's start (`first`) from a range."""

    def experts(self, n):
        return list(Shard.experts(self, n))


# (the check, the wrong answer)
MUTANTS = [
    (testing.check_route_tokens, softmax_over_the_top_k_only),
    (testing.check_route_tokens, never_renormalized),
    (testing.check_route_tokens, weights_from_the_logits),
    (testing.check_route_tokens, softmax_in_the_logits_dtype),
    (testing.check_align_pairs, pairs_by_token_not_expert),
    (testing.check_align_pairs, padded_once_at_the_end),
    (testing.check_align_pairs, empty_experts_get_a_block),
    (testing.check_align_pairs, skipped_pairs_run_on_the_last_expert),
    (testing.check_experts, halves_swapped),
    (testing.check_experts, experts_unweighted),
    (testing.check_experts, others_experts_not_skipped),
    (testing.check_experts, result_in_float32),
    (testing.check_shard_experts, SharesDropTheRemainder),
    (testing.check_shard_experts, RemainderToTheLastRank),
    (testing.check_shard_experts, SharesRoundedUp),
    (testing.check_shard_experts, SharesAsAList),
]
