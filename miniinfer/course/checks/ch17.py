"""The checks of problem set 17 (the decode step as one persistent kernel): the dependency rule and the
step's task list against the reference on random shapes, the gate/up instruction in a kernel of its own on
random sizes and dtypes, and the last part: schedules of the student's pieces proved for many programs,
then the persistent step run on them against the model's own forward (and, on a GPU, in the engine).

Hand-written module (chapter 17)."""

from __future__ import annotations

import dataclasses
import functools
import unittest.mock
from typing import Callable

import torch
import triton
import triton.language as tl

from miniinfer.course.checks.harness import (
    DTYPES,
    AnswerError,
    as_tensor,
    check,
    check_tokens,
    device,
    exercise,
    failing,
    randint,
    run_answer,
    your_answers,
)


def _shape(gen: torch.Generator, case: int):
    """A random shape: 1-4 layers, 1-4 query heads per KV head, odd widths, tiles from 32 to 1,024 weights."""
    from miniinfer.kernels.persistent import Shape
    kv = randint(gen, 1, 3)
    return Shape(layers=randint(gen, 1, 4), hidden=8 * randint(gen, 2, 12), heads=kv * (1 + case % 4), kv_heads=kv,
                 head_dim=2 * randint(gen, 2, 16), ffn=randint(gen, 8, 200), vocab=randint(gen, 5, 300),
                 tile=(32, 64, 256, 1024)[randint(gen, 0, 3)])


def _rule_inputs(gen: torch.Generator, case: int) -> tuple:
    """(op, layer, shape): every op in turn, layer 0 in the first twelve cases (where QKV waits for nothing)."""
    shape = _shape(gen, case)
    return case % 6, 0 if case < 12 else randint(gen, 0, shape.layers - 1), shape


@exercise("17", 1, "waits_for")
def check_waits_for(fn: Callable) -> None:
    """fn(op, layer, shape) -> (counter, count): the counter a task of op in layer waits on (layer x 5 + the
    op it waits for; -1 for none) and the count it waits for (every task of that op)."""
    from miniinfer.kernels.persistent import waits_for
    check("waits_for", as_tensor(fn), as_tensor(waits_for), _rule_inputs, cases=48)


def _listed(fn: Callable) -> Callable:
    """fn(shape, rule) with the package's rule, its tasks as rows of six numbers."""
    from miniinfer.kernels.persistent import waits_for

    def run(shape):
        return [dataclasses.astuple(t) for t in fn(shape, waits_for)]
    return run


@exercise("17", 2, "schedule")
def check_schedule_list(fn: Callable) -> None:
    """fn(shape, rule) -> every Task of the step in its order: per layer the tasks of QKV, attention, O,
    gate/up and down (shape.tasks(op) of each, index 0 up), each waiting as rule(op, layer, shape) says and
    counted in counter layer x 5 + op; then the LM head's, waiting as rule(LM, layers - 1, shape) says,
    counted nowhere (-1)."""
    from miniinfer.kernels.persistent import schedule
    check("schedule", as_tensor(_listed(fn)), as_tensor(_listed(schedule)),
          lambda gen, case: (_shape(gen, case),), cases=24)


def _deadlocked(gen: torch.Generator, case: int) -> list[list]:
    """Lists whose programs wait forever, three ways: each program's list reversed, a count one past the
    tasks that count there, two programs each waiting for what the other counts after its wait."""
    from miniinfer.kernels.persistent import Task, deal, schedule
    tasks, programs = schedule(_shape(gen, case)), randint(gen, 1, 9)
    if case % 3 == 0:
        return [prog[::-1] for prog in deal(tasks, programs) if len(prog) > 1] or [tasks[::-1]]
    if case % 3 == 1:
        k = randint(gen, 1, len(tasks) - 1)
        t = tasks[k]
        while t.wait < 0:
            k = randint(gen, 1, len(tasks) - 1)
            t = tasks[k]
        return deal(tasks[:k] + [Task(t.op, t.layer, t.index, t.wait, t.count + 1, t.signal)] + tasks[k + 1:], programs)
    return [[Task(0, 0, 0, 1, 1, 0), Task(0, 0, 1, -1, 0, 2)], [Task(1, 0, 0, 0, 1, 1)], [Task(2, 0, 0, 2, 1, -1)]]


