"""The harness of the exercise checks: the registry, the answer's context and the comparison on random inputs.

Hand-written module. Each `check_*` (in `chNN.py`, one module per problem set) is the check of one
exercise, registered in EXERCISES under an id that the notebooks' cells carry in their metadata, so a
grader finds it by id. It runs the answer on randomly drawn inputs of odd shapes, prints one line
starting with `passed:` when everything matches, and otherwise raises:
- AssertionError: a wrong result, naming the case, its inputs and what differs;
- AnswerError: the student's code raised, naming the case and its inputs (the original error is its cause);
- NotAnswered: the exercise still raises its NotImplementedError.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NoReturn

import torch

from miniinfer.model.transformer import rope_cos_sin, rope_inv_freq

Inputs = Callable[[torch.Generator, int], tuple]  # (generator, case number) -> the arguments


class NotAnswered(NotImplementedError):
    """An exercise that still raises the NotImplementedError it was handed out with."""


class AnswerError(Exception):
    """The student's code raised an exception (its __cause__) on a case the check names."""


@dataclass(frozen=True)
class Exercise:
    id: str          # "01.rms_norm": chapter + the answer's name; stored in the notebook cells' metadata
    chapter: str     # "01"
    number: int      # as the problem set's heading says ("Exercise 1")
    answer: str      # what the student writes (a function, kernel or class)
    argument: str    # what the check cell passes to the check (the answer, or the wrapper that launches it)
    check: Callable
    speed: bool = False  # a speed item (speed.py): the answer timed against the package's
    full: float | None = None  # a speed item's ratio for full marks

    @property
    def label(self) -> str:
        return f"exercise {self.number} ({self.answer}){', its speed' if self.speed else ''}"


EXERCISES: dict[str, Exercise] = {}


def problem_set(chapter: str) -> list[Exercise]:
    """The exercises of one chapter's problem set, in order (an exercise's speed item after it)."""
    return sorted((e for e in EXERCISES.values() if e.chapter == chapter), key=lambda e: (e.number, e.speed))


def last_part(chapter: str) -> Exercise:
    """The problem set's last part: its last exercise, whose check runs the model or the engine on
    the student's pieces."""
    return [e for e in problem_set(chapter) if not e.speed][-1]


def unanswered(err: BaseException | None) -> bool:
    """Whether err is (or was caused by) an exercise's `raise NotImplementedError()`. A compiled Triton
    kernel cannot raise: its compiler's error only names the statement."""
    while err is not None:
        if isinstance(err, NotImplementedError) or "NotImplementedError" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def verdict(err: BaseException, cause: BaseException | None = None) -> NoReturn:
    """Raise a check's failure afresh, without the checker's frames: IPython shows the student's cell,
    this one frame (it never hides the frame an error is raised in) and the message."""
    err.__cause__, err.__suppress_context__ = cause, True
    raise err


def judged(label: str, check_fn: Callable) -> Callable:
    """check_fn, failing as a student should see it: AssertionError (a wrong result), NotAnswered or
    AnswerError (their code raised: their error attached), raised without the checker's frames."""
    @functools.wraps(check_fn)
    def run(*args, **kwargs):
        __tracebackhide__ = True  # IPython shows the student the message, not the checker's frames
        try:
            return check_fn(*args, **kwargs)
        except (AssertionError, NotAnswered) as err:  # NotAnswered: a last part names the exercise
            verdict(type(err)(*err.args))
        except AnswerError as err:
            verdict(AnswerError(*err.args), cause=err.__cause__)
        except Exception as err:
            if unanswered(err):
                verdict(NotAnswered(f"{label} is not answered yet: write your code where it says "
                                    "# YOUR CODE HERE and delete the `raise NotImplementedError()`"))
            verdict(AnswerError(f"{label}: your code raised {type(err).__name__}: {err}"), cause=err)
    return run


def exercise(chapter: str, number: int, answer: str, argument: str | None = None):
    """Register a check as the check of exercise `number` of chapter's problem set."""
    def register(check_fn: Callable) -> Callable:
        run = judged(f"exercise {number} ({answer})", check_fn)
        ex = Exercise(f"{chapter}.{answer}", chapter, number, answer, argument or answer, run)
        EXERCISES[ex.id] = ex
        return run
    return register


