from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import datetime
import functools
import itertools
import os
import queue
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from miniinfer.core.block_manager import blocks_needed
from miniinfer.core.config import EngineConfig, Limits
from miniinfer.core.sampling_params import SamplingParams
from miniinfer.core.scheduler import Scheduler
from miniinfer.core.sequence import RequestOutput, Sequence, Status
from miniinfer.engine.async_engine import Tokens
from miniinfer.engine.core import (
    AbortRequest,
    AddRequest,
    EngineCommand,
    EngineInfo,
    EngineOutput,
    EngineStats,
    Shutdown,
)
from miniinfer.engine.core_client import EngineClient, MultiprocClient, Receive
from miniinfer.engine.llm_engine import LLMEngine, StepStats, check_request
from miniinfer.model.loader import load_tokenizer
from miniinfer.worker.model_runner import build_components

# What both engines must share for one's K/V blocks to mean the same in the other's pool.
SHARED = ("model", "dtype", "quantization", "kv_cache_dtype", "block_size")


@dataclass(frozen=True)
class DisaggregatedConfig:
    """A prefill engine and a decode engine, each in its own process on its own device."""
    prefill: EngineConfig
    decode: EngineConfig

    def __post_init__(self):
        """Checked before any process starts."""
        for role in ("prefill", "decode"):
            config = getattr(self, role)
            if not isinstance(config, EngineConfig):
                raise ValueError(f"{role} must be an EngineConfig, got {type(config).__name__}")
            if config.tensor_parallel_size > 1 or config.speculative_method is not None:
                raise ValueError(f"the {role} engine: a disaggregated pair moves one pool's blocks: "
                                 "tensor parallelism and speculation are not supported in it")
        for name in SHARED:
            p, d = getattr(self.prefill, name), getattr(self.decode, name)
            if name == "model":
                p, d = (Path(x).resolve() if x is not None else None for x in (p, d))
            if p != d:
                raise ValueError(f"the two engines' {name} differ ({p} and {d}): the decode engine could not "
                                 "read the prefill engine's blocks")
        devices = [torch.device(c.device) for c in (self.prefill, self.decode)]
        if devices[0].type != devices[1].type:
            raise ValueError(f"both engines on GPUs, or both on CPUs: got {devices[0]} and {devices[1]}")
        if devices[0].type == "cuda":
            index = [d.index or 0 for d in devices]
            if index[0] == index[1]:
                raise ValueError(f"each engine needs its own GPU: both are on cuda:{index[0]}")
            if max(index) >= torch.cuda.device_count():
                raise ValueError(f"no cuda:{max(index)}: this machine has {torch.cuda.device_count()} GPUs")

    @property
    def model(self) -> str | Path | None:
        return self.prefill.model

    @property
    def config(self) -> EngineConfig:
        """The config whose components check requests at the door (the two engines' are alike)."""
        return self.prefill

    def connect(self, receive: Receive) -> Router:
        return Router(self, receive)


def kv_pools(engine: LLMEngine) -> tuple[torch.Tensor, ...]:
    """The engine's K/V pools, each [layers, blocks, block_size, ...]: keys and values, or keys
    alone where they are also the values (chapter 14's latents)."""
    cache = engine.executor.runner.cache
    return (cache.k,) if cache.v is cache.k else (cache.k, cache.v)


def empty_blocks(pools: tuple[torch.Tensor, ...], num_blocks: int) -> torch.Tensor:
    """Room for gather_blocks' tensor of num_blocks blocks."""
    pool = pools[0]
    return torch.empty((len(pools), pool.shape[0], num_blocks) + tuple(pool.shape[2:]), dtype=pool.dtype,
                       device=pool.device)


def gather_blocks(pools: tuple[torch.Tensor, ...], block_ids: list[int]) -> torch.Tensor:
    """A request's blocks out of the pools, in table order, as one contiguous tensor
    [pools, layers, blocks, block_size, ...]: one message, whatever the blocks' places."""
    ids = torch.tensor(block_ids, device=pools[0].device)
    kv = empty_blocks(pools, len(block_ids))
    for pool, part in zip(pools, kv):
        torch.index_select(pool, 1, ids, out=part)  # straight into the message: one copy
    return kv


def scatter_blocks(pools: tuple[torch.Tensor, ...], block_ids: list[int], kv: torch.Tensor) -> None:
    """The inverse: kv's blocks into the pools' blocks block_ids (another engine's, other places)."""
    ids = torch.tensor(block_ids, device=pools[0].device)
    for pool, part in zip(pools, kv):
        pool.index_copy_(1, ids, part)