def _runs_well(order, programs: list[list]) -> str | None:
    """Why order is not a way the programs may run (None: it is)."""
    try:
        pairs = [(int(p), t) for p, t in order]
    except (TypeError, ValueError):
        return "expected a list of (program, task) pairs"
    if len(pairs) != sum(map(len, programs)):
        return f"expected all {sum(map(len, programs))} tasks, received {len(pairs)}"
    counted: dict[int, int] = {}
    at = [0] * len(programs)
    for n, (p, t) in enumerate(pairs):
        if not 0 <= p < len(programs) or at[p] >= len(programs[p]) or programs[p][at[p]] != t:
            return f"entry {n}, {(p, t)}, is not program {p}'s next task"
        if t.wait >= 0 and counted.get(t.wait, 0) < t.count:
            return f"entry {n}, {(p, t)}, runs while counter {t.wait} has counted {counted.get(t.wait, 0)}"
        counted[t.signal] = counted.get(t.signal, 0) + 1
        at[p] += 1
    return None


def _played(fn: Callable, programs: list[list], where: str):
    """fn(programs): the order it returned, or the ScheduleError it raised (any other error is its own)."""
    from miniinfer.kernels.persistent import ScheduleError
    try:
        return run_answer(fn, (programs,), where, (programs,))
    except AnswerError as err:
        if isinstance(err.__cause__, ScheduleError):
            return err.__cause__
        raise


@exercise("17", 3, "run_programs")
def check_run_programs(fn: Callable) -> None:
    """fn(programs) -> the (program, task) pairs in an order the programs may run them (each program's tasks
    in its order, each task once its counter has counted its count, each counting one in its signal);
    ScheduleError when programs are left waiting forever."""
    __tracebackhide__ = True
    from miniinfer.kernels.persistent import ScheduleError, deal, schedule
    gen = torch.Generator().manual_seed(3)
    for case in range(24):
        programs = deal(schedule(_shape(gen, case)), randint(gen, 1, 40))
        where = f"case {case}: the package's lists for {len(programs)} programs, which finish"
        got = _played(fn, programs, where)
        why = (f"expected the tasks in an order they may run, received ScheduleError: {got}"
               if isinstance(got, ScheduleError) else _runs_well(got, programs))
        if why is not None:
            raise AssertionError(failing(where, (programs,)) + f"\n  {why}")
    for case in range(12):
        programs = _deadlocked(gen, case)
        where = f"case {case}: lists that wait forever"
        if not isinstance(got := _played(fn, programs, where), ScheduleError):
            raise AssertionError(failing(where, (programs,)) + f"\n  expected ScheduleError, received {got!r:.200}")
    print("passed: run_programs ran the package's lists for 24 random shapes in an order they may run, and refused "
          "12 lists that wait forever")


@triton.jit
def _gate_up_probe(mid, mnorm, wgu, act, eps, layer_ptr, D: tl.constexpr, F: tl.constexpr, R: tl.constexpr,
                   FN: tl.constexpr):
    FN(tl.program_id(0), tl.load(layer_ptr).to(tl.int64), mid, mnorm, wgu, act, eps, D, F, R)


