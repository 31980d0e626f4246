"""The checks of problem set 13 (mixture of experts): each answer against the reference, on random inputs
in the dtypes the engine runs, and the last part: the engine through the student's pieces, in one
process and on two gloo ranks that each hold a share of the experts.

Hand-written module (chapter 13)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from miniinfer.course.checks.harness import (
    DTYPES,
    LAST_PART_PROMPTS,
    AnswerError,
    blocks_back,
    check,
    check_tokens,
    device,
    engine_with,
    exercise,
    named,
    randint,
    random_block_size,
    run_answer,
    saved_checkpoint,
    serve_through,
    your_answers,
)
from miniinfer.course.checks.speed import kernel_ratio, needs_gpu, speed_item


def _by_expert(route_fn: Callable) -> Callable:
    """route_fn's (weights, ids) with each token's k choices in expert order: any order is right."""
    def run(logits, top_k, renormalize):
        weights, ids = route_fn(logits, top_k, renormalize)
        order = ids.argsort(dim=-1)
        return weights.gather(-1, order), ids.gather(-1, order)
    return run


def _logits(gen, case):
    """Router logits [T, E] in float32, float16 or bfloat16, each token's E values at least 0.4 apart: a
    tie at the k-th place after rounding could go either way."""
    T, E = randint(gen, 1, 9), randint(gen, 2, 12)
    k = 1 if case == 0 else E if case == 1 else randint(gen, 1, E)
    spread = torch.stack([torch.randperm(E, generator=gen) for _ in range(T)]).float() * 0.6 - 0.3 * E
    return (spread + torch.rand(T, E, generator=gen) * 0.2).to(DTYPES[case % 3]), k, bool(case % 2)


@exercise("13", 1, "route_tokens")
def check_route_tokens(fn: Callable) -> None:
    """fn(logits [T, E] in any float dtype, top_k, renormalize) -> (weights [T, k] float32, ids [T, k]
    int64): each token's top_k experts by the softmax over all E computed in float32, their
    probabilities renormalized to sum to 1 if asked."""
    from miniinfer.layers.moe import route
    check("route_tokens", _by_expert(fn), _by_expert(route), _logits, cases=24, device=device())


def _align_inputs(gen, case):
    """ids [T, k] of distinct experts per token; every third case a rank's view, where the pairs of the
    experts it does not hold carry num_experts or more."""
    T, E = randint(gen, 1, 12), randint(gen, 1, 8)
    k = randint(gen, 1, E)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    if case % 3 == 2 and E > 1:
        held = randint(gen, 1, E - 1)
        local = ids - randint(gen, 0, E - held)
        ids, E = torch.where((local >= 0) & (local < held), local, held + randint(gen, 0, 2)), held
    return ids, E, random_block_size(gen, case, 5)


@exercise("13", 2, "align_pairs")
def check_align_pairs(fn: Callable) -> None:
    """fn(ids [T, k], num_experts, block) -> (pairs, expert), int32 tensors on ids' device: the pairs t * k + j
    sorted by expert (in pair order within one; an id of num_experts or more skipped), each expert's
    run padded with T * k to whole blocks, the rows rounded up to T * k + num_experts * (block - 1) and
    whole blocks; each block's expert, -1 past the last."""
    from miniinfer.kernels.moe import align
    check("align_pairs", fn, align, _align_inputs, cases=30, device=device())


# Triton 3.6's CPU interpreter multiplies bfloat16 blocks in tl.dot as their raw 16-bit patterns (numpy has no
# bfloat16): the kernel's check runs bfloat16 on a GPU only.
KERNEL_DTYPES = DTYPES if torch.cuda.is_available() else DTYPES[:2]


def _experts_inputs(gen, case):
    """x [T, H] in float32, float16 or (on a GPU) bfloat16, a routing of T tokens to k of E experts, and the stacked
    weights of the experts held: all E, or (every fourth case) a rank's share first .. first + held - 1."""
    from miniinfer.layers.moe import route
    T, E = (37, 3) if case == 0 else (randint(gen, 1, 9), randint(gen, 2, 8))  # case 0: two blocks of an expert
    H, inter, k = randint(gen, 3, 40), randint(gen, 2, 40), 2 if case == 0 else randint(gen, 1, E)
    weights, ids = route(torch.randn(T, E, generator=gen), k, bool(case % 2))
    held, first = E, 0
    if case % 4 == 3:
        held = randint(gen, 1, E - 1)
        first = randint(gen, 0, E - held)
    dtype = KERNEL_DTYPES[case % len(KERNEL_DTYPES)]
    return (torch.randn(T, H, generator=gen).to(dtype), weights, ids,
            (torch.randn(held, 2 * inter, H, generator=gen) / H ** 0.5).to(dtype),
            (torch.randn(held, H, inter, generator=gen) / inter ** 0.5).to(dtype), first)


def experts_rounded(x, weights, ids, w13, w2, first=0):
    """The experts' weighted sum in float32, rounded to x's dtype where the kernels store: each pair's
    silu(gate) * up, and each pair's weighted output before the sum over its token's k pairs."""
    T, k = ids.shape
    inter = w13.shape[1] // 2
    out = torch.zeros(T, k, x.shape[1])
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j]) - first
            if 0 <= e < w13.shape[0]:  # else another rank's expert: it adds nothing here
                h = w13[e].float() @ x[t].float()
                act = (F.silu(h[:inter]) * h[inter:]).to(x.dtype).float()
                out[t, j] = weights[t, j] * (w2[e].float() @ act)
    return out.to(x.dtype).sum(dim=1)


