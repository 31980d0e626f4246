"""The checks of problem set 15 (disaggregation): each answer against the reference, on random inputs.

Hand-written module (chapter 15)."""

from __future__ import annotations

import dataclasses
import random
from typing import Callable

import torch

from miniinfer.course.checks.harness import (
    LAST_PART_PROMPTS,
    blocks_back,
    check,
    check_tokens,
    exercise,
    named,
    randint,
    random_block_size,
    your_answers,
)


def _pools_and_table(gen, case):
    """Pools of random K/V [layers, blocks, block_size, heads, dim] (keys and values, or keys alone as
    chapter 14's), and a block table: distinct ids in no order."""
    layers, blocks, heads, dim = randint(gen, 1, 4), randint(gen, 4, 16), randint(gen, 1, 3), randint(gen, 1, 8)
    shape = (layers, blocks, random_block_size(gen, case), heads, dim)
    pools = tuple(torch.randn(shape, generator=gen) for _ in range(1 if case % 3 == 2 else 2))
    table = torch.randperm(blocks, generator=gen)[:randint(gen, 1, blocks)].tolist()
    return pools, table


def _gather_ref(pools, block_ids):
    return torch.stack([pool[:, block_ids] for pool in pools])


@exercise("15", 1, "gather_blocks")
def check_gather_blocks(fn: Callable) -> None:
    """fn(pools: a tuple of [layers, blocks, block_size, ...] tensors, block_ids: a block table) -> one
    tensor [pools, layers, len(block_ids), block_size, ...]: each pool's blocks in the table's order."""
    check("gather_blocks", lambda pools, ids: fn(pools, list(ids)), _gather_ref, _pools_and_table, cases=12)


def _scattered(fn: Callable) -> Callable:
    """fn run on copies of the pools: the pools after it, as the result."""
    def run(pools, block_ids, kv):
        pools = tuple(p.clone() for p in pools)
        fn(pools, list(block_ids), kv.clone())
        return pools
    return run


def _scatter_ref(pools, block_ids, kv):
    for pool, part in zip(pools, kv):
        pool[:, block_ids] = part


@exercise("15", 2, "scatter_blocks")
def check_scatter_blocks(fn: Callable) -> None:
    """fn(pools, block_ids, kv [pools, layers, len(block_ids), block_size, ...]) writes kv's i-th block
    of each pool into that pool's block block_ids[i], in place, and leaves every other block as it was."""
    def inputs(gen, case):
        pools, table = _pools_and_table(gen, case)
        return pools, table, torch.randn(_gather_ref(pools, table).shape, generator=gen)
    check("scatter_blocks", _scattered(fn), _scattered(_scatter_ref), inputs, cases=12)


def _transfer_ref(cfg: dict, num_tokens: int, block_size: int, itemsize: int, gbps: float,
                  latency_s: float) -> tuple[int, float]:
    import miniinfer as mi
    per_token = mi.read_config(cfg).cache_bytes_per_token(itemsize)
    nbytes = -(-num_tokens // block_size) * block_size * per_token
    return nbytes, latency_s + nbytes / (gbps * 1e9)


def _as_numbers(fn: Callable) -> Callable:
    def run(*args):
        nbytes, seconds = fn(*args)
        return torch.tensor(nbytes, dtype=torch.int64), torch.tensor(seconds, dtype=torch.float64)
    return run


@exercise("15", 3, "transfer_time")
def check_transfer_time(fn: Callable) -> None:
    """fn(cfg: a config.json dict, num_tokens, block_size, itemsize, gbps, latency_s) -> (bytes, seconds):
    the bytes a prompt of num_tokens tokens moves (whole blocks; every layer's key and value per KV head,
    or chapter 14's latent and rotary key) and the seconds it takes at gbps GB/s (10^9 bytes) after a
    fixed latency."""
    from miniinfer.course.checks.ch14 import _config

    def inputs(gen, case):
        return (_config(gen, case), randint(gen, 1, 20000), random_block_size(gen, case, 32), (1, 2, 4)[case % 3],
                float(randint(gen, 10, 900)), randint(gen, 0, 50) * 1e-6)
    check("transfer_time", _as_numbers(fn), _as_numbers(_transfer_ref), inputs, cases=18, rtol=1e-9, atol=0)


ACTIONS = ("decode", "abort decode", "client")


def _as_flags(fn: Callable) -> Callable:
    """fn's list of actions as one flag per action (their order does not matter)."""
    def run(max_tokens, finish_reason, aborted):
        actions = fn(int(max_tokens), (None, "length", "stop", "error", "abort")[int(finish_reason)], bool(aborted))
        unknown = [a for a in actions if a not in ACTIONS]
        if unknown:
            raise AssertionError(f"after_prefill: {unknown} are not actions; the actions are {list(ACTIONS)}")
        return torch.tensor([a in actions for a in ACTIONS])
    return run


@exercise("15", 4, "after_prefill")
def check_after_prefill(fn: Callable) -> None:
    """fn(max_tokens, finish_reason, aborted) -> the router's actions when the prefill engine answers for a
    request (its first token, or its end): "decode" when it ended by the prefill engine's cap (length)
    and the client asked for more; "abort decode" when that is so and the client has left; "client"
    unless the client has left."""
    from miniinfer.engine.disaggregated import after_prefill
    cases = [(m, f, a) for m in (1, 2, 9) for f in range(5) for a in (False, True)]
    check("after_prefill", _as_flags(fn), _as_flags(after_prefill),
          lambda gen, case: cases[case], cases=len(cases))


@exercise("15", 5, "your_pair")
def check_your_pair(gather: Callable, scatter: Callable, after: Callable) -> None:
    """The last part: a prefill engine (prefix caching, prompts in pieces of 6 tokens) and a decode engine
    (a pool small enough to preempt) of one process, over a LocalLink, with your gather_blocks,
    scatter_blocks and after_prefill, serve four requests (one ends with its first token) with one
    engine's tokens; every block back on both sides, every message received."""
    __tracebackhide__ = True
    import miniinfer as mi
    from miniinfer.distributed.kv_transfer import LocalLink
    from miniinfer.engine.disaggregated import DecodeEngine, PrefillEngine, serve_in_process
    base = mi.EngineConfig(block_size=4, num_blocks=24)
    prompts = LAST_PART_PROMPTS + [[7, 8, 9]]
    params = [mi.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 3 + \
        [mi.SamplingParams(temperature=0, max_tokens=1)]
    expected = [o.token_ids for o in mi.LLMEngine(base).generate(prompts, params, use_tqdm=False)]
    link = LocalLink()
    prefill = type("YourPrefill", (PrefillEngine,), {"gather": staticmethod(gather)})(dataclasses.replace(
        base, enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=6), link)
    decode = type("YourDecode", (DecodeEngine,), {"scatter": staticmethod(scatter)})(
        dataclasses.replace(base, num_blocks=12, max_num_seqs=3), link)
    for i, engine in enumerate((prefill, decode)):  # blocks handed out in no order, as by a pool long in use
        random.Random(i).shuffle(engine.block_manager.free_list)
    with your_answers("15"):
        got = serve_in_process(prefill, decode, prompts, params, after=after)
    check_tokens(named([str(p) for p in prompts], "through your pair"), expected, got)
    blocks_back(prefill.block_manager, "the prefill engine")
    blocks_back(decode.block_manager, "the decode engine")
    assert not link.messages, f"{len(link.messages)} K/V messages were sent and never received"
    print("passed: one engine's tokens through your pair of engines, every block back on both sides")