def _launch_gate_up(fn: Callable) -> Callable:
    """fn (a @triton.jit instruction) run as the persistent kernel runs it: one program per task t."""
    def run(mid, mnorm, wgu, eps, layer, R):
        F, D = wgu.shape[1] // 2, wgu.shape[2]
        act = torch.zeros(F, device=mid.device)
        layer_t = torch.tensor([layer], dtype=torch.int32, device=mid.device)
        _gate_up_probe[(-(-F // R),)](mid, mnorm, wgu, act, eps, layer_t, D=D, F=F, R=R, FN=fn, num_warps=4)
        return act
    return run


def _gate_up_ref(mid, mnorm, wgu, eps, layer, R):
    F = wgu.shape[1] // 2
    x = mid.float() * torch.rsqrt(mid.float().pow(2).mean() + eps) * mnorm[layer].float()
    gate, up = wgu[layer, :F].float() @ x, wgu[layer, F:].float() @ x
    return torch.nn.functional.silu(gate) * up


def _gate_up_inputs(gen: torch.Generator, case: int) -> tuple:
    """mid [D] in float32 (the kernel's vectors are), the norms [L, D] and wgu [L, 2F, D] in float32, float16 or
    bfloat16; odd D and F, R from 1 to 8 rows a task."""
    L, D, F = randint(gen, 1, 3), randint(gen, 3, 70), randint(gen, 1, 60)
    dtype = DTYPES[case % 3]
    return (torch.randn(D, generator=gen), (1 + 0.2 * torch.randn(L, D, generator=gen)).to(dtype),
            (torch.randn(L, 2 * F, D, generator=gen) / D ** 0.5).to(dtype), 1e-5, randint(gen, 0, L - 1),
            (1, 2, 4, 8)[case % 4])


@exercise("17", 4, "gate_up")
def check_gate_up(fn: Callable) -> None:
    """fn(t, layer, mid, mnorm, wgu, act, eps, D, F, R), a @triton.jit function: the RMSNorm of mid [D] with
    mnorm's row `layer`, then rows t x R .. t x R + R - 1 (those below F) of gate (wgu[layer, :F]) and of up
    (wgu[layer, F:]), SiLU(gate) x up stored into act [F], all in float32."""
    check("gate_up", _launch_gate_up(fn), _gate_up_ref, _gate_up_inputs, cases=12, device=device())


def _your_class(waits_for: Callable, schedule: Callable, gate_up: Callable) -> type:
    from miniinfer.kernels.persistent import PersistentDecode
    return type("YourDecode", (PersistentDecode,), {"tasks_of": staticmethod(lambda shape: schedule(shape, waits_for)),
                                                    "gate_up": gate_up})


def _prove(waits_for: Callable, schedule: Callable) -> None:
    """Your schedule with your rule, dealt to 1, 7 and 132 programs, on the Llama-3.2-1B shape's first two
    layers and on random shapes: check_schedule (playing the lists with run_programs, yours in the last part)
    must prove each, and must refuse the list of one program reversed."""
    __tracebackhide__ = True
    from miniinfer.kernels.persistent import ScheduleError, Shape, check_schedule, deal
    gen = torch.Generator().manual_seed(17)
    shapes = [Shape(layers=2, hidden=2048, heads=32, kv_heads=8, head_dim=64, ffn=8192, vocab=128256, tile=131072)]
    shapes += [_shape(gen, case) for case in range(6)]
    for shape in shapes:
        tasks = run_answer(schedule, (shape, waits_for), f"your schedule of {shape}")
        for programs in (1, 7, 132):
            where = f"your schedule, rule and run_programs, dealt to {programs} programs"
            try:
                check_schedule(deal(tasks, programs), shape.layers)
            except ScheduleError as err:
                raise AssertionError(failing(where, (shape,)) + f"\n  {err}") from None
        try:  # the LM head first: it waits for tasks behind it
            check_schedule([tasks[::-1]], shape.layers)
        except ScheduleError:
            continue
        raise AssertionError(failing("your run_programs on your schedule reversed, on one program", (shape,)) +
                             "\n  expected ScheduleError, the proof passed")


def small_model(kind: str, hidden=72, ffn=100, vocab=300, heads=6, kv_heads=2, head_dim=12):
    """A two-layer model of the family (llama, qwen2: q/k/v biases, qwen3: q/k norms) with random weights and
    norms, on device(): by default six query heads of twelve dimensions over two KV heads."""
    import miniinfer as mi
    cfg = mi.ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_layers=2, num_heads=heads,
                         num_kv_heads=kv_heads, head_dim=head_dim, qkv_bias=kind == "qwen2", qk_norm=kind == "qwen3",
                         tie_word_embeddings=kind == "qwen3")
    torch.manual_seed(0)
    model = mi.Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.copy_(1 + 0.1 * torch.randn_like(p))
    return model.to(device()).eval()


@torch.no_grad()
def _your_steps(cls: type) -> None:
    """Three decode steps of a small Llama and Qwen3 through your class (one program on the interpreter; one
    per SM on a GPU), each against the model's own forward on the same paged pool."""
    __tracebackhide__ = True
    from miniinfer.worker.paged_cache import PagedKVCache
    dev, table, prompt, size = device(), [5, 2, 9, 7], [3, 17, 42, 8, 99, 120, 7], 3

    def ints(*v):
        return torch.tensor(v, dtype=torch.int32, device=dev)
    for kind in ("llama", "qwen3"):
        model = small_model(kind)
        cache = PagedKVCache(model.cfg, 16, size, device=dev)
        want = cache.run(model, [prompt], [table], [0])
        step = run_answer(functools.partial(cls, tile=512), (model, cache.k, cache.v, size),
                          f"the persistent step ({kind})")
        n = len(prompt)
        for i in range(3):
            token, slot = int(want[0].argmax()), table[n // size] * size + n % size
            got = run_answer(step.step, (ints(token), ints(n), ints(slot), ints(n + 1), ints(*table)),
                             f"decode step {i + 1} ({kind})").clone()
            want = cache.run(model, [[token]], [table], [n])
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
                raise AssertionError(f"a small {kind}, decode step {i + 1} through your pieces: logits off by up to "
                                     f"{(got - want).abs().max().item():.2e} from the model's own forward")
            n += 1


def _your_engine(cls: type) -> None:
    """On a GPU: the engine with decode_kernel="persistent" taking your class, one request's greedy tokens
    against the engine's graphs of many kernels."""
    __tracebackhide__ = True
    import miniinfer as mi
    from miniinfer.worker.cuda_graphs import SINGLE_STEPS
    params = mi.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = "def fibonacci(n):"
    outs = {}
    for kernel in ("graphs", "persistent"):
        with unittest.mock.patch.dict(SINGLE_STEPS, {"persistent": cls}):
            engine = mi.LLMEngine(mi.EngineConfig(device="cuda", num_blocks=64, max_num_seqs=4, decode_kernel=kernel))
            outs[kernel] = engine.generate([prompt], params, use_tqdm=False)[0].token_ids
    check_tokens(["the course model, one request, decode_kernel='persistent' with your pieces"], [outs["graphs"]],
                 [outs["persistent"]])


@exercise("17", 5, "your_persistent", "waits_for, schedule, run_programs, gate_up")
def check_your_persistent(waits_for: Callable, schedule: Callable, run_programs: Callable, gate_up: Callable) -> None:
    """The last part: your schedule with your rule proved for 1, 7 and 132 programs on several shapes, the
    lists played by your run_programs (as the persistent step plays them before each build); then the
    persistent step with your schedule and your gate/up instruction, three decode steps of a small Llama
    and Qwen3 against the model's own forward; on a GPU, the engine's batch-1 steps through it too."""
    __tracebackhide__ = True
    from miniinfer.kernels import persistent
    with your_answers("17"), unittest.mock.patch.object(persistent, "run_programs", run_programs):
        _prove(waits_for, schedule)
        cls = _your_class(waits_for, schedule, gate_up)
        _your_steps(cls)
        if torch.cuda.is_available():
            _your_engine(cls)
    print("passed: your schedules proved for 1, 7 and 132 programs; the persistent step on your pieces gives the "
          "model's logits" + (" and the engine's tokens" if torch.cuda.is_available() else ""))