@contextlib.contextmanager
def your_answers(chapter: str) -> Iterator[None]:
    """Run a problem set's last part, which calls the student's answers: an unanswered one it reaches
    fails naming its exercise (found by the function the NotImplementedError was raised in)."""
    __tracebackhide__ = True
    try:
        yield
    except Exception as err:
        if not unanswered(err):
            raise
        names = {e.answer: e for e in problem_set(chapter) if not e.speed}
        for e in problem_set(chapter):  # a launcher the check is handed (a kernel's) names its exercise too
            for name in e.argument.replace("()", "").split(", "):
                names.setdefault(name, e)
        cause: BaseException = err
        while (inner := cause.__cause__ or cause.__context__) is not None:  # the NotImplementedError itself
            cause = inner
        tb, hit = cause.__traceback__, None
        while tb is not None:
            code = tb.tb_frame.f_code
            hit = names.get(code.co_name) or names.get(code.co_qualname.split(".")[0]) or hit
            tb = tb.tb_next
        # An answer that raised in another process (chapter 11's ranks) is named in the error's text.
        hit = hit or next((e for name, e in names.items() if name in str(err)), None)
        which = hit.label if hit else "an exercise of this problem set"
        raise NotAnswered(f"{which} is not answered yet: finish it (and run its check) before this part") from None


# The inputs of the last case a check failed on, for the student to call their answer on again.
last_failure: dict = {}
SHOWN_CHARS = 300  # of a non-tensor input's repr in a message; the whole is in last_failure


def _describe(args: tuple) -> str:
    def one(a) -> str:
        if isinstance(a, torch.Tensor):
            return f"tensor {tuple(a.shape)} {str(a.dtype).removeprefix('torch.')}"
        text = repr(a)
        return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"
    return ", ".join(map(one, args))


def failing(where: str, args: tuple) -> str:
    """The failed case named, its inputs kept in last_failure, and how to call the answer on them."""
    last_failure.clear()
    last_failure.update(case=where, inputs=args)
    return f"{where}\n  inputs: {_describe(args)}\n  (all of them: mi.course.checks.last_failure['inputs'])"


def run_answer(fn: Callable, args, where: str, inputs: tuple | None = None):
    """fn(*args), with an exception from the student's code reported with the case it failed on
    (and, given the case's inputs, with them: `failing`)."""
    __tracebackhide__ = True
    try:
        return fn(*args)
    except Exception as err:
        if unanswered(err):
            raise
        case = where if inputs is None else failing(where, inputs)
        raise AnswerError(f"{case}\n  your code raised {type(err).__name__}: {err}") from err


def tokens_differ(expected: list[int], got: list[int]) -> str | None:
    """Where two token lists first differ, and eight tokens of each from there (None: equal)."""
    if got == expected:
        return None
    at = next((j for j, (x, y) in enumerate(zip(got, expected)) if x != y), min(len(got), len(expected)))
    return (f"the tokens differ from token {at + 1} of {len(expected)} on\n  expected {expected[at:at + 8]}\n"
            f"  received {got[at:at + 8]}")


def check_tokens(requests: list[str], expected: list[list[int]], got: list[list[int]]) -> None:
    """AssertionError naming the first request (requests: each one's description) whose tokens differ."""
    __tracebackhide__ = True
    for request, e, g in zip(requests, expected, got):
        if (wrong := tokens_differ(e, g)) is not None:
            raise AssertionError(f"{request}: {wrong}")


def named(prompts: list[str], how: str) -> list[str]:
    """Each prompt's description in a token comparison: its number, its text and how it was run."""
    return [f"prompt {i + 1} of {len(prompts)} ({text!r}), {how}" for i, text in enumerate(prompts)]


def blocks_back(bm, which: str) -> None:
    """AssertionError unless every block of block manager bm is free again after `which` (a workload)."""
    __tracebackhide__ = True
    free, total = bm.num_free_blocks, bm.num_blocks
    if free != total:
        raise AssertionError(f"{which}: {total - free} of {total} blocks were not given back (blocks no one "
                             "frees are lost to every later request)")


def engine_with(config, model=None, tok=None, **pieces):
    """The engine of config with some of its components replaced by the student's (runner=...,
    parallel=...); model None: the one config names."""
    import dataclasses

    from miniinfer.engine.llm_engine import LLMEngine
    from miniinfer.worker.components import build_components
    components = dataclasses.replace(build_components(config), **pieces)
    return LLMEngine(config, model=model, tokenizer=tok, components=components)


def show(tok, texts: list[list[int]]) -> None:
    """Print each token list as the text it decodes to, one per line."""
    for ids in texts:
        print(repr(tok.decode(ids)))