# A pair's output rounded once more or less than the reference's: an ulp of values about 1.
EXPERTS_TOLERANCES = {torch.float16: (5e-3, 5e-3), torch.bfloat16: (4e-2, 4e-2)}


@exercise("13", 3, "experts_kernel", argument="experts_forward")
def check_experts(fn: Callable) -> None:
    """fn(x [T, H], weights [T, k], ids [T, k], w13 [E', 2I, H], w2 [E', H, I], first) launching the
    kernel -> [T, H] in x's dtype on x's device: each token's sum over its pairs whose expert is one of
    first .. first + E' - 1 of weight x down(silu(gate(x)) * up(x)), gate the first I rows of w13."""
    check("experts_forward", fn, experts_rounded, _experts_inputs, cases=16, atol=1e-4, device=device(),
          tolerances=EXPERTS_TOLERANCES)


@speed_item("13", 3, "experts_kernel", argument="experts_forward")
def speed_experts(fn: Callable):
    """fn (exercise 3's launcher) on a prompt's step through Qwen3-30B-A3B's sparse layer: 256 tokens,
    each to 8 of 128 experts (hidden size 2,048, 768 channels an expert), in bfloat16, against the
    package's fused_experts with its tiles for that many pairs: every expert's weights read once."""
    if not torch.cuda.is_available():
        return needs_gpu("the experts' kernel")
    from miniinfer.kernels.moe import fused_experts, moe_config
    from miniinfer.layers.moe import route
    gen = torch.Generator("cuda").manual_seed(0)
    T, E, k, H, inter = 256, 128, 8, 2048, 768
    x = torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16)
    weights, ids = route(torch.randn(T, E, generator=gen, device="cuda"), k, True)
    w13 = (torch.randn(E, 2 * inter, H, generator=gen, device="cuda") / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, inter, generator=gen, device="cuda") / inter ** 0.5).to(torch.bfloat16)
    config = moe_config(T * k, E, x.device)
    # the weights once, the tokens in and out, each pair's activations written and read
    nbytes = (w13.numel() + w2.numel() + 2 * T * H + 2 * T * k * inter + T * k * H) * 2
    return kernel_ratio("experts_forward on 256 tokens of Qwen3-30B-A3B's layer", fn,
                        lambda x, w, i, a, b: fused_experts(x, w, i, a, b, config=config),
                        (x, weights, ids, w13, w2), nbytes)


@exercise("13", 4, "YourShard")
def check_shard_experts(cls: type) -> None:
    """cls(rank, size).experts(n) -> range: the experts rank holds of n under expert parallelism,
    consecutive shares rank * n // size up to (rank + 1) * n // size (n need not divide)."""
    from miniinfer.layers.parallel import Shard
    cases = [(r, s, n) for s in (1, 2, 3, 4, 8) for n in sorted({s, s + 1, 2 * s - 1, 7, 8, 60, 128}) if n >= s
             for r in range(s)]
    for rank, size, n in cases:
        expected = Shard(rank, size).experts(n)
        where = f"YourShard({rank}, {size}).experts({n})"
        got = run_answer(lambda r, s, n: cls(r, s).experts(n), (rank, size, n), where)
        if not isinstance(got, range) or got != expected:
            raise AssertionError(f"{where}\n  expected {expected}\n  received {got!r}")
    print(f"passed: YourShard.experts is right on {len(cases)} (rank, size, experts)")


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


@exercise("13", 5, "your_moe", "your_moe, YourShard")
def check_your_moe(your_moe: Callable, shard: type) -> None:
    """The last part: your_moe(model) sets each sparse layer's router to route_tokens and its experts to
    experts_forward (which runs align_pairs and the kernel). The engine serves three requests through
    them (blocks of 4, prompts in pieces, the pool small enough to preempt), in one process and then
    at tensor_parallel_size=2 with expert parallelism, each of two gloo ranks holding the experts `shard`
    (exercise 4's class) names: both give the package engine's tokens; every block back."""
    __tracebackhide__ = True
    import miniinfer as mi
    from miniinfer.layers.parallel import ParallelLayers
    folder = moe_checkpoint()
    expected, _ = serve_through("13", folder, your_moe, "through your router, align and experts")
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        print("needs two GPUs: the two ranks' part runs each rank's kernel on a GPU of its own (on a machine "
              "without CUDA, on two CPU processes in Triton's interpreter)")
        return
    config = mi.EngineConfig(model=folder, device=device(), block_size=4, num_blocks=12, max_num_seqs=3,
                             max_num_batched_tokens=6, enable_chunked_prefill=True, tensor_parallel_size=2,
                             enable_expert_parallel=True)
    params = mi.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with your_answers("13"):
        try:
            two = engine_with(config, parallel=ParallelLayers(shard=shard), install=your_moe)
            try:
                got = [o.token_ids for o in two.generate(LAST_PART_PROMPTS, params, use_tqdm=False)]
                check_tokens(named([str(p) for p in LAST_PART_PROMPTS], "two ranks, each with your share of the "
                                   "experts"), expected, got)
                blocks_back(two.block_manager, "three requests on two ranks")
            finally:
                two.close()
        except RuntimeError as err:  # a rank's error, with the function that raised it
            raise AnswerError(f"two ranks of your experts failed\n  {err}") from err
    print("passed: two ranks, each with your share of the experts, give the same tokens; every block back")
