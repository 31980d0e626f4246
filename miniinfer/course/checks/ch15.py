"""The checks of problem set 15 (disaggregation): each answer against the reference, on random inputs or
the same scenario run on the package's class, and the last part: a pair of engines on the student's
pieces, in one process and then in two processes over gloo.

Hand-written module (chapter 15)."""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Callable

import torch

from miniinfer.course.checks.harness import (
    DTYPES,
    LAST_PART_PROMPTS,
    AnswerError,
    blocks_back,
    check,
    check_tokens,
    device,
    exercise,
    named,
    randint,
    random_block_size,
    run_answer,
    your_answers,
)


def _pools_and_table(gen, case):
    """Pools of random K/V [layers, blocks, block_size, heads, dim] (keys and values, or keys alone as
    chapter 14's), and a block table: distinct ids in no order."""
    layers, blocks, heads, dim = randint(gen, 1, 4), randint(gen, 4, 16), randint(gen, 1, 3), randint(gen, 1, 8)
    shape = (layers, blocks, random_block_size(gen, case), heads, dim)
    dtype = DTYPES[case // 3 % 3]  # the pool's dtype: a copy must keep it
    pools = tuple(torch.randn(shape, generator=gen).to(dtype) for _ in range(1 if case % 3 == 2 else 2))
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
        return pools, table, torch.randn(_gather_ref(pools, table).shape, generator=gen).to(pools[0].dtype)
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


def _handoff_scenario(cls: type) -> list[tuple[str, dict]]:
    """Five requests admitted by a scheduler of class cls (blocks of 3 handed out in no order); four
    of them handed on. Then each finishes its own way, and the held ones are released: the state after
    each step (what is held, what is still to be handed on, the free blocks, the requests known)."""
    from miniinfer.core.block_manager import BlockManager
    from miniinfer.core.sampling_params import SamplingParams
    from miniinfer.core.sequence import Sequence
    bm = BlockManager(24, 3)
    random.Random(0).shuffle(bm.free_list)
    s = cls(bm, max_num_seqs=8, max_num_batched_tokens=64)
    seqs = [Sequence(str(i), list(range(5 + 2 * i)), SamplingParams(max_tokens=1), arrival=i) for i in range(5)]
    for seq in seqs:
        s.add(seq)
    s.handoff.update({"0", "1", "2", "4"})
    s.schedule()
    states = []

    def state(after: str) -> None:
        states.append((after, dict(held={rid: list(t) for rid, t in s.held.items()}, handoff=sorted(s.handoff),
                                   free=bm.num_free_blocks, requests=sorted(s.requests))))
    for seq, reason, told in ((seqs[0], "length", None), (seqs[1], "stop", None), (seqs[2], None, "abort"),
                              (seqs[3], "length", None), (seqs[4], "length", None)):
        seq.finish_reason = reason
        s.finish(seq, told)
        handed = ", handed on" if seq.request_id in "0124" else ""
        state(f"request {seq.request_id} finished ({told or reason}{handed})")
    for rid in ("4", "0"):
        s.release(rid)
        state(f"request {rid} released")
    return states


def _same_states(expected: list, got: list) -> None:
    """AssertionError at the first step whose state differs, naming the step and the part of the state."""
    __tracebackhide__ = True
    for (after, want), (_, have) in zip(expected, got):
        for key in want:
            if have[key] != want[key]:
                raise AssertionError(f"after {after}: {key}\n  expected {want[key]}\n  received {have[key]}")


@exercise("15", 4, "YourHandoff")
def check_handoff(cls: type) -> None:
    """cls: a Scheduler whose finish holds the blocks of a request handed on (in `handoff`) that ended by
    the prefill engine's cap (finish_reason "length", no reason given), as a fork of its table under
    ("held", request id) in `held`, and forgets it from `handoff` either way; release(request_id) frees
    the held blocks. Checked step by step against HandoffScheduler on the same scenario."""
    from miniinfer.engine.disaggregated import HandoffScheduler
    expected = _handoff_scenario(HandoffScheduler)
    _same_states(expected, run_answer(_handoff_scenario, (cls,), "YourHandoff on the scenario"))
    print(f"passed: YourHandoff holds and releases as HandoffScheduler over {len(expected)} steps")


# The decode engine's landing scenario: (request id, prompt tokens) in the order they were sent; blocks of 4
LANDINGS = (("a", 9), ("b", 6), ("c", 17), ("d", 3), ("e", 2))


def _land_scenario(cls: type) -> list[tuple[str, dict]]:
    """A decode engine of class cls (the course model, 7 blocks of 4 in no order, 2 requests at most)
    told of five requests whose K/V came in order; the second aborted before it lands. land once; then
    the first finishes and land again: the state after each (what runs, each one's table and whether
    its blocks hold its own K/V, what still waits, the free blocks)."""
    import miniinfer as mi
    from miniinfer.core.block_manager import blocks_needed
    from miniinfer.distributed.kv_transfer import LocalLink, empty_blocks, gather_blocks
    link = LocalLink()
    engine = cls(mi.EngineConfig(block_size=4, num_blocks=7, max_num_seqs=2), link)
    random.Random(1).shuffle(engine.block_manager.free_list)
    gen = torch.Generator().manual_seed(0)
    sent = {}
    params = mi.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for rid, n in LANDINGS:
        shape = empty_blocks(engine.pools, blocks_needed(n, 4)).shape
        sent[rid] = torch.randn(shape, generator=gen).to(engine.pools[0].dtype)
        link.send(sent[rid])
        engine.enqueue(list(range(10, 10 + n)) + [7], params, request_id=rid)
    engine.abort("b")
    s, states = engine.scheduler, []

    def state(after: str) -> None:
        running = {}
        for seq in s.running:
            table = list(engine.block_manager.tables[seq])
            mine = torch.equal(gather_blocks(engine.pools, table), sent[seq.request_id])
            running[seq.request_id] = dict(table=table, holds_its_kv=mine, status=seq.status.name,
                                           computed=seq.num_computed_tokens, known=seq.request_id in s.requests)
        states.append((after, dict(running=running, waiting=[a.seq.request_id for a in engine.arrivals],
                                   free=engine.block_manager.num_free_blocks)))
    run_answer(lambda: engine.land(False), (), "land(wait=False), the first time")
    state("the first land")
    s.finish(s.requests["a"], "length")
    run_answer(lambda: engine.land(False), (), "land(wait=False), after request a finished")
    state("request a finished and land again")
    return states


@exercise("15", 5, "YourDecode")
def check_land(cls: type) -> None:
    """cls: a DecodeEngine whose land(wait) takes the arrivals in order while they have room (blocks for
    their prompt, max_num_seqs), skipping an aborted one: blocks allocated, the K/V scattered into them,
    the request running as from a prefix-cache hit. Checked against DecodeEngine.land on one scenario."""
    from miniinfer.engine.disaggregated import DecodeEngine
    _same_states(_land_scenario(DecodeEngine), _land_scenario(cls))
    print("passed: your land admits, scatters and waits as DecodeEngine.land in both steps")


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


@exercise("15", 6, "after_prefill")
def check_after_prefill(fn: Callable) -> None:
    """fn(max_tokens, finish_reason, aborted) -> the router's actions when the prefill engine answers for a
    request (its first token, or its end): "decode" when it ended by the prefill engine's cap (length)
    and the client asked for more; "abort decode" when that is so and the client has left; "client"
    unless the client has left."""
    from miniinfer.engine.disaggregated import after_prefill
    cases = [(m, f, a) for m in (1, 2, 9) for f in range(5) for a in (False, True)]
    check("after_prefill", _as_flags(fn), _as_flags(after_prefill),
          lambda gen, case: cases[case], cases=len(cases))


class CountedLink:
    """A LocalLink that keeps the size of each message sent."""

    def __init__(self):
        from miniinfer.distributed.kv_transfer import LocalLink
        self.link, self.sizes = LocalLink(), []

    def __getattr__(self, name: str):
        return getattr(self.link, name)

    def send(self, kv: torch.Tensor):
        self.sizes.append(kv.nbytes)
        return self.link.send(kv)


@exercise("15", 7, "your_pair", "YourPrefill, YourDecode, after_prefill, transfer_time")
def check_your_pair(prefill_cls: type, decode_cls: type, after: Callable, transfer_time: Callable) -> None:
    """The last part: a prefill engine of prefill_cls (its scheduler holds and releases, its gather copies
    out; prefix caching, prompts in pieces of 6 tokens) and a decode engine of decode_cls (its land, its
    scatter; a pool small enough to preempt), routed by `after`, serve four requests (one ends with its
    first token) with one engine's tokens: first in this process over a LocalLink (blocks handed out in
    no order; every block back on both sides, every message received), then in two engine processes
    over gloo (DisaggregatedEngine), the classes and the rule sent to them by value. transfer_time must
    count the bytes of each message sent in this process."""
    __tracebackhide__ = True
    import miniinfer as mi
    from miniinfer.engine.disaggregated import DisaggregatedEngine, serve_in_process
    from miniinfer.model.loader import checkpoint_config
    base = mi.EngineConfig(device=device(), block_size=4, num_blocks=24)
    prefill_config = dataclasses.replace(base, enable_prefix_caching=True, enable_chunked_prefill=True,
                                         max_num_batched_tokens=6)
    decode_config = dataclasses.replace(base, num_blocks=12, max_num_seqs=3)
    prompts = LAST_PART_PROMPTS + [[7, 8, 9]]
    params = [mi.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 3 + \
        [mi.SamplingParams(temperature=0, max_tokens=1)]
    expected = [o.token_ids for o in mi.LLMEngine(base).generate(prompts, params, use_tqdm=False)]
    link = CountedLink()
    with your_answers("15"):
        prefill, decode = prefill_cls(prefill_config, link), decode_cls(decode_config, link)
        for i, engine in enumerate((prefill, decode)):  # blocks handed out in no order, as by a pool long in use
            random.Random(i).shuffle(engine.block_manager.free_list)
        got = serve_in_process(prefill, decode, prompts, params, after=after)
    check_tokens(named([str(p) for p in prompts], "through your pair, in one process"), expected, got)
    blocks_back(prefill.block_manager, "the prefill engine")
    blocks_back(decode.block_manager, "the decode engine")
    assert not link.messages, f"{len(link.messages)} K/V messages were sent and never received"
    cfg, itemsize = checkpoint_config(base.model)[1], prefill.pools[0].element_size()
    handed_on = [p for p, q in zip(prompts, params) if q.max_tokens > 1]
    counted = {len(p): run_answer(transfer_time, (cfg, len(p), base.block_size, itemsize, 100.0, 0.0),
                                  "transfer_time on the course model's config.json")[0] for p in handed_on}
    if sorted(counted.values()) != sorted(link.sizes):
        raise AssertionError(f"transfer_time(the course model's config.json, n tokens, blocks of {base.block_size}, "
                             f"{itemsize} bytes a number) for n in {list(counted)}: the link carried "
                             f"{sorted(link.sizes)} bytes, received {sorted(counted.values())}")
    print("passed: one engine's tokens through your pair in one process, every block back on both sides, "
          "each message the size transfer_time counts")
    if torch.cuda.is_available():  # each engine process on a GPU of its own
        if torch.cuda.device_count() < 2:
            print("needs two GPUs: the two processes' part runs each engine on a GPU of its own")
            return
        prefill_config, decode_config = (dataclasses.replace(c, device=f"cuda:{i}")
                                         for i, c in enumerate((prefill_config, decode_config)))
    with your_answers("15"):
        try:
            pair: Any = DisaggregatedEngine(prefill_config, decode_config, engines=(prefill_cls, decode_cls),
                                            rule=after)  # LLMEngine's generate, over its own step
        except Exception as err:  # an engine that failed to start: its error, from its process
            raise AnswerError(f"two engine processes of your classes did not start\n  {err}") from err
        try:
            outputs = pair.generate(prompts, params, use_tqdm=False)
        finally:
            pair.close()
    failed = [o for o in outputs if o.finish_reason == "error"]
    if failed:
        raise AnswerError(f"in two processes, request {failed[0].request_id} failed: {failed[0].error}")
    check_tokens(named([str(p) for p in prompts], "through your pair, in two processes over gloo"), expected,
                 [o.token_ids for o in outputs])
    print("passed: the same tokens from your pair in two engine processes over gloo")