@dataclass(frozen=True)
class KVLink:
    """One end of the link between the prefill engine (rank 0) and the decode engine (rank 1):
    torch.distributed point-to-point, NCCL between GPUs, gloo between CPU processes. Messages are
    matched in the order they are sent: the router keeps the decode engine's receives in that order."""
    rank: int
    init_file: str
    timeout_s: float = 600.0

    def connect(self, device: str) -> None:
        device_ = torch.device(device)
        if device_.type == "cuda":
            torch.cuda.set_device(device_)
        dist.init_process_group("nccl" if device_.type == "cuda" else "gloo", init_method=f"file://{self.init_file}",
                                rank=self.rank, world_size=2, timeout=datetime.timedelta(seconds=self.timeout_s))
        # NCCL makes a pair's communicator at its first send and receive, and the first send would wait
        # for it there, inside a step, while the receiver waits for that step's output: make it now.
        hello = torch.zeros(1, device=device_)
        (self.send if self.rank == 0 else self.recv)(hello).wait()

    def send(self, kv: torch.Tensor) -> Any:
        return dist.isend(kv.view(torch.uint8), dst=1 - self.rank)  # as bytes: fp8 and bf16 alike

    def recv(self, kv: torch.Tensor) -> Any:
        return dist.irecv(kv.view(torch.uint8), src=1 - self.rank)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class HandoffScheduler(Scheduler):
    """The prefill engine's scheduler: a request handed on to the decode engine ends here after its
    first token, but its blocks are held (a fork of its table) until its K/V has been copied out."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.handoff: set[str] = set()  # requests that go on in the decode engine after their first token
        self.held: dict[str, list[int]] = {}  # request id -> its blocks, until copied out

    def finish(self, seq: Sequence, reason: str | None = None) -> None:
        rid = seq.request_id
        if rid in self.handoff:
            self.handoff.discard(rid)
            if reason is None and seq.finish_reason == "length":  # its first token; not a stop, abort or error
                self.held[rid] = self.block_manager.fork(seq, ("held", rid))
        super().finish(seq, reason)

    def release(self, request_id: str) -> None:
        self.block_manager.free(("held", request_id))
        del self.held[request_id]


class PrefillEngine(LLMEngine):
    """An LLMEngine that computes prompts and first tokens only. A request that asks for more ends
    with its first token ("length"), and its blocks go to the decode engine over the link, in the
    order of its outputs."""
    scheduler_class = HandoffScheduler
    scheduler: HandoffScheduler

    def __init__(self, config: EngineConfig, link: KVLink):
        link.connect(config.device)
        super().__init__(config)
        self.link, self.pools = link, kv_pools(self)
        self.sending: collections.deque[tuple[Any, torch.Tensor]] = collections.deque()  # (send, its tensor)
        self.dropped: list[RequestOutput] = []  # aborted since the last step: the router hears of them

    def enqueue(self, token_ids: list[int], params: SamplingParams, priority: int = 0,
                request_id: str | None = None, turn: int = 0) -> str:
        first = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        rid = super().enqueue(token_ids, first, priority, request_id, turn)
        if params.max_tokens > 1:
            self.scheduler.handoff.add(rid)
        return rid

    def abort(self, request_id: str) -> RequestOutput | None:
        out = super().abort(request_id)
        if out is not None:
            self.dropped.append(out)
        return out

    def has_unfinished_requests(self) -> bool:
        return super().has_unfinished_requests() or bool(self.dropped)  # one more step tells the router

    def step(self) -> list[RequestOutput]:
        outputs, self.dropped = self.dropped + super().step(), []
        for rid, table in list(self.scheduler.held.items()):  # in the order of the outputs
            kv = gather_blocks(self.pools, table)
            self.sending.append((self.link.send(kv), kv))
            # The copy is queued on the device before any later step's: the blocks can go back now.
            self.scheduler.release(rid)
        while self.sending and self.sending[0][0].is_completed():
            self.sending.popleft()
        return outputs

    def close(self) -> None:
        super().close()
        self.link.close()


@dataclass(eq=False)
class Arrival:
    """A request handed on by the prefill engine, its K/V on the way."""
    seq: Sequence
    kv: torch.Tensor
    receiving: Any  # the link's receive into kv
    dropped: bool = False  # aborted (or refused) before it landed: its K/V is received all the same


class DecodeEngine(LLMEngine):
    """An LLMEngine whose requests come with their prompt's K/V and their first token: it receives
    the blocks, puts them into blocks of its own, and goes on from the first token, as from a
    prefix found in its cache."""

    def __init__(self, config: EngineConfig, link: KVLink):
        link.connect(config.device)
        # Nothing may reorder the requests: their K/V come in the order they were sent.
        components = dataclasses.replace(build_components(config), prepares=())
        super().__init__(config, components=components)
        self.link, self.pools = link, kv_pools(self)
        self.arrivals: collections.deque[Arrival] = collections.deque()

    @property
    def requests(self) -> dict[str, Sequence]:
        landing = {a.seq.request_id: a.seq for a in self.arrivals if not a.dropped}
        return {**landing, **self.scheduler.requests}

    def enqueue(self, token_ids: list[int], params: SamplingParams, priority: int = 0,
                request_id: str | None = None, turn: int = 0) -> str:
        """token_ids: the prompt and the first token, which the prefill engine sampled; the prompt's
        K/V is the next message on the link."""
        prompt = list(token_ids[:-1])
        kv = empty_blocks(self.pools, blocks_needed(len(prompt), self.block_manager.block_size))
        arrival = next(self._arrivals)
        request_id = str(arrival) if request_id is None else request_id
        seed = params.seed if params.seed is not None else int(torch.randint(2 ** 31, ()))
        seq = Sequence(request_id, prompt, params, priority, arrival, seed, turn, output_token_ids=[token_ids[-1]],
                       num_computed_tokens=len(prompt), num_reported=1, logprobs=[None])
        landing = Arrival(seq, kv, self.link.recv(kv))  # first: a refusal below must still take the message
        duplicate = request_id in self.requests
        self.arrivals.append(landing)
        if duplicate or not isinstance(priority, int) or not isinstance(turn, int):
            landing.dropped = True
            raise ValueError(f"request id {request_id!r} is already in use" if duplicate else
                             f"priority and turn must be ints, got {priority!r} and {turn!r}")
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        for a in self.arrivals:
            if a.seq.request_id == request_id and not a.dropped:
                a.dropped = True
                a.seq.finish_reason = "abort"
                return RequestOutput.of(a.seq, self.detokenize)
        return super().abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return super().has_unfinished_requests() or bool(self.arrivals)

    def step(self) -> list[RequestOutput]:
        self.land(wait=not self.scheduler.has_unfinished())
        return super().step() if self.scheduler.has_unfinished() else []

    def land(self, wait: bool) -> None:
        """The arrivals whose K/V has come, in order, while the pool and max_num_seqs have room for
        them (as the scheduler admits): blocks allocated, K/V copied in, into the running queue.
        wait: with nothing else to do, wait for the first."""
        s, bm = self.scheduler, self.block_manager
        while self.arrivals:
            a = self.arrivals[0]
            if not (wait or a.receiving.is_completed()):
                return
            if not a.dropped:
                need = bm.blocks_for(a.seq.num_computed_tokens) + (s.watermark if s.running else 0)
                if len(s.running) >= s.max_num_seqs or need > bm.num_free_blocks:
                    return
            a.receiving.wait()  # on a GPU: the copy below waits for it, the host does not
            self.arrivals.popleft()
            if a.dropped:
                continue
            seq = a.seq
            scatter_blocks(self.pools, bm.allocate(seq, seq.num_computed_tokens), a.kv)
            seq.status, s.requests[seq.request_id] = Status.RUNNING, seq
            s.running.append(seq)  # the scheduler sorts its running queue by its policy
            wait = False

    def close(self) -> None:
        super().close()
        self.link.close()


@dataclass
class Route:
    """Where one request is: "prefill" until its first token, then "decode"."""
    add: AddRequest  # as the client sent it (its seed drawn, so that both engines sample alike)
    phase: str = "prefill"
    aborted: bool = False  # by the client, while in the prefill engine: it is dropped when that one answers
    num_cached_tokens: int = 0  # the prefill engine's prefix cache hit


class Router(EngineClient):
    """The front end's line to a prefill engine and a decode engine, each in its own process: a
    request goes to prefill; its first output is passed on, and the request, with its first
    token, to decode, which then receives its K/V from prefill; decode's outputs are passed on.
    One thread does all of it, from one queue of commands and outputs, in order."""

    def __init__(self, pair: DisaggregatedConfig, receive: Receive):
        self.pair, self.receive = pair, receive
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # (source, item): the only way in
        self.routes: dict[str, Route] = {}  # by the engines' request id
        self.live: dict[str, str] = {}  # the client's request id -> the engines' (a client may reuse an id)
        self.ids = itertools.count()
        self.failure: str | None = None
        fd, self.init_file = tempfile.mkstemp(prefix="miniinfer-pd-")
        os.close(fd)
        # Both start at once: each engine's link waits for the other's while it starts.
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            started = {role: pool.submit(MultiprocClient, getattr(pair, role), self._from(role),
                                         functools.partial(engine, link=KVLink(rank, self.init_file)), role)
                       for rank, (role, engine) in enumerate((("prefill", PrefillEngine), ("decode", DecodeEngine)))}
            try:
                self.prefill, self.decode = (started[role].result() for role in ("prefill", "decode"))
            except BaseException:
                for future in started.values():  # the one that started would wait for its peer forever
                    if future.done() and future.exception() is None:
                        future.result().process.kill()
                Path(self.init_file).unlink(missing_ok=True)
                raise
        p, d = self.prefill.info, self.decode.info
        self.stats = {"prefill": p.stats, "decode": d.stats}  # each engine's latest
        # A request must fit both: the prompt in prefill's pool, all of it in decode's.
        self.info = EngineInfo(Limits(p.limits.vocab_size, min(p.limits.max_model_len, d.limits.max_model_len),
                                      min(p.limits.num_blocks, d.limits.num_blocks), p.limits.block_size),
                               p.eos_token_ids, d.max_num_seqs, self._stats("prefill"))
        self.thread = threading.Thread(target=self._run, daemon=True, name="miniinfer-router")
        self.thread.start()

    def _from(self, role: str) -> Receive:
        return lambda outputs, stats: self.inbox.put((role, (outputs, stats)))

    def send(self, command: EngineCommand) -> None:
        self.inbox.put(("client", command))

    def is_alive(self) -> bool:
        return self.failure is None and self.thread.is_alive()

    def close(self) -> None:
        self.send(Shutdown())
        self.thread.join()
        for client in (self.prefill, self.decode):
            client.process.join(timeout=30)
            if client.process.is_alive():
                client.process.kill()
        Path(self.init_file).unlink(missing_ok=True)

    def _run(self) -> None:
        while True:
            source, item = self.inbox.get()
            if source == "client":
                if isinstance(item, Shutdown):
                    return self._shut_down()
                self._command(item)
            else:
                outputs, stats = item
                if outputs is None:
                    self._died(source)
                else:
                    self.stats[source] = stats
                    self._outputs(source, outputs)

    def _command(self, command: EngineCommand) -> None:
        if isinstance(command, AddRequest):
            if self.failure is not None:
                return self.receive([EngineOutput(command.request_id, [], "error", error=self.failure, fault="engine")],
                                    self._stats("prefill"))
            params = command.params
            if params.seed is None:  # drawn once, here: both engines sample this request alike
                params = dataclasses.replace(params, seed=int(torch.randint(2 ** 31, ())))
            rid = str(next(self.ids))
            self.routes[rid] = Route(dataclasses.replace(command, params=params))
            self.live[command.request_id] = rid
            self.prefill.send(dataclasses.replace(command, request_id=rid, params=params))
        elif isinstance(command, AbortRequest) and command.request_id in self.live:
            rid = self.live.pop(command.request_id)
            route = self.routes[rid]
            if route.phase == "prefill":  # the prefill engine answers: a handoff already under way must land
                route.aborted = True
                self.prefill.send(AbortRequest(rid))
            else:
                del self.routes[rid]
                self.decode.send(AbortRequest(rid))

    def _outputs(self, source: str, outputs: list[EngineOutput]) -> None:
        passed = []
        for o in outputs:
            route = self.routes.get(o.request_id)
            if route is None:  # aborted while in the decode engine
                continue
            add = route.add
            if source == "prefill":
                if o.finish_reason == "length" and add.params.max_tokens > 1:  # handed on
                    route.phase, route.num_cached_tokens = "decode", o.num_cached_tokens
                    decode = dataclasses.replace(add.params, prompt_logprobs=None)  # the prefill engine's answer
                    self.decode.send(AddRequest(o.request_id, add.prompt_token_ids + o.new_token_ids, decode, add.turn))
                    o = dataclasses.replace(o, finish_reason=None)
                    if route.aborted:
                        self.decode.send(AbortRequest(o.request_id))
                if route.aborted:
                    del self.routes[o.request_id]
                    continue
            if o.finish_reason is not None:
                del self.routes[o.request_id]
                if self.live.get(add.request_id) == o.request_id:
                    del self.live[add.request_id]
            passed.append(dataclasses.replace(o, request_id=add.request_id,
                                              num_cached_tokens=route.num_cached_tokens or o.num_cached_tokens))
        self.receive(passed, self._stats(source))

    def _stats(self, source: str) -> EngineStats:
        """Both engines' state, and what this message's steps (source's) did."""
        p, d = self.stats["prefill"], self.stats["decode"]
        return dataclasses.replace(self.stats[source], running=p.running + d.running, waiting=p.waiting + d.waiting,
                                   swapped=p.swapped + d.swapped, blocks_used=p.blocks_used + d.blocks_used,
                                   blocks_total=p.blocks_total + d.blocks_total)

    def _fail_all(self, error: str, fault: str) -> None:
        failed = [EngineOutput(route.add.request_id, [], "error" if fault == "engine" else "abort", error=error,
                               fault=fault) for route in self.routes.values() if not route.aborted]
        self.routes.clear()
        self.live.clear()
        self.receive(failed, self._stats("prefill"))

    def _died(self, source: str) -> None:
        if self.failure is not None:  # the other one, ended by us
            return
        process = getattr(self, source).process
        process.join(timeout=2)
        self.failure = f"the {source} engine ended (exit code {process.exitcode})"
        for client in (self.prefill, self.decode):
            client.process.kill()
        self._fail_all(self.failure, "engine")

    def _shut_down(self) -> None:
        for client in (self.prefill, self.decode) if self.failure is None else ():  # else both are gone
            client.send(Shutdown())
        self._fail_all("the engine was closed", "closed")


class DisaggregatedEngine:
    """LLMEngine's interface over a prefill engine and a decode engine in processes of their own
    (a Router): outputs come as the two engines' steps make them."""
    generate = LLMEngine.generate  # over check_request, enqueue, step, stats and abort, as LLMEngine's
    stream = LLMEngine.stream

    def __init__(self, prefill: EngineConfig, decode: EngineConfig):
        self.config = DisaggregatedConfig(prefill, decode)  # refused here, before any process starts
        self.checks = build_components(prefill).checks
        try:
            self.tokenizer = load_tokenizer(prefill.model)
        except (OSError, ValueError):  # a checkpoint without tokenizer files: token ids only
            self.tokenizer = None
        self.detokenize = self.tokenizer.decode if self.tokenizer is not None else None
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.router = Router(self.config, lambda outputs, stats: self.inbox.put((outputs, stats)))
        self.limits = self.router.info.limits
        self.tokens: dict[str, Tokens] = {}  # unfinished requests
        self.stats = StepStats({}, [], 0, 0.0)
        self._ids = itertools.count()

    def check_request(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        return check_request(prompt, params, self.tokenizer, self.limits, self.checks)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, priority: int = 0,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        return self.enqueue(self.check_request(prompt, params), params, priority, request_id)

    def enqueue(self, token_ids: list[int], params: SamplingParams, priority: int = 0,
                request_id: str | None = None, turn: int = 0) -> str:
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.tokens:
            raise ValueError(f"request id {request_id!r} is already in use")
        if priority:
            raise ValueError("a disaggregated pair serves first come, first served: priority must be 0")
        self.tokens[request_id] = Tokens(list(token_ids))
        self.router.send(AddRequest(request_id, list(token_ids), params, turn))
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        tokens = self.tokens.pop(request_id, None)
        if tokens is None:
            return None
        self.router.send(AbortRequest(request_id))
        return RequestOutput(request_id, tokens.prompt_token_ids, tokens.token_ids, [], "abort",
                             detokenize=self.detokenize)

    def has_unfinished_requests(self) -> bool:
        return bool(self.tokens)

    def step(self) -> list[RequestOutput]:
        """The outputs of the engines' next message (waiting for it, while requests are unfinished),
        and of any others already here."""
        if not self.tokens:
            return []
        batches = [self.inbox.get()]
        while not self.inbox.empty():
            batches.append(self.inbox.get())
        outputs, first, seconds = [], {}, 0.0
        for done, stats in batches:
            seconds += stats.step_seconds
            for o in done:
                tokens = self.tokens.get(o.request_id)
                if tokens is None:  # aborted meanwhile
                    continue
                if not tokens.token_ids:
                    first[o.request_id] = len(tokens.prompt_token_ids)
                out = tokens.add(o, self.detokenize)  # a failure's error says why (a dead engine: which)
                if out.finished:
                    del self.tokens[o.request_id]
                outputs.append(out)
        ran = {o.request_id: first.get(o.request_id, len(o.new_token_ids)) for o in outputs}
        self.stats = StepStats(ran, [], 0, seconds, kind="prefill" if first else "decode")
        return outputs

    def close(self) -> None:
        self.router.close()