# Half-precision answers may round differently from the reference by an ulp or two.
TOLERANCES = {torch.float16: (4e-3, 1e-4), torch.bfloat16: (3e-2, 1e-3)}  # (rtol, atol)


def check(name: str, fn: Callable, ref: Callable, inputs: Inputs, cases: int = 8,
          rtol: float = 1e-4, atol: float = 1e-5, seed: int = 0, device: str = "cpu",
          tolerances: dict | None = None) -> None:
    """Compare fn(*args) with ref(*args) for `cases` random draws of inputs(generator, case), drawn
    on the CPU and handed to fn on `device` (the reference runs on the CPU); each result must be on
    that device. tolerances: (rtol, atol) by dtype, over TOLERANCES' for half precision."""
    __tracebackhide__ = True
    gen = torch.Generator().manual_seed(seed)
    allowed = {**TOLERANCES, **(tolerances or {})}
    for case in range(cases):
        args = inputs(gen, case)
        where = f"{name}, case {case + 1} of {cases}"
        # Each side gets its own copy, so that a function that writes in place is checked too.
        fresh = lambda dev, args=args: [a.clone().to(dev) if isinstance(a, torch.Tensor) else a for a in args]  # noqa: E731
        expected = ref(*fresh("cpu"))
        got = run_answer(fn, fresh(device), where, args)
        if isinstance(expected, torch.Tensor):
            expected, got = (expected,), (got,) if isinstance(got, torch.Tensor) else got
        if not isinstance(got, (tuple, list)) or len(got) != len(expected):
            raise AssertionError(f"{failing(where, args)}\n  expected {len(expected)} tensor(s), received "
                                 f"{type(got).__name__}")
        for i, (e, g) in enumerate(zip(expected, got)):
            at = where + (f", output {i + 1} of {len(expected)}" if len(expected) > 1 else "")
            wrong: str | None
            if not isinstance(g, torch.Tensor):
                wrong = f"  expected a tensor, received {type(g).__name__}"
            elif g.shape != e.shape:
                wrong = shape_differs(e, g)
            elif g.dtype != e.dtype:
                wrong = f"  expected dtype {e.dtype}, received {g.dtype}"
            elif g.device.type != torch.device(device).type:
                wrong = f"  expected a tensor on {device} (where the inputs are), received one on {g.device}"
            else:
                wrong = differs(g.cpu(), e, *allowed.get(e.dtype, (rtol, atol)))
            if wrong is not None:  # only a failed case's inputs are kept (last_failure)
                raise AssertionError(f"{failing(at, args)}\n{wrong}")
    print(f"passed: {name} matches the reference on {cases} random inputs")


SHOWN_VALUES = 16  # a result this small is shown whole in a message
SHOWN_LIST = 64  # a list answer (1-D integers) of a wrong length this long is shown whole


def shape_differs(expected: torch.Tensor, got: torch.Tensor) -> str:
    """What differs between results of different shapes: a list answer by its length and values, any
    other by its shape."""
    listed = expected.dim() == got.dim() == 1 and not expected.is_floating_point()
    if listed and max(len(expected), len(got)) <= SHOWN_LIST:
        return (f"  expected {len(expected)} values, received {len(got)}\n  expected {expected.tolist()}\n"
                f"  received {got.tolist()}")
    return f"  expected shape {tuple(expected.shape)}, received {tuple(got.shape)}"


