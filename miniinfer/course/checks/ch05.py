"""The checks of problem set 05 (paged attention): each answer against the reference, on random inputs.

Hand-written module (chapter 05)."""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch

from miniinfer.course.checks.harness import (
    check,
    check_tokens,
    device,
    exercise,
    named,
    randint,
    random_block_size,
    show,
    your_answers,
)
from miniinfer.course.checks.speed import kernel_ratio, needs_gpu, speed_item


def _merge_partials_ref(o1, lse1, o2, lse2):
    lse = torch.logaddexp(lse1, lse2)
    return o1 * (lse1 - lse).exp()[..., None] + o2 * (lse2 - lse).exp()[..., None], lse


def _random_partial(gen: torch.Generator, R: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A normalized partial output [R, D] and its log-sum-exp [R]; some rows empty (-inf, zeros)."""
    o, lse = torch.randn(R, D, generator=gen), torch.randn(R, generator=gen) * 4
    empty = torch.rand(R, generator=gen) < 0.2
    return o.masked_fill(empty[:, None], 0.0), lse.masked_fill(empty, float("-inf"))


@exercise("05", 1, "merge_partials")
def check_merge_partials(fn: Callable) -> None:
    """fn(o1 [R, D], lse1 [R], o2, lse2) -> (o, lse): two partial softmax results over disjoint keys
    merged into one (lse: natural-log log-sum-exp, -inf for an empty part)."""
    def inputs(gen, case):
        R, D = randint(gen, 1, 9), randint(gen, 1, 70)
        (o1, l1), (o2, l2) = _random_partial(gen, R, D), _random_partial(gen, R, D)
        both = l1.isinf() & l2.isinf()  # at least one part of each row has keys
        return o1, l1, o2, l2.masked_fill(both, 0.5)
    check("merge_partials", fn, _merge_partials_ref, inputs)


def _decode_program_ref(q, k_cache, v_cache, table, start, end, scale):
    bs = k_cache.shape[1]
    pos = torch.arange(start, end)
    slots = torch.tensor(table)[pos // bs] * bs + pos % bs
    scores = (q @ k_cache.flatten(0, 1)[slots].T) * scale
    return scores.softmax(-1) @ v_cache.flatten(0, 1)[slots], scores.logsumexp(-1)


@exercise("05", 2, "decode_program")
def check_decode_program(fn: Callable) -> None:
    """fn(q [G, D], k_cache, v_cache [num_blocks, block_size, D], table: list[int], start, end,
    scale) -> (o [G, D], lse [G]): one program's piece, tokens start..end-1, read through the table.
    Every slot the piece must not read holds NaN, so reading one shows in the result. The last two
    cases have scores in the hundreds: a softmax without its maximum subtracted overflows there."""
    def inputs(gen, case):
        G, D, bs = randint(gen, 1, 5), randint(gen, 2, 40), random_block_size(gen, case, 7)
        length = randint(gen, 1, 90)
        n_blocks = -(-length // bs)
        num_blocks = n_blocks + randint(gen, 1, 6)
        table = torch.randperm(num_blocks, generator=gen)[:n_blocks].tolist()
        start = randint(gen, 0, length - 1)
        end = randint(gen, start + 1, length)
        caches = [torch.full((num_blocks, bs, D), float("nan")) for _ in range(2)]
        for c in caches:
            pos = torch.arange(start, end)
            c.flatten(0, 1)[torch.tensor(table)[pos // bs] * bs + pos % bs] = torch.randn(end - start, D, generator=gen)
        q = torch.randn(G, D, generator=gen) * (300 if case >= 6 else 1)  # scores of std 300: exp overflows
        return q, *caches, table, start, end, D ** -0.5
    check("decode program", fn, _decode_program_ref, inputs)


def _merge_splits_ref(part, lse):
    w = (lse - lse.max(-1, keepdim=True).values).exp()
    return (part * (w / w.sum(-1, keepdim=True))[..., None]).sum(-2)


@exercise("05", 3, "merge_kernel", argument="merge_splits")
def check_merge_splits(fn: Callable) -> None:
    """fn(part [R, S, D] float32, lse [R, S]) -> out [R, D]: S partial results per row (natural-log
    lse, -inf for an empty split; split 0 is never empty) merged."""
    def inputs(gen, case):
        R, S, D = randint(gen, 1, 6), randint(gen, 1, 9), randint(gen, 1, 70)
        part, lse = _random_partial(gen, R * S, D)
        lse = lse.view(R, S)
        lse[:, 0] = lse[:, 0].nan_to_num(neginf=1.0)
        return part.view(R, S, D), lse
    check("merge_splits", fn, _merge_splits_ref, inputs, cases=5, device=device())


@exercise("05", 4, "store_kv")
def check_store_kv(fn: Callable) -> None:
    """fn(k, v [N, Hk, D], k_cache, v_cache [num_blocks, block_size, Hk, D], slot_mapping [N]) writes
    in place (slot -1: written nowhere)."""
    from miniinfer.worker.kv_cache import store_kv_ref

    def caches_after(store):
        return lambda k, v, kc, vc, slots: (store(k, v, kc, vc, slots), kc, vc)[1:]

    def inputs(gen, case):
        nb, bs, Hk, D = randint(gen, 2, 9), random_block_size(gen, case), randint(gen, 1, 3), randint(gen, 1, 20)
        N = randint(gen, 1, nb * bs)
        slots = torch.randperm(nb * bs, generator=gen)[:N]
        slots[torch.rand(N, generator=gen) < 0.25] = -1
        return (torch.randn(N, Hk, D, generator=gen), torch.randn(N, Hk, D, generator=gen),
                torch.randn(nb, bs, Hk, D, generator=gen), torch.randn(nb, bs, Hk, D, generator=gen), slots)
    check("store_kv", caches_after(fn), caches_after(store_kv_ref), inputs)


PROMPTS = ["def add(a, b):\n", "class Stack:\n"]


@exercise("05", 5, "YourKernels")
def check_attention_kernels(kernels: type) -> None:
    """The last part: paged generation in blocks of 3 through the varlen backend on kernels() (an
    AttentionKernels whose store_kv and decode are the student's) gives the static cache's greedy
    tokens; on the GPU when there is one."""
    __tracebackhide__ = True
    import miniinfer as mi
    from miniinfer.worker.kv_cache import ATTENTION_KERNELS, VarlenKVCache
    model, tok = mi.load_model(device=device()), mi.load_tokenizer()
    prompts = [tok(text).input_ids for text in PROMPTS]
    params = mi.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ATTENTION_KERNELS["yours"] = kernels()
    try:
        with your_answers("05"):
            got = mi.generate_paged(model, prompts, params, block_size=3,
                                    backend=functools.partial(VarlenKVCache, kernels="yours"))
    finally:
        del ATTENTION_KERNELS["yours"]
    show(tok, [p + g for p, g in zip(prompts, got)])
    check_tokens(named(PROMPTS, "greedy, blocks of 3"),
                 [mi.generate_cached(model, p, params) for p in prompts], got)
    print(f"passed: the static cache's greedy tokens on {len(PROMPTS)} prompts through your kernels")


@speed_item("05", 3, "merge_kernel", argument="merge_splits")
def speed_merge_kernel(fn: Callable):
    """fn (exercise 3's launcher) merging 16 float32 partials of 128 values for 32,768 rows (a batch of
    1,024 sequences x 32 query heads, each split 16 ways) against the package's merge kernel, given
    its log-sum-exps in base 2 as the package's decode writes them: every partial read once."""
    if not torch.cuda.is_available():
        return needs_gpu("the merge kernel")
    import triton

    from miniinfer.kernels.attention import _merge_kernel
    R, S, D = 32768, 16, 128
    gen = torch.Generator("cuda").manual_seed(0)
    part, lse = torch.randn(R, S, D, generator=gen, device="cuda"), torch.randn(R, S, generator=gen, device="cuda") * 4
    lse2 = lse * math.log2(math.e)

    def package(part, lse):
        out = torch.empty(R, D, device="cuda")
        _merge_kernel[(R,)](part, lse2, out, S, HEAD_DIM=D, BLOCK_S=triton.next_power_of_2(S),
                            BLOCK_D=triton.next_power_of_2(D), PDL=False)
        return out
    return kernel_ratio("merge_splits on 32,768 rows x 16 splits x 128 float32", fn, package, (part, lse),
                        (part.numel() + lse.numel() + R * D) * 4, rtol=1e-4, atol=1e-5)
