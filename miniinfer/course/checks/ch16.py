"""The checks of problem set 16 (scaling out): each answer against the reference, on random inputs or the
same calls made on the package's class, and the last part: replicas in processes of their own behind a
router on the student's pieces, then a pipeline of two stages planned and cut by them.

Hand-written module (chapter 16)."""

from __future__ import annotations

import dataclasses
import functools
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
    saved_checkpoint,
    your_answers,
)
from miniinfer.worker.model_runner import ModelRunner


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


def _stage_cost(costs: list[float], head: float, plan: list[range]) -> float:
    """What the costliest stage of a plan costs (the last one's head counted)."""
    return max(sum(costs[i] for i in p) + head * (k == len(plan) - 1) for k, p in enumerate(plan))


def _valid_plan(plan: Any, n: int, stages: int) -> str | None:
    """Why a returned plan is not `stages` runs of layers, in order, one at least each (None: it is)."""
    if not isinstance(plan, list) or not all(isinstance(p, range) and p.step == 1 for p in plan):
        return f"a list of ranges, one a stage; received {plan!r}"
    if len(plan) != stages:
        return f"{stages} ranges, one a stage; received {len(plan)}: {plan}"
    if [i for p in plan for i in p] != list(range(n)) or not all(plan):
        return f"the layers 0-{n - 1} in order, one at least a stage; received {plan}"
    return None


def _split_cases() -> list[tuple[list[float], float, int]]:
    """Random costs (few values: ties often) and heads from nothing to heavier than every layer together;
    then Llama-3.2-1B's (16 layers of 60.8 M parameters, a head of 262.7 M) over 2, 4 and 8 stages."""
    rng, cases = random.Random(16), []
    for _ in range(48):
        n = rng.randint(1, 10)
        cases.append(([float(rng.choice([1, 2, 3, 5, 8])) for _ in range(n)], float(rng.choice([0, 1, 4, 30])),
                      rng.randint(1, n)))
    return cases + [([60.821504e6] * 16, 262.670336e6, s) for s in (2, 4, 8)]


@exercise("16", 4, "split_layers")
def check_split_layers(fn: Callable) -> None:
    """fn(costs, head, stages) -> each stage's layers as a list of ranges: in order, one layer at least a
    stage, and the costliest stage (the last one's head counted) as cheap as the package's split makes it
    (a plan of the same cost is as good)."""
    from miniinfer.distributed.pipeline import split_layers
    cases = _split_cases()
    for i, (costs, head, stages) in enumerate(cases):
        where = f"case {i + 1}: split_layers(costs of {len(costs)} layers, head {head:g}, stages {stages})"
        got = run_answer(fn, (list(costs), head, stages), where, (costs, head, stages))
        if (wrong := _valid_plan(got, len(costs), stages)) is not None:
            raise AssertionError(failing(where, (costs, head, stages)) + f"\n  expected {wrong}")
        best = split_layers(costs, head, stages)
        if _stage_cost(costs, head, got) > _stage_cost(costs, head, best) * (1 + 1e-9):
            raise AssertionError(failing(where, (costs, head, stages)) +
                                 f"\n  expected a costliest stage of {_stage_cost(costs, head, best):g} (as {best})"
                                 f"\n  received {_stage_cost(costs, head, got):g} ({got})")
    print(f"passed: split_layers plans {len(cases)} pipelines as cheaply as the package's, Llama-3.2-1B's among them")


def _skeleton(tied: bool) -> Any:
    """A 4-layer model's skeleton on the meta device (no memory), its head tied to its embedding or not."""
    import miniinfer as mi
    with torch.device("meta"):
        return mi.Transformer(mi.ModelConfig.from_hf(dict(
            model_type="qwen3" if tied else "llama", vocab_size=301, hidden_size=32, intermediate_size=48,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=tied)))


@exercise("16", 5, "keep_stage")
def check_keep_stage(fn: Callable) -> None:
    """fn(model, layers, first, last) makes a model's skeleton one stage's: the tensors it still holds (its
    state_dict's names, which the loader reads) must be the package's, for every stage of pipelines of 1-4
    stages over a model of 4 layers, its head tied to its embedding (Qwen3's) or not (Llama's)."""
    from miniinfer.distributed.pipeline import keep_stage, split_layers
    cases = 0
    for tied in (False, True):
        for stages in (1, 2, 3, 4):
            plan = split_layers([1.0] * 4, 0.0, stages)
            for s, layers in enumerate(plan):
                first, last = s == 0, s == stages - 1
                ref, yours = _skeleton(tied), _skeleton(tied)
                keep_stage(ref, layers, first, last)
                where = (f"stage {s} of {stages} ({'tied' if tied else 'untied'} head): keep_stage(model, "
                         f"layers={layers}, first={first}, last={last})")
                run_answer(fn, (yours, layers, first, last), where)
                want, got = set(ref.state_dict()), set(yours.state_dict())
                if got != want:
                    raise AssertionError(f"{where}\n  the model still holds {sorted(got - want)[:4]} (should not)"
                                         f"\n  and no longer holds {sorted(want - got)[:4]} (should)")
                cases += 1
    print(f"passed: keep_stage leaves each of {cases} stages the package's tensors")