def differs(got: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> str | None:
    """None if got matches expected (exactly for integers and booleans; within rtol and atol for
    floats, NaN and infinities where the reference has them), else what differs: both whole when
    small, else the count and the first place they differ, with torch's summary for floats."""
    exact = not (expected.is_floating_point() or expected.is_complex())
    close = got == expected if exact else torch.isclose(got, expected, rtol=rtol, atol=atol, equal_nan=True)
    if bool(close.all()):
        return None
    if expected.numel() <= SHOWN_VALUES:
        return f"  values differ:\n  expected {expected.tolist()}\n  received {got.tolist()}"
    first = tuple(int(i) for i in (~close).nonzero()[0])
    text = (f"  {int((~close).sum())} of {expected.numel()} values differ; the first at index {list(first)}: "
            f"expected {expected[first].item()}, received {got[first].item()}")
    if not exact:
        wrong = ~close & expected.isfinite()
        broken = int((wrong & ~got.isfinite()).sum())
        error = (got.double() - expected.double()).abs()[wrong & got.isfinite()]
        if error.numel():
            text += f"\n  largest difference {error.max().item():.4g} (allowed: {atol:g} + {rtol:g} x |expected|)"
        if broken:
            text += f"\n  {broken} received values are NaN or infinite where the reference's are finite"
    return text


def randint(gen: torch.Generator, lo: int, hi: int) -> int:
    return int(torch.randint(lo, hi + 1, (1,), generator=gen))


def random_block_size(gen: torch.Generator, case: int, hi: int = 6) -> int:
    """Block sizes 1 and 3 first (where off-by-ones show), then random ones."""
    return (1, 3)[case] if case < 2 else randint(gen, 1, hi)


DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def rope_inputs(gen: torch.Generator, case: int, dtypes=(torch.float32,), batch: bool = False) -> tuple:
    T, Hk, D = randint(gen, 1, 40), randint(gen, 1, 4), 2 * randint(gen, 1, 40)
    Hq = Hk * randint(gen, 1, 3)
    dtype = dtypes[case % len(dtypes)]
    lead = (randint(gen, 1, 3),) if batch and case % 2 else ()  # the model's [B, T, ...] as well
    cos, sin = rope_cos_sin(torch.randint(0, 4096, (*lead, T), generator=gen), rope_inv_freq(D, 10000.0))
    return (torch.randn(*lead, T, Hq, D, generator=gen).to(dtype),
            torch.randn(*lead, T, Hk, D, generator=gen).to(dtype), cos, sin)


def device() -> str:
    """Where the problem sets' Triton kernels run: the GPU when there is one, else Triton's interpreter."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def as_tensor(fn: Callable) -> Callable:
    """fn with its list arguments copied and its int or list result as a tensor, for `check`."""
    def run(*args):
        result = fn(*[list(a) if isinstance(a, list) else a for a in args])
        return tuple(torch.tensor(r, dtype=torch.int64) for r in result) if isinstance(result, tuple) \
            else torch.tensor(result, dtype=torch.int64)
    return run


@functools.cache
def saved_checkpoint(name: str, make: Callable) -> str:
    """make()'s transformers model (random weights, seed 0) saved once to a folder that every later
    process reuses (named by `name`, make's source and the torch and transformers versions, so a changed
    model or library saves anew): a folder a process made for itself would outlive a killed kernel."""
    import hashlib
    import inspect
    import os
    import shutil
    import tempfile
    from pathlib import Path

    import transformers
    from transformers.utils import logging as hf_logging
    made = inspect.getsource(getattr(make, "func", make)) + repr(getattr(make, "args", ()))
    key = hashlib.sha256(f"{made}{torch.__version__}{transformers.__version__}".encode()).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / "miniinfer-checkpoints" / f"{name}-{key}"
    if folder.is_dir():
        return str(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent)
    torch.manual_seed(0)
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # its bar is a widget in a notebook's output
    try:
        make().save_pretrained(staging)
        os.rename(staging, folder)  # whole or absent: another process may be saving the same one
    except OSError:
        if not folder.is_dir():
            raise
    finally:
        if shown:
            hf_logging.enable_progress_bar()
        shutil.rmtree(staging, ignore_errors=True)
    return str(folder)


LAST_PART_PROMPTS = [[5, 17, 99, 3, 250], [42] * 9, list(range(100, 120))]


def serve_through(chapter: str, folder: str, install: Callable, through: str, **yours) -> tuple[list[list[int]], Any]:
    """A last part on a checkpoint: install(model) puts the student's pieces into an engine's model as it
    is built (before a CUDA graph holds the package's code), which then serves three requests (blocks of
    4, prompts in pieces of a 6-token budget, the pool small enough to preempt) with the package
    engine's tokens, every block back. yours: settings of the student's engine alone (their kernels').
    Returns the package engine's tokens and the student's engine."""
    __tracebackhide__ = True
    import dataclasses

    import miniinfer as mi
    config = mi.EngineConfig(model=folder, device=device(), block_size=4, num_blocks=12, max_num_seqs=3,
                             max_num_batched_tokens=6, enable_chunked_prefill=True)
    params = mi.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = LAST_PART_PROMPTS
    expected = [o.token_ids for o in mi.LLMEngine(config).generate(prompts, params, use_tqdm=False)]
    with your_answers(chapter):
        engine = engine_with(dataclasses.replace(config, **yours), install=install)
        got = [o.token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
    check_tokens(named([str(p) for p in prompts], through), expected, got)
    blocks_back(engine.block_manager, "three requests")
    print(f"passed: the package engine's tokens {through}, every block back")
    return expected, engine
