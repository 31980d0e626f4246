"""The checks of problem set 16 (scaling out): each answer against the reference, on random inputs or the
same calls made on the package's class, and the last part: replicas in processes of their own behind a
router on the student's pieces.

Hand-written module (chapter 16)."""

from __future__ import annotations

import dataclasses
import random
import unittest.mock
from typing import Any, Callable

import torch

from miniinfer.course.checks.harness import (
    AnswerError,
    as_tensor,
    check,
    check_tokens,
    exercise,
    failing,
    randint,
    run_answer,
    your_answers,
)


def _loads(gen: torch.Generator, case: int) -> tuple:
    """(matched, loads, n, balance) for 1-6 replicas: ties in both lists often, loads near the bound."""
    r = randint(gen, 1, 6)
    top = 3 if case % 2 else 12
    matched = [randint(gen, 0, top) for _ in range(r)]
    loads = [randint(gen, 0, top) for _ in range(r)]
    return matched, loads, randint(gen, 0, 50), randint(gen, 0, 8)


@exercise("16", 1, "cache_aware")
def check_cache_aware(fn: Callable) -> None:
    """fn(matched, loads, n, balance) -> the replica whose cache holds the most of the prompt (the least
    loaded, then the lowest number, among equals); the least loaded (then the lowest number) once the
    loads differ by more than balance."""
    from miniinfer.engine.data_parallel import cache_aware
    check("cache_aware", as_tensor(fn), as_tensor(cache_aware), _loads, cases=64)


@exercise("16", 2, "YourGuess")
def check_cache_guess(cls: type) -> None:
    """cls(block_size, capacity): add(keys) remembers a prompt's block hashes, the newest `capacity` of all
    it was given (one given again is new again); matched(keys) -> how many of a prompt's blocks, from the
    first, it holds. Random prompts over a few shared heads, each asked about and then added, against
    the package's CacheGuess."""
    from miniinfer.engine.data_parallel import CacheGuess
    for case in range(24):
        rng = random.Random(case)
        block_size, capacity = rng.choice([1, 2, 3, 4]), rng.randint(1, 12)
        heads = [[rng.randrange(50) for _ in range(rng.randint(0, 10))] for _ in range(3)]
        ref = CacheGuess(block_size, capacity)
        yours = run_answer(lambda b, c: cls(b, c), (block_size, capacity), f"case {case}: YourGuess(...)")
        for i in range(12):
            prompt = rng.choice(heads) + [rng.randrange(50) for _ in range(rng.randint(0, 6))]
            keys = ref.keys(prompt)
            where = f"case {case} (block_size {block_size}, capacity {capacity}), prompt {i + 1}"
            got = run_answer(yours.matched, (list(keys),), f"{where}: matched(keys)")
            if got != ref.matched(keys):
                raise AssertionError(f"{where}: matched(keys of {prompt})\n  expected {ref.matched(keys)} of its "
                                     f"{len(keys)} blocks\n  received {got!r}")
            run_answer(yours.add, (list(keys),), f"{where}: add(keys)")
            ref.add(keys)
    print("passed: YourGuess matches the package's CacheGuess on 24 random sequences of 12 prompts")


def _plans() -> list[tuple[dict, int]]:
    """EngineConfig fields and the GPUs the machine has."""
    return [(dict(device="cpu", data_parallel_size=3), 0), (dict(device="cuda", data_parallel_size=2), 2),
            (dict(device="cuda", data_parallel_size=2), 8), (dict(device="cuda", data_parallel_size=4), 1),
            (dict(device="cuda", data_parallel_size=3, gpu_memory_utilization=0.6), 2),
            (dict(device="cuda:1", data_parallel_size=2), 2), (dict(device="cuda", data_parallel_size=1), 1),
            (dict(device="cuda", data_parallel_size=2, tensor_parallel_size=2), 4)]


@exercise("16", 3, "replica_configs")
def check_replica_configs(fn: Callable) -> None:
    """fn(config) -> each replica's EngineConfig, on machines of 0, 1, 2, 4 and 8 GPUs (torch.cuda.device_count
    replaced while it runs): a GPU each where there are enough, one shared with (r + 1) / R of
    gpu_memory_utilization otherwise, ValueError with tensor parallelism on GPUs."""
    import miniinfer as mi
    from miniinfer.engine.data_parallel import replica_configs
    for fields, gpus in _plans():
        config = mi.EngineConfig(**fields)
        shown = ", ".join(f"{k}={v!r}" for k, v in fields.items())
        where = f"replica_configs(EngineConfig({shown})) on {gpus} GPUs"
        with unittest.mock.patch.object(torch.cuda, "device_count", lambda gpus=gpus: gpus):
            try:
                expected = replica_configs(config)
            except ValueError:
                try:
                    got = fn(config)
                except ValueError:
                    continue
                raise AssertionError(f"{where}\n  expected ValueError (each replica's ranks would take the same "
                                     f"GPUs)\n  received {_show(got)}") from None
            got = run_answer(fn, (config,), where)
        if list(got) != expected:
            raise AssertionError(f"{where}\n  expected {_show(expected)}\n  received {_show(got)}")
    print(f"passed: replica_configs places replicas as the package does on {len(_plans())} machines")