def _head_heavy():
    import transformers
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=3001, hidden_size=48, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, tie_word_embeddings=False, initializer_range=0.2))


def head_heavy_checkpoint() -> str:
    """A Llama of 4 layers whose LM head (3,001 x 48) weighs as much as nine of them: where the stages split
    matters."""
    return saved_checkpoint("head-heavy", _head_heavy)


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


@exercise("16", 6, "your_scale_out", "cache_aware, YourGuess, replica_configs, split_layers, keep_stage")
def check_your_scale_out(rule: Callable, guess: type, plan: Callable, split: Callable, keep: Callable) -> None:
    """The last part: two replicas of the course model, each a process, placed by your replica_configs,
    behind a router with your rule (and the package's bound) and your guess of their caches. A chat
    workload (12 conversations of 3 turns, each turn of all of them sent at once) must get one engine's
    greedy answers and find as many cache hits as one engine; then 24 requests over one shared head, sent
    at once, must keep the loads within the bound; every block comes back. Before them, a pipeline of two
    stages of a head-heavy model, planned by your split_layers and cut by your keep_stage: one engine's
    tokens, each stage holding what the package's cut of your plan holds, the plan as cheap as the package's."""
    __tracebackhide__ = True
    _your_pipeline(split, keep)  # the quicker: a broken piece of it shows first
    _your_replicas(rule, guess, plan)
    print("passed: two stages planned and cut by your pieces give one engine's tokens, each holding its own "
          "layers; two replicas through yours give one engine's answers, find as many cache hits and keep their "
          "loads within the bound; every block back")


def _your_replicas(rule: Callable, guess: type, plan: Callable) -> None:
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


class _Holding(ModelRunner):
    """The package's runner, asked by the check which tensors its rank holds."""

    def held(self) -> list[str]:
        return sorted(self.model.state_dict())


def _your_pipeline(split: Callable, keep: Callable) -> None:
    __tracebackhide__ = True
    import miniinfer as mi
    from miniinfer.distributed.pipeline import PipelineParts, compact_stage, keep_stage, layer_costs, split_layers
    from miniinfer.worker.components import build_components
    config = mi.EngineConfig(model=head_heavy_checkpoint(), num_blocks=256, block_size=4)
    staged = dataclasses.replace(config, pipeline_parallel_size=2)
    prompts = [[5, 17, 99, 3, 250], [42] * 9, list(range(100, 120)), list(range(700, 713))]
    params = mi.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [o.token_ids for o in mi.LLMEngine(config).generate(prompts, params, use_tqdm=False)]
    parts = PipelineParts(split=split, keep=keep)
    components = dataclasses.replace(build_components(staged), runner=_Holding, pipeline=parts)
    with your_answers("16"):
        try:
            engine: Any = mi.LLMEngine(staged, components=components)
        except Exception as err:
            raise AnswerError(failing("two stages planned by your split_layers and cut by your keep_stage", (staged,))
                              + f"\n  starting them raised {type(err).__name__}: {err}") from err
        try:
            got = [o.token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
            held = engine.executor._call("held")
            free = engine.block_manager.num_free_blocks
        finally:
            engine.close()
    check_tokens([f"prompt {i + 1} through two stages" for i in range(len(prompts))], want, got)
    if free != engine.block_manager.num_blocks:
        raise AssertionError(f"after every request: {free} of {engine.block_manager.num_blocks} blocks free")
    skeleton = functools.partial(_meta_model, config.model)
    costs, head = layer_costs(skeleton())
    counts = [len({n.split(".")[2] for n in names if n.startswith("model.layers.")}) for names in held]
    yours = [range(sum(counts[:s]), sum(counts[:s + 1])) for s in range(2)]
    for s, (layers, names) in enumerate(zip(yours, held)):
        model = skeleton()
        keep_stage(model, layers, s == 0, s == 1)
        compact_stage(model, layers)
        want_names = set(model.state_dict())
        if set(names) != want_names:
            raise AssertionError(f"through your keep_stage, stage {s} (layers {layers.start}-{layers.stop - 1}) held "
                                 f"{sorted(set(names) - want_names)[:4]} (should not) and not "
                                 f"{sorted(want_names - set(names))[:4]} (should)")
    best = split_layers(costs, head, 2)
    if _stage_cost(costs, head, yours) > _stage_cost(costs, head, best) * (1 + 1e-9):
        raise AssertionError(f"through your split_layers the stages held {counts} layers: the costliest reads "
                             f"{_stage_cost(costs, head, yours):,.0f} parameters\n  expected "
                             f"{_stage_cost(costs, head, best):,.0f} (as {[len(p) for p in best]} layers)")


def _meta_model(folder: str) -> Any:
    import miniinfer as mi
    from miniinfer.model.loader import checkpoint_config
    with torch.device("meta"):
        return mi.Transformer(mi.read_config(checkpoint_config(folder)[1]))