def _show(configs) -> str:
    if not isinstance(configs, list) or not all(dataclasses.is_dataclass(c) for c in configs):
        return repr(configs)
    return repr([(c.device, c.data_parallel_size, round(c.gpu_memory_utilization, 4)) for c in configs]) + \
        " as (device, data_parallel_size, gpu_memory_utilization)"


def _chats(n: int, turns: int) -> list[list[list[int]]]:
    rng = random.Random(16)
    return [[[rng.randrange(10, 4000) for _ in range(rng.randint(8, 24))] for _ in range(turns)] for _ in range(n)]


def _serve_chats(engine: Any, conversations, params) -> tuple[list[list[int]], float]:
    """The conversations' turns in waves: every conversation's next turn sent at once (every other wave in
    reverse order, so that placing by load alone sends each elsewhere), the next wave when all are
    answered. Every answer's tokens, and the prompt tokens found cached over those sent."""
    history: list[list[int]] = [[] for _ in conversations]
    answers, sent, cached = [], 0, 0
    for t in range(len(conversations[0])):
        order = list(range(len(conversations)))[::-1 if t % 2 else 1]
        prompts = [history[c] + conversations[c][t] for c in order]
        for c, prompt, out in zip(order, prompts, engine.generate(prompts, params, use_tqdm=False)):
            if out.error:  # the router's or a replica's: an answer that raised names itself in it
                raise AnswerError(f"conversation {c + 1}, turn {t + 1} failed: {out.error}")
            answers.append(((c, t), list(out.token_ids)))
            sent, cached = sent + len(prompt), cached + out.num_cached_tokens
            history[c] = prompt + out.token_ids
    return [a for _, a in sorted(answers)], cached / sent


@exercise("16", 4, "your_replicas", "cache_aware, YourGuess, replica_configs")
def check_your_replicas(rule: Callable, guess: type, plan: Callable) -> None:
    """The last part: two replicas of the course model, each a process, placed by your replica_configs,
    behind a router with your rule (and the package's bound) and your guess of their caches. A chat
    workload (12 conversations of 3 turns, each turn of all of them sent at once) must get one engine's
    greedy answers and find as many cache hits as one engine; then 24 requests over one shared head, sent
    at once, must keep the loads within the bound; every block comes back."""
    __tracebackhide__ = True
    import miniinfer as mi
    from miniinfer.engine.data_parallel import BALANCE, ReplicaRouter
    from miniinfer.engine.disaggregated import ClientEngine
    config = mi.EngineConfig(num_blocks=512, block_size=4, max_num_seqs=8, enable_prefix_caching=True)
    params = mi.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    work = _chats(12, 3)
    want, want_rate = _serve_chats(mi.LLMEngine(config), work, params)
    router_class = type("YourRouter", (ReplicaRouter,), {"guess_class": guess, "plan": staticmethod(plan)})
    replicas = dataclasses.replace(config, data_parallel_size=2)

    def policy(matched, loads, n):
        return rule(matched, loads, n, BALANCE)
    with your_answers("16"):
        try:
            engine: Any = ClientEngine(replicas, lambda receive: router_class(replicas, receive, policy))
        except Exception as err:  # a replica that could not start: its process's error
            raise AnswerError(failing("two replicas from your replica_configs", (replicas,)) +
                              f"\n  starting them raised {type(err).__name__}: {err}") from err
        try:
            got, rate = _serve_chats(engine, work, params)
            check_tokens([f"conversation {c + 1}, turn {t + 1}" for c in range(12) for t in range(3)], want, got)
            # Each turn's history is on one replica alone, and every pool holds every history: each turn
            # placed where its history is finds what one engine finds.
            if rate < want_rate - 0.005:
                raise AssertionError(f"through your rule and your guess, two replicas found {rate:.3f} of the prompt "
                                     f"tokens cached\n  expected one engine's {want_rate:.3f} (each turn sent to the "
                                     "replica that holds its conversation's history)")
            head, router = list(range(100, 132)), engine.router
            router.widest = 0
            for i in range(24):
                engine.add_request(head + [200 + i], params)
            while engine.has_unfinished_requests():
                failed = [o.error for o in engine.step() if o.error]
                if failed:
                    raise AnswerError(f"a request over the shared head failed: {failed[0]}")
            widest = router.widest
            if widest > BALANCE + 1:
                raise AssertionError(f"24 requests over one head, sent at once: the loads differed by {widest} "
                                     f"requests\n  expected at most {BALANCE + 1} (the bound, then one more)")
            used = {r: s.blocks_used for r, s in router.stats.items()}
            if any(used.values()):
                raise AssertionError(f"after every request: blocks still held by each replica {used}\n  expected none")
        finally:
            engine.close()
    print("passed: two replicas through your pieces give one engine's answers, find as many cache hits and keep "
          "their loads within the bound; every block back")
