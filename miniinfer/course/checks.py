"""Checks that exercise notebooks call: a student's answer against the reference, on random inputs.

Hand-written module. Each `check_*` is the check of one exercise of one problem set (registered in
EXERCISES, whose ids the notebooks' cells carry in their metadata, so a grader finds them by id). It
runs the answer on randomly drawn inputs of odd shapes, prints one line starting with `passed:` when
everything matches, and otherwise raises:
- AssertionError: a wrong result, naming the case, its inputs and what differs;
- AnswerError: the student's code raised, naming the case and its inputs (the original error is its cause);
- NotAnswered: the exercise still raises its NotImplementedError.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from miniinfer.core.block_manager import BlockManager, OutOfBlocks
from miniinfer.core.sampling_params import top_p_filter
from miniinfer.course.static_cache import left_pad, static_batch_waste, write_kv
from miniinfer.model.transformer import apply_rope, causal_attention, rms_norm, rope_cos_sin, rope_inv_freq
from miniinfer.worker.paged_cache import gather_kv, slot_mapping

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

    @property
    def label(self) -> str:
        return f"exercise {self.number} ({self.answer})"


EXERCISES: dict[str, Exercise] = {}


def problem_set(chapter: str) -> list[Exercise]:
    """The exercises of one chapter's problem set, in order."""
    return sorted((e for e in EXERCISES.values() if e.chapter == chapter), key=lambda e: e.number)


def _unanswered(err: BaseException | None) -> bool:
    """Whether err is (or was caused by) an exercise's `raise NotImplementedError()`. A compiled Triton
    kernel cannot raise: its compiler's error only names the statement."""
    while err is not None:
        if isinstance(err, NotImplementedError) or "NotImplementedError" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def exercise(chapter: str, number: int, answer: str, argument: str | None = None):
    """Register a check as the check of exercise `number` of chapter's problem set."""
    def register(check_fn: Callable) -> Callable:
        label = f"exercise {number} ({answer})"

        @functools.wraps(check_fn)
        def run(*args, **kwargs):
            try:
                return check_fn(*args, **kwargs)
            except (AssertionError, AnswerError):
                raise
            except Exception as err:
                if _unanswered(err):
                    raise NotAnswered(f"{label} is not answered yet: write your code where it says "
                                      "# YOUR CODE HERE and delete the `raise NotImplementedError()`") from None
                raise AnswerError(f"{label}: your code raised {type(err).__name__}: {err}") from err
        ex = Exercise(f"{chapter}.{answer}", chapter, number, answer, argument or answer, run)
        EXERCISES[ex.id] = ex
        return run
    return register


@contextlib.contextmanager
def your_answers(chapter: str) -> Iterator[None]:
    """Run a problem set's last part, which calls the student's answers: an unanswered one it reaches
    fails naming its exercise (found by the function the NotImplementedError was raised in)."""
    try:
        yield
    except Exception as err:
        if not _unanswered(err):
            raise
        names = {e.answer: e for e in problem_set(chapter)}
        cause: BaseException = err
        while (inner := cause.__cause__ or cause.__context__) is not None:  # the NotImplementedError itself
            cause = inner
        tb, hit = cause.__traceback__, None
        while tb is not None:
            code = tb.tb_frame.f_code
            hit = names.get(code.co_name) or names.get(code.co_qualname.split(".")[0]) or hit
            tb = tb.tb_next
        which = hit.label if hit else "an exercise of this problem set"
        raise NotAnswered(f"{which} is not answered yet: finish it (and run its check) before this part") from None


def _describe(args: tuple) -> str:
    return ", ".join(f"{tuple(a.shape)} {str(a.dtype).removeprefix('torch.')}"
                     if isinstance(a, torch.Tensor) else repr(a)[:80] for a in args)


def _call(fn: Callable, args, where: str):
    """fn(*args), with an exception from the student's code reported with the case it failed on."""
    try:
        return fn(*args)
    except Exception as err:
        if _unanswered(err):
            raise
        raise AnswerError(f"{where}: your code raised {type(err).__name__}: {err}") from err


# Half-precision answers may round differently from the reference by an ulp or two.
TOLERANCES = {torch.float16: (4e-3, 1e-4), torch.bfloat16: (3e-2, 1e-3)}  # (rtol, atol)


def check(name: str, fn: Callable, ref: Callable, inputs: Inputs, cases: int = 8,
          rtol: float = 1e-4, atol: float = 1e-5, seed: int = 0, device: str = "cpu") -> None:
    """Compare fn(*args) with ref(*args) for `cases` random draws of inputs(generator, case), drawn
    on the CPU and handed to fn on `device` (the reference runs on the CPU)."""
    gen = torch.Generator().manual_seed(seed)
    for case in range(cases):
        args = inputs(gen, case)
        where = f"{name}, case {case + 1} (inputs: {_describe(args)})"
        # Each side gets its own copy, so that a function that writes in place is checked too.
        fresh = lambda dev, args=args: [a.clone().to(dev) if isinstance(a, torch.Tensor) else a for a in args]  # noqa: E731
        expected = ref(*fresh("cpu"))
        got = _call(fn, fresh(device), where)
        if isinstance(expected, torch.Tensor):
            expected, got = (expected,), (got,) if isinstance(got, torch.Tensor) else got
        if not isinstance(got, (tuple, list)) or len(got) != len(expected):
            raise AssertionError(f"{where}: expected {len(expected)} tensor(s), got {type(got).__name__}")
        for i, (e, g) in enumerate(zip(expected, got)):
            at = where + (f", output {i}" if len(expected) > 1 else "")
            if not isinstance(g, torch.Tensor):
                raise AssertionError(f"{at}: expected a tensor, got {type(g).__name__}")
            if g.shape != e.shape:
                raise AssertionError(f"{at}: shape {tuple(g.shape)}, expected {tuple(e.shape)}")
            if g.dtype != e.dtype:
                raise AssertionError(f"{at}: dtype {g.dtype}, expected {e.dtype}")
            try:
                tol = TOLERANCES.get(e.dtype, (rtol, atol))
                torch.testing.assert_close(g.cpu(), e, rtol=tol[0], atol=tol[1])
            except AssertionError as err:
                raise AssertionError(f"{at}: values differ from the reference.\n{err}") from None
    print(f"passed: {name} matches the reference on {cases} random inputs")


def _randint(gen: torch.Generator, lo: int, hi: int) -> int:
    return int(torch.randint(lo, hi + 1, (1,), generator=gen))


def _block_size(gen: torch.Generator, case: int, hi: int = 6) -> int:
    """Block sizes 1 and 3 first (where off-by-ones show), then random ones."""
    return (1, 3)[case] if case < 2 else _randint(gen, 1, hi)


DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@exercise("01", 1, "rms_norm")
def check_rms_norm(fn: Callable) -> None:
    """fn(x, weight, eps) -> RMSNorm of x over its last dimension, statistics in float32, in x's
    dtype (float32, float16 and bfloat16; float16 values large enough that x**2 overflows it, and
    float32 values small enough that eps counts)."""
    def inputs(gen, case):
        dtype = DTYPES[case % 3]
        shape = [_randint(gen, 1, 5) for _ in range(_randint(gen, 1, 3))] + [_randint(gen, 3, 300)]
        scale = 1000.0 if dtype == torch.float16 and case % 2 else 1e-3 if case == 6 else 3.0  # eps matters
        x = (torch.randn(shape, generator=gen) * scale).to(dtype)
        return x, torch.randn(shape[-1], generator=gen).to(dtype), 1e-5
    check("rms_norm", fn, rms_norm, inputs, cases=9)


def _rope_inputs(gen: torch.Generator, case: int, dtypes=(torch.float32,), batch: bool = False) -> tuple:
    T, Hk, D = _randint(gen, 1, 40), _randint(gen, 1, 4), 2 * _randint(gen, 1, 40)
    Hq = Hk * _randint(gen, 1, 3)
    dtype = dtypes[case % len(dtypes)]
    lead = (_randint(gen, 1, 3),) if batch and case % 2 else ()  # the model's [B, T, ...] as well
    cos, sin = rope_cos_sin(torch.randint(0, 4096, (*lead, T), generator=gen), rope_inv_freq(D, 10000.0))
    return (torch.randn(*lead, T, Hq, D, generator=gen).to(dtype),
            torch.randn(*lead, T, Hk, D, generator=gen).to(dtype), cos, sin)


@exercise("01", 2, "apply_rope")
def check_rope(fn: Callable) -> None:
    """fn(q [..., T, Hq, D], k [..., T, Hk, D], cos, sin [..., T, D/2]) -> rotated (q, k), rotate-half."""
    check("apply_rope", fn, apply_rope, lambda gen, case: _rope_inputs(gen, case, batch=True))


@exercise("01", 3, "causal_attention")
def check_attention(fn: Callable) -> None:
    """fn(q [B, T, Hq, D], k [B, T, Hk, D], v, scale) -> causal GQA attention [B, T, Hq, D]."""
    def inputs(gen, case):
        B, T, Hk, D = _randint(gen, 1, 3), _randint(gen, 2, 33), _randint(gen, 1, 3), _randint(gen, 2, 40)
        Hq = Hk * _randint(gen, 2 if case == 0 else 1, 4)
        q, k, v = (torch.randn(B, T, h, D, generator=gen) for h in (Hq, Hk, Hk))
        return q, k, v, D ** -0.5
    check("causal_attention", fn, causal_attention, inputs)


@exercise("01", 4, "top_p_filter")
def check_top_p(fn: Callable) -> None:
    """fn(logits [B, V], top_p) -> logits with every token outside the nucleus set to -inf."""
    def inputs(gen, case):
        B, V = _randint(gen, 1, 4), _randint(gen, 2, 500)
        top_p = float(torch.rand((), generator=gen) * 0.98 + 0.01)
        return torch.randn(B, V, generator=gen) * 2, top_p
    check("top_p_filter", fn, top_p_filter, inputs)


def device() -> str:
    """Where the problem sets' Triton kernels run: the GPU when there is one, else Triton's interpreter."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def kernel_dtypes() -> tuple[torch.dtype, ...]:
    """Triton's interpreter computes bfloat16 wrongly (NaN from a product of two), so on the CPU
    the kernels are checked in float32 and float16 only."""
    return DTYPES if torch.cuda.is_available() else DTYPES[:2]


def _in_float32(op: Callable) -> Callable:
    """op computed in float32 on the inputs as given, each output rounded once to the input dtype:
    what a kernel that computes in float32 registers stores."""
    def run(*args):
        dtype = next(a.dtype for a in args if isinstance(a, torch.Tensor))
        out = op(*[a.float() if isinstance(a, torch.Tensor) else a for a in args])
        return out.to(dtype) if isinstance(out, torch.Tensor) else tuple(o.to(dtype) for o in out)
    return run


@exercise("04", 1, "rms_norm_kernel", argument="rms_norm")
def check_rms_norm_kernel(fn: Callable) -> None:
    """fn(x, weight, eps) launching the kernel: rows of odd widths in float32, float16 (values large
    enough that x**2 overflows it) and, on a GPU, bfloat16; on the GPU when there is one."""
    dtypes = kernel_dtypes()

    def inputs(gen, case):
        dtype = dtypes[case % len(dtypes)]
        rows, cols = _randint(gen, 1, 12), _randint(gen, 3, 300)
        scale = 1000.0 if dtype == torch.float16 and case > 2 else 1e-3 if case == 4 else 3.0  # eps matters
        return ((torch.randn(rows, cols, generator=gen) * scale).to(dtype),
                torch.randn(cols, generator=gen).to(dtype), 1e-5)
    check("rms_norm kernel", fn, rms_norm, inputs, cases=6, device=device())


@exercise("04", 2, "rope_kernel", argument="apply_rope")
def check_rope_kernel(fn: Callable) -> None:
    """fn(q [T, Hq, D], k [T, Hk, D], cos, sin [T, D/2] float32) launching the kernel: float32,
    float16 and, on a GPU, bfloat16 heads of odd counts and widths; on the GPU when there is one."""
    dtypes = kernel_dtypes()
    check("rope kernel", fn, _in_float32(apply_rope), lambda gen, case: _rope_inputs(gen, case, dtypes),
          cases=6, device=device())


@exercise("02", 1, "write_kv")
def check_write_kv(fn: Callable) -> None:
    """fn(k_cache, v_cache, k, v, start) -> (k_cache, v_cache) with k, v written at slots start..."""
    def inputs(gen, case):
        B, L, Hk, D = _randint(gen, 1, 3), _randint(gen, 2, 40), _randint(gen, 1, 3), _randint(gen, 1, 16)
        T = _randint(gen, 1, L)
        start = _randint(gen, 1 if case == 0 else 0, L - T)
        caches = [torch.randn(B, L, Hk, D, generator=gen) for _ in range(2)]
        return (*caches, torch.randn(B, T, Hk, D, generator=gen), torch.randn(B, T, Hk, D, generator=gen), start)
    check("write_kv", fn, write_kv, inputs)


def _cached_attention(q, k_cache, v_cache, length, scale):
    return causal_attention(q, k_cache[:, :length], v_cache[:, :length], scale, q_start=length - 1)


@exercise("02", 2, "cached_attention")
def check_cached_attention(fn: Callable) -> None:
    """fn(q [B, 1, Hq, D], k_cache, v_cache [B, max_len, Hk, D], length, scale) -> [B, 1, Hq, D]:
    the newest token (in slot length-1) attends over slots 0..length-1 only."""
    def inputs(gen, case):
        B, L, Hk, D = _randint(gen, 1, 3), _randint(gen, 2, 50), _randint(gen, 1, 3), _randint(gen, 2, 33)
        Hq = Hk * _randint(gen, 2 if case == 0 else 1, 4)
        k_cache, v_cache = (torch.randn(B, L, Hk, D, generator=gen) for _ in range(2))
        length = _randint(gen, 1, L - 1) if case < 4 else _randint(gen, 1, L)  # stale slots after length
        return torch.randn(B, 1, Hq, D, generator=gen), k_cache, v_cache, length, D ** -0.5
    check("cached attention", fn, _cached_attention, inputs)


@exercise("02", 3, "left_pad")
def check_left_pad(fn: Callable) -> None:
    """fn(prompts: list[list[int]], pad_id) -> ids [B, L], real [B, L] bool, positions [B, L]."""
    def inputs(gen, case):
        prompts = [torch.randint(1, 1000, (_randint(gen, 1, 12),), generator=gen).tolist()
                   for _ in range(_randint(gen, 2 if case == 0 else 1, 5))]
        return prompts, _randint(gen, 0, 3)
    check("left_pad", fn, left_pad, inputs)


@exercise("02", 4, "static_batch_waste")
def check_static_batch_waste(fn: Callable) -> None:
    """fn(output_lens: list[int], batch_size) -> fraction of decode slots spent on finished rows."""
    def inputs(gen, case):
        lens = torch.randint(1, 300, (_randint(gen, 1, 40),), generator=gen).tolist()
        return lens, _randint(gen, 1, 12)
    as_tensor = lambda f: lambda *a: torch.tensor(float(f(*a)), dtype=torch.float64)  # noqa: E731
    check("static_batch_waste", as_tensor(fn), as_tensor(static_batch_waste), inputs)


@exercise("03", 3, "slot_mapping")
def check_slot_mapping(fn: Callable) -> None:
    """fn(block_table: list[int], start, num_tokens, block_size) -> LongTensor [num_tokens] of slots."""
    def inputs(gen, case):
        bs, n_blocks = _block_size(gen, case, 8), _randint(gen, 1, 6)
        table = torch.randperm(50, generator=gen)[:n_blocks].tolist()
        start = _randint(gen, 0, bs * n_blocks - 1)
        return table, start, _randint(gen, 1, bs * n_blocks - start), bs
    check("slot_mapping", fn, slot_mapping, inputs)


@exercise("03", 4, "gather_kv")
def check_gather_kv(fn: Callable) -> None:
    """fn(pool [num_blocks, block_size, Hk, D], block_tables [B, max_blocks], length) -> [B, length, Hk, D]."""
    def inputs(gen, case):
        nb, bs, Hk, D = _randint(gen, 4, 30), _block_size(gen, case, 8), _randint(gen, 1, 3), _randint(gen, 1, 9)
        B, width = _randint(gen, 1, 3), _randint(gen, 1, 4)
        tables = torch.randint(0, nb, (B, width), generator=gen)
        return torch.randn(nb, bs, Hk, D, generator=gen), tables, _randint(gen, 1, width * bs)
    check("gather_kv", fn, gather_kv, inputs)


_OPS = {"allocate": "allocate", "append": "append_token", "free": "free"}


def _run_ops(cls, ops: list[tuple], num_blocks: int, block_size: int, case: int) -> None:
    """Run the same operations on the student's class and the reference BlockManager; they must
    agree on which calls fail, on free counts and on table lengths, and tables must not overlap."""
    where = f"case {case + 1} (num_blocks={num_blocks}, block_size={block_size})"
    mine = _call(cls, (num_blocks, block_size), where)
    ref = BlockManager(num_blocks, block_size)
    for step, (op, *args) in enumerate(ops):
        where = f"case {case + 1} (num_blocks={num_blocks}, block_size={block_size}), after {ops[:step + 1][-4:]} " \
                "(the last 4 operations)"
        outcome: list[str | None] = []
        for bm in (mine, ref):
            try:
                getattr(bm, _OPS[op])(*args)
                outcome.append(None)
            except (OutOfBlocks, KeyError, ValueError) as e:
                outcome.append(type(e).__name__)
            except Exception as err:
                if _unanswered(err):
                    raise
                raise AnswerError(f"{where}: your {_OPS[op]} raised {type(err).__name__}: {err}") from err
        if outcome[0] != outcome[1]:
            raise AssertionError(f"{where}: expected {outcome[1] or 'success'}, got {outcome[0] or 'success'}")
        if mine.num_free_blocks != ref.num_free_blocks:
            raise AssertionError(f"{where}: {mine.num_free_blocks} free blocks, expected {ref.num_free_blocks}")
        seen: set[int] = set()
        for seq in ref.tables:
            table = mine.block_table(seq)
            if len(table) != len(ref.block_table(seq)):
                raise AssertionError(f"{where}: sequence {seq} has {len(table)} blocks, expected "
                                     f"{len(ref.block_table(seq))}")
            if seen & set(table) or not all(0 <= b < num_blocks for b in table):
                raise AssertionError(f"{where}: block table {table} of {seq} overlaps another or is out of range")
            seen |= set(table)


def _random_ops(gen: torch.Generator, kinds: list[str], n: int = 60) -> list[tuple]:
    ops = []
    for _ in range(n):
        kind, seq = kinds[_randint(gen, 0, len(kinds) - 1)], _randint(gen, 0, 4)
        ops.append((kind, seq, _randint(gen, 1, 20)) if kind == "allocate" else (kind, seq))
    return ops


def _check_block_ops(cls, with_append: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    kinds = ["allocate", "free"] + ["append"] * 3 * with_append
    cases = 30
    for case in range(cases):
        _run_ops(cls, _random_ops(gen, kinds), _randint(gen, 4, 16), _block_size(gen, case), case)
    what = "allocate/append/free" if with_append else "allocate/free"
    print(f"passed: {what} agree with the reference on {cases} random operation sequences")


@exercise("03", 1, "MyBlockManager")
def check_block_manager(cls) -> None:
    """cls(num_blocks, block_size) with allocate(seq_id, num_tokens) -> table, free(seq_id),
    block_table(seq_id) and num_free_blocks, compared with the reference on random operation
    sequences (errors: OutOfBlocks, KeyError, ValueError)."""
    _check_block_ops(cls, with_append=False)


@exercise("03", 2, "append_token", argument="MyBlockManager")
def check_append_token(cls) -> None:
    """The same, with append_token(seq_id) among the operations."""
    _check_block_ops(cls, with_append=True)


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
        R, D = _randint(gen, 1, 9), _randint(gen, 1, 70)
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
    Every slot the piece must not read holds NaN, so reading one shows in the result."""
    def inputs(gen, case):
        G, D, bs = _randint(gen, 1, 5), _randint(gen, 2, 40), _block_size(gen, case, 7)
        length = _randint(gen, 1, 90)
        n_blocks = -(-length // bs)
        num_blocks = n_blocks + _randint(gen, 1, 6)
        table = torch.randperm(num_blocks, generator=gen)[:n_blocks].tolist()
        start = _randint(gen, 0, length - 1)
        end = _randint(gen, start + 1, length)
        caches = [torch.full((num_blocks, bs, D), float("nan")) for _ in range(2)]
        for c in caches:
            pos = torch.arange(start, end)
            c.flatten(0, 1)[torch.tensor(table)[pos // bs] * bs + pos % bs] = torch.randn(end - start, D, generator=gen)
        return torch.randn(G, D, generator=gen), *caches, table, start, end, D ** -0.5
    check("decode program", fn, _decode_program_ref, inputs)


def _merge_splits_ref(part, lse):
    w = (lse - lse.max(-1, keepdim=True).values).exp()
    return (part * (w / w.sum(-1, keepdim=True))[..., None]).sum(-2)


@exercise("05", 3, "merge_kernel", argument="merge_splits")
def check_merge_splits(fn: Callable) -> None:
    """fn(part [R, S, D] float32, lse [R, S]) -> out [R, D]: S partial results per row (natural-log
    lse, -inf for an empty split; split 0 is never empty) merged."""
    def inputs(gen, case):
        R, S, D = _randint(gen, 1, 6), _randint(gen, 1, 9), _randint(gen, 1, 70)
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
        nb, bs, Hk, D = _randint(gen, 2, 9), _block_size(gen, case), _randint(gen, 1, 3), _randint(gen, 1, 20)
        N = _randint(gen, 1, nb * bs)
        slots = torch.randperm(nb * bs, generator=gen)[:N]
        slots[torch.rand(N, generator=gen) < 0.25] = -1
        return (torch.randn(N, Hk, D, generator=gen), torch.randn(N, Hk, D, generator=gen),
                torch.randn(nb, bs, Hk, D, generator=gen), torch.randn(nb, bs, Hk, D, generator=gen), slots)
    check("store_kv", caches_after(fn), caches_after(store_kv_ref), inputs)


def _as_tensor(fn: Callable) -> Callable:
    """fn with its list arguments copied and its int or list result as a tensor, for `check`."""
    def run(*args):
        result = fn(*[list(a) if isinstance(a, list) else a for a in args])
        return tuple(torch.tensor(r, dtype=torch.int64) for r in result) if isinstance(result, tuple) \
            else torch.tensor(result, dtype=torch.int64)
    return run


def _admit_ref(prompt_lens, free_blocks, block_size, seats, budget):
    n = 0
    for length in prompt_lens:
        need = -(-length // block_size)
        if n == seats or length > budget or need > free_blocks:
            break
        free_blocks, budget, n = free_blocks - need, budget - length, n + 1
    return n


@exercise("06", 1, "admit")
def check_admit(fn: Callable) -> None:
    """fn(prompt_lens, free_blocks, block_size, seats, budget) -> how many waiting sequences, in
    queue order, are admitted (each: a seat, its prompt within the token budget, blocks for it)."""
    def inputs(gen, case):
        n = _randint(gen, 0, 8)
        return ([_randint(gen, 1, 60) for _ in range(n)], _randint(gen, 0, 40), _block_size(gen, case, 16),
                _randint(gen, 0, 8), _randint(gen, 1, 200))
    check("admit", _as_tensor(fn), _as_tensor(_admit_ref), inputs, cases=40)


def _schedule_decodes_ref(lens, free_blocks, block_size):
    queue, decode, preempted = list(range(len(lens))), [], []
    while queue:
        i = queue.pop(0)
        needs_block = lens[i] % block_size == 0
        while needs_block and free_blocks == 0:
            victim = queue.pop() if queue else i
            preempted.append(victim)
            free_blocks += -(-lens[victim] // block_size)
            if victim == i:
                break
        else:
            free_blocks -= needs_block
            decode.append(i)
    return decode, preempted


@exercise("06", 2, "schedule_decodes")
def check_schedule_decodes(fn: Callable) -> None:
    """fn(lens, free_blocks, block_size) -> (decoding indices, preempted indices in order): running
    sequences (most urgent first, lens[i] tokens each in the pool) each decode a token, preempting
    the least urgent one (recompute) whenever a needed block is not free."""
    def inputs(gen, case):
        bs = _block_size(gen, case, 5)
        return [_randint(gen, 1, 4 * bs) for _ in range(_randint(gen, 0, 9))], _randint(gen, 0, 3), bs
    check("schedule_decodes", _as_tensor(fn), _as_tensor(_schedule_decodes_ref), inputs, cases=60)


def _preempt_for_ref(head, head_blocks, running, running_blocks, free_blocks):
    n = 0
    while n < len(running) and head_blocks > free_blocks and tuple(head) < tuple(running[-1 - n]):
        free_blocks += running_blocks[-1 - n]
        n += 1
    return n


@exercise("06", 3, "preempt_for")
def check_preempt_for(fn: Callable) -> None:
    """fn(head, head_blocks, running, running_blocks, free_blocks) -> how many of the least urgent
    running sequences (keys (priority, arrival), most urgent first) the waiting head preempts."""
    def inputs(gen, case):
        n = _randint(gen, 0, 7)
        keys = sorted((_randint(gen, 0, 3), a) for a in torch.randperm(20, generator=gen)[:n + 1].tolist())
        head = keys.pop(_randint(gen, 0, n))
        return (head, _randint(gen, 1, 12), keys, [_randint(gen, 1, 6) for _ in keys], _randint(gen, 0, 6))
    check("preempt_for", _as_tensor(fn), _as_tensor(_preempt_for_ref), inputs, cases=60)


def _sample_rows_ref(logits, temperature, top_p, noise):
    scaled = logits / temperature.clamp(min=1e-5)[:, None]
    probs = top_p_filter(scaled, top_p[:, None]).softmax(-1)
    return torch.where(temperature > 0, (probs / noise).argmax(-1), logits.argmax(-1))


@exercise("06", 4, "sample_rows")
def check_sample_rows(fn: Callable) -> None:
    """fn(logits [B, V], temperature [B], top_p [B], noise [B, V]) -> tokens [B] int64: each row by
    its own parameters (temperature 0: argmax), top-p, then argmax(probs / noise)."""
    def inputs(gen, case):
        B, V = _randint(gen, 1, 7), _randint(gen, 2, 300)
        temperature = torch.rand(B, generator=gen) * 1.5
        temperature[torch.rand(B, generator=gen) < 0.3] = 0
        top_p = torch.rand(B, generator=gen) * 0.9 + 0.1
        top_p[torch.rand(B, generator=gen) < 0.3] = 1.0
        noise = -torch.rand(B, V, generator=gen).clamp(min=1e-7).log()
        return torch.randn(B, V, generator=gen) * 3, temperature, top_p, noise
    check("sample_rows", fn, _sample_rows_ref, inputs, cases=20)


def _varlen_ref(tokens, tables, num_cached, block_size):
    from miniinfer.worker.kv_cache import VarlenBatch
    b = VarlenBatch.build(tokens, tables, num_cached, block_size)
    return tuple(t.long() for t in (b.positions, b.slot_mapping, b.query_start_loc, b.seq_lens))


@exercise("06", 5, "varlen_metadata")
def check_varlen_metadata(fn: Callable) -> None:
    """fn(tokens, block_tables, num_cached, block_size) -> (positions [N], slot_mapping [N],
    query_start_loc [B+1], seq_lens [B]) as int64 tensors."""
    def inputs(gen, case):
        bs, B = _block_size(gen, case, 5), _randint(gen, 1, 6)
        cached = [_randint(gen, 0, 12) for _ in range(B)]
        tokens = [[_randint(gen, 0, 99) for _ in range(_randint(gen, 1, 9))] for _ in range(B)]
        pool = torch.randperm(200, generator=gen).tolist()
        tables = [[pool.pop() for _ in range(-(-(c + len(t)) // bs))] for c, t in zip(cached, tokens)]
        return tokens, tables, cached, bs
    check("varlen_metadata", lambda *a: tuple(torch.as_tensor(x).long() for x in fn(*a)), _varlen_ref,
          inputs, cases=20)


def _chain_hashes_ref(tokens, block_size):
    from miniinfer.core.prefix_cache import block_keys
    return [h for h, _ in block_keys(tokens, block_size)]


@exercise("07", 1, "chain_hashes")
def check_chain_hashes(fn: Callable) -> None:
    """fn(tokens, block_size) -> the chained hash of each full block, in order."""
    def inputs(gen, case):
        return [_randint(gen, 0, 3) for _ in range(_randint(gen, 0, 30))], _block_size(gen, case, 5)
    check("chain_hashes", _as_tensor(fn), _as_tensor(_chain_hashes_ref), inputs, cases=40)


def _longest_cached_prefix_ref(tokens, cached, block_size):
    hashes = _chain_hashes_ref(tokens[:-1], block_size)  # the last token's block is always computed
    blocks = []
    for h in hashes:
        if h not in cached:
            break
        blocks.append(cached[h])
    return blocks


@exercise("07", 2, "longest_cached_prefix")
def check_longest_cached_prefix(fn: Callable) -> None:
    """fn(tokens, cached {hash: block}, block_size) -> the cached blocks of the longest prefix,
    leaving at least the last token to compute; some caches have lost blocks inside a prefix."""
    def inputs(gen, case):
        bs = _block_size(gen, case, 4)
        stored = [[_randint(gen, 0, 2) for _ in range(_randint(gen, 0, 16))] for _ in range(3)]
        cached = {h: _randint(gen, 0, 99) for s in stored for h in _chain_hashes_ref(s, bs)}
        if case % 2:  # evictions leave gaps: a later block of a prefix can outlive an earlier one
            cached = {h: b for h, b in cached.items() if torch.rand((), generator=gen) > 0.3}
        query = stored[0][:_randint(gen, 0, 16)] + [_randint(gen, 0, 2) for _ in range(_randint(gen, 1, 6))]
        return query, cached, bs
    check("longest_cached_prefix", _as_tensor(fn), _as_tensor(_longest_cached_prefix_ref), inputs, cases=60)


def _lru_evictions_ref(free, ops):
    lru, evicted = [], []
    for op, arg in ops:
        if op == "release":
            lru.append(arg)
        elif op == "hit":
            if arg in lru:
                lru.remove(arg)
        else:  # take arg blocks
            use = min(arg, len(free))
            del free[:use]
            evicted += lru[:arg - use]
            del lru[:arg - use]
    return evicted


@exercise("07", 3, "lru_evictions")
def check_lru_evictions(fn: Callable) -> None:
    """fn(free, ops) -> the cached blocks evicted, in order. ops: ("release", b): cached block b
    loses its last user; ("hit", b): a request reuses cached block b; ("take", n): n blocks are
    needed, from the free list first (front first), then by evicting the least recently used."""
    def inputs(gen, case):
        free = list(range(_randint(gen, 0, 4)))
        left, lru, in_use, ops = len(free), [], list(range(10, 10 + _randint(gen, 0, 8))), []
        for _ in range(_randint(gen, 0, 14)):  # only valid ops: a take never asks for more than there is
            kind = _randint(gen, 0, 2)
            if kind == 0 and in_use:
                b = in_use.pop(_randint(gen, 0, len(in_use) - 1))
                ops.append(("release", b))
                lru.append(b)
            elif kind == 1 and lru:
                b = lru.pop(_randint(gen, 0, len(lru) - 1))
                ops.append(("hit", b))
                in_use.append(b)
            elif left + len(lru):
                n = _randint(gen, 1, left + len(lru))
                ops.append(("take", n))
                del lru[:n - min(n, left)]
                left -= min(n, left)
        return free, ops
    check("lru_evictions", _as_tensor(fn), _as_tensor(_lru_evictions_ref), inputs, cases=60)


def _prefill_plan_ref(num_decoders, prompt_lens, budget):
    left, steps = list(prompt_lens), []
    while any(left):
        room, step = budget - num_decoders, []
        for i, n in enumerate(left):
            take = min(n, room)
            step.append(take)
            left[i], room = n - take, room - take
        steps.append(step)
    return steps


@exercise("07", 4, "prefill_plan")
def check_prefill_plan(fn: Callable) -> None:
    """fn(num_decoders, prompt_lens, budget) -> for each step until every prompt is computed, the
    tokens of each prompt computed in it: the decoders take one token each first, the prompts share
    what is left in queue order."""
    def inputs(gen, case):
        d = _randint(gen, 0, 5)
        return d, [_randint(gen, 1, 40) for _ in range(_randint(gen, 0, 4))], d + _randint(gen, 1, 12)
    check("prefill_plan", _as_tensor(fn), _as_tensor(_prefill_plan_ref), inputs, cases=60)


@exercise("08", 1, "sse_event")
def check_sse_event(fn: Callable) -> None:
    """fn(data) -> the text of one Server-Sent Event carrying `data` (any string, newlines included)."""
    from miniinfer.serving.server import sse_event
    gen = torch.Generator().manual_seed(0)
    cases = ['{"text":"hi"}', "[DONE]", "", "two\nlines", "\n", "data: inside", "a\n\nb"]
    cases += ["".join("ab\n: {}"[_randint(gen, 0, 6)] for _ in range(_randint(gen, 0, 12))) for _ in range(40)]
    for data in cases:
        got, expected = _call(fn, (data,), f"sse_event({data!r})"), sse_event(data)
        if got != expected:
            raise AssertionError(f"sse_event({data!r}) returned {got!r}; expected {expected!r}")
    print(f"passed: sse_event matches the reference on {len(cases)} strings")


@exercise("08", 2, "Detokenizer")
def check_detokenizer(cls: Callable) -> None:
    """cls(tokenizer) with add(new_ids) -> str and finish() -> str: fed the course tokenizer's ids of
    text with multi-byte characters, one to three at a time, no piece holds a broken character, text
    comes out as soon as the ids so far decode to whole characters, and the pieces add up exactly."""
    from miniinfer.model.loader import load_tokenizer
    tok = load_tokenizer(None)
    gen = torch.Generator().manual_seed(0)
    words = ["def", " x", "=", "é", "日本", "🙂", " ", "\n", "ü", "語", "(", "ok"]
    for case in range(30):
        text = "".join(words[_randint(gen, 0, len(words) - 1)] for _ in range(_randint(gen, 1, 12)))
        ids = tok(text).input_ids
        case_of = f"case {case + 1} (text {text!r}, token ids {ids})"
        detok, pieces, i = _call(cls, (tok,), case_of), [], 0
        while i < len(ids):
            n = 1 if case % 2 else _randint(gen, 1, 3)
            piece = _call(detok.add, (ids[i:i + n],), f"{case_of}, add({ids[i:i + n]})")
            i += n
            pieces.append(piece)
            so_far = tok.decode(ids[:i])
            where = f"text {text!r}, after {i} of its {len(ids)} token ids (fed {n} at a time)"
            if not isinstance(piece, str) or "\ufffd" in piece:
                raise AssertionError(f"{where}: add returned {piece!r}, a broken character")
            if n == 1 and not so_far.endswith("\ufffd") and "".join(pieces) != so_far:
                raise AssertionError(f"{where}: the ids so far decode to {so_far!r}, but only "
                                     f"{''.join(pieces)!r} was handed out")
        pieces.append(_call(detok.finish, (), f"{case_of}, finish()"))
        if "".join(pieces) != text:
            raise AssertionError(f"text {text!r}: the pieces {pieces!r} add up to {''.join(pieces)!r}")
    print("passed: the detokenizer streams 30 texts exactly, without broken characters")


@exercise("08", 3, "stream_request")
def check_stream_request(fn: Callable) -> None:
    """fn(outputs: asyncio.Queue, abort) -> an async generator of the outputs taken from the queue, up
    to and including the first finished one; abort() is called once if the stream ends before that."""
    import asyncio
    import concurrent.futures
    import contextlib
    import inspect
    from types import SimpleNamespace

    def queue_of(n):
        q: asyncio.Queue = asyncio.Queue()
        for i in range(n):
            q.put_nowait(SimpleNamespace(token=i, finished=i == n - 1))
        return q

    async def read(n, stop_after=None):
        aborts, got = [], []
        stream = fn(queue_of(n), lambda: aborts.append(1))
        if not hasattr(stream, "__aiter__"):
            if inspect.iscoroutine(stream):
                await stream  # an exercise not yet done raises its NotImplementedError here
            raise AssertionError("stream_request must be an async generator: an `async def` that yields")
        async with contextlib.aclosing(stream):
            async for out in stream:
                got.append(out.token)
                if stop_after is not None and len(got) == stop_after:
                    break
        return got, len(aborts)

    async def cancelled():  # the client's task is cancelled while it waits for a token
        aborts: list[int] = []
        q: asyncio.Queue = asyncio.Queue()

        async def client():
            async for _ in fn(q, lambda: aborts.append(1)):
                pass
        task = asyncio.create_task(client())
        await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return len(aborts)

    def run(coro):  # in a thread of its own: a notebook's event loop is already running in this one
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, coro).result()

    for n, stop, expected in [(1, None, ([0], 0)), (5, None, ([0, 1, 2, 3, 4], 0)), (5, 2, ([0, 1], 1)),
                              (3, 1, ([0], 1)), (4, 4, ([0, 1, 2, 3], 0))]:
        got = run(read(n, stop))
        if got != expected:
            raise AssertionError(f"{n} outputs, the client {'reads all' if stop is None else f'leaves after {stop}'}: "
                                 f"got tokens {got[0]} and {got[1]} abort(s); expected {expected[0]} and "
                                 f"{expected[1]}")
    if (aborts := run(cancelled())) != 1:
        raise AssertionError(f"a client cancelled while waiting: {aborts} abort(s); expected 1")
    print("passed: the stream aborts exactly when its client leaves early")


def _rejection_step_ref(p, q, guess, u):
    residual = (p - q).clamp(min=0)
    residual = residual / residual.sum() if residual.sum() > 0 else p
    return torch.tensor(bool(u * q[guess] <= p[guess])), residual


@exercise("09", 1, "rejection_step")
def check_rejection_step(fn: Callable) -> None:
    """fn(p, q, guess, u) -> (kept, residual): whether the guess (drawn from q) is kept, given a
    uniform u in (0, 1): with probability min(1, p[guess] / q[guess]); and the distribution a rejected
    guess is replaced from, norm(max(0, p - q)) (p itself where p equals q)."""
    def inputs(gen, case):
        V = _randint(gen, 2, 9)
        p = torch.rand(V, generator=gen) ** 3
        q = p.clone() if case == 0 else torch.rand(V, generator=gen) ** 3
        if case == 1:  # a token q never proposes but p likes, and one p never takes
            q[0], p[-1] = 0.0, 0.0
        return p / p.sum(), q / q.sum(), _randint(gen, 1, V - 1), float(torch.rand((), generator=gen))

    def as_tensors(f):
        def run(p, q, guess, u):
            kept, residual = f(p, q, guess, u)
            return torch.tensor(bool(kept)), residual
        return run
    check("rejection_step", as_tensors(fn), _rejection_step_ref, inputs, cases=60, atol=1e-6)


def _expected_tokens_ref(alpha, k):
    return torch.tensor(float(k + 1) if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha), dtype=torch.float64)


@exercise("09", 2, "expected_tokens")
def check_expected_tokens(fn: Callable) -> None:
    """fn(alpha, k) -> the tokens a step with k guesses makes on average when each guess is kept with
    probability alpha (independently): the kept ones before the first rejection, and one token more."""
    def inputs(gen, case):
        alpha = (0.0, 1.0)[case] if case < 2 else float(torch.rand((), generator=gen))
        return alpha, _randint(gen, 1, 10)
    check("expected_tokens", lambda a, k: torch.tensor(float(fn(a, k)), dtype=torch.float64),
          _expected_tokens_ref, inputs, cases=30, rtol=1e-9, atol=1e-9)


@exercise("09", 3, "ngram_guesses")
def check_ngram_guesses(fn: Callable) -> None:
    """fn(tokens, k, max_n) -> up to k guesses: for n from max_n down to 1, the tokens that followed
    the latest earlier occurrence of the last n tokens (one that is followed by a token), the first
    n that has one; [] when none has."""
    from miniinfer.worker.speculative import ngram_guesses

    def inputs(gen, case):
        vocab = _randint(gen, 1, 4)
        tokens = [_randint(gen, 0, vocab) for _ in range(_randint(gen, 1, 24))]
        return tokens, _randint(gen, 1, 6), _randint(gen, 1, 4)
    check("ngram_guesses", _as_tensor(fn), _as_tensor(lambda t, k, n: ngram_guesses(t, k, n)), inputs, cases=80)


def _rollback_ref(table, num_tokens, block_size):
    keep = -(-num_tokens // block_size)
    return table[:keep], table[keep:]


@exercise("09", 4, "rollback")
def check_rollback(fn: Callable) -> None:
    """fn(table, num_tokens, block_size) -> (kept, released): a block table cut to hold only the first
    num_tokens tokens (the rest were rejected guesses), and the blocks it gives back, in order."""
    def inputs(gen, case):
        bs = _block_size(gen, case)
        n = _randint(gen, 1, 30)
        blocks = torch.randperm(40, generator=gen)[:-(-(n + _randint(gen, 0, 8)) // bs)].tolist()
        return blocks, n, bs
    check("rollback", _as_tensor(fn), _as_tensor(_rollback_ref), inputs, cases=40)


def _fake_quantize_ref(w, bits, symmetric):
    if symmetric:
        top = 2 ** (bits - 1) - 1
        scale = (w.abs().amax(1, keepdim=True) / top).clamp(min=1e-10)
        return torch.round(w / scale).clamp(-top - 1, top) * scale
    low, high = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    scale = ((high - low) / (2 ** bits - 1)).clamp(min=1e-10)
    zero = torch.round(-low / scale)
    return ((torch.round(w / scale) + zero).clamp(0, 2 ** bits - 1) - zero) * scale


def _weights(gen, case, groups_of: int = 1):
    """A weight [N, K] of odd rows, with rows of very different sizes (and an all-zero row)."""
    N, K = _randint(gen, 1, 9), groups_of * _randint(gen, 1, 6) * (8 if groups_of == 1 else 1)
    w = torch.randn(N, K, generator=gen) * torch.rand(N, 1, generator=gen) * 4
    if case == 0:
        w[0] = 0.0
    return w


@exercise("10", 1, "fake_quantize")
def check_fake_quantize(fn: Callable) -> None:
    """fn(w [N, K], bits, symmetric) -> w rounded to `bits`-bit codes per row and back: symmetric with
    scale max|w| / (2^(bits-1) - 1), or asymmetric with scale (max - min) / (2^bits - 1) and a zero point."""
    def inputs(gen, case):
        return _weights(gen, case), (8, 4, 3)[case % 3], bool(case % 2)
    check("fake_quantize", fn, _fake_quantize_ref, inputs, cases=24)


@exercise("10", 2, "pack_int4")
def check_pack_int4(fn: Callable) -> None:
    """fn(codes [N, K] int8 in [-8, 7]) -> int32 [N, K/8]: eight codes to a word, the first in the
    lowest 4 bits, each plus 8 (compressed-tensors' pack-quantized layout)."""
    from miniinfer.layers.quantization import pack

    def inputs(gen, case):
        shape = (_randint(gen, 1, 6), 8 * _randint(gen, 1, 5))
        return (torch.randint(-8, 8, shape, generator=gen, dtype=torch.int8),)
    check("pack_int4", fn, lambda codes: pack(codes, 4), inputs, cases=20, rtol=0, atol=0)


def _group_scales_ref(w, group_size):
    groups = w.reshape(w.shape[0], -1, group_size)
    return (groups.abs().amax(-1) / 7).clamp(min=1e-10)


@exercise("10", 3, "group_scales")
def check_group_scales(fn: Callable) -> None:
    """fn(w [N, K], group_size) -> int4 scales [N, K / group_size]: each group's max|w| / 7."""
    def inputs(gen, case):
        g = (8, 16, 32)[case % 3]
        return _weights(gen, case, g), g
    check("group_scales", fn, _group_scales_ref, inputs, cases=18)


def _dequant_matmul_ref(x, packed, scale):
    from miniinfer.layers.quantization import dequantize
    return x @ dequantize(packed, scale, 4).T


@exercise("10", 4, "dequant_matmul")
def check_dequant_matmul(fn: Callable) -> None:
    """fn(x [M, K], packed int32 [N, K/8], scale [N, K/group]) -> x @ W^T [M, N], W the int4 weight
    that the packed codes and their group scales stand for."""
    from miniinfer.layers.quantization import pack, quantize_int

    def inputs(gen, case):
        g = (8, 16, 32)[case % 3]
        codes, scale = quantize_int(_weights(gen, case, g), 4, g)
        return torch.randn(_randint(gen, 1, 5), codes.shape[1], generator=gen), pack(codes, 4), scale
    check("dequant_matmul", fn, _dequant_matmul_ref, inputs, cases=18)


@exercise("10", 5, "fp8_quantize")
def check_fp8_quantize(fn: Callable) -> None:
    """fn(x [M, K]) -> (values [M, K] float8_e4m3fn, scales [M, 1] float32): each row divided by its
    max|x| / 448 (e4m3's largest value), so that the row's largest value lands on 448."""
    from miniinfer.layers.quantization import quantize_fp8

    def inputs(gen, case):
        return (_weights(gen, case) * 100,)

    def as_float(f):
        def run(x):
            values, scale = f(x)
            assert values.dtype == torch.float8_e4m3fn, f"values must be float8_e4m3fn, got {values.dtype}"
            return values.float(), scale
        return run
    # rtol: a value on the edge between two e4m3 steps may round either way (one step is 1/16 to 1/8)
    check("fp8_quantize", as_float(fn), as_float(quantize_fp8), inputs, cases=16, rtol=0.13, atol=1e-3)


def _shard_linear_ref(w, rank, size, by):
    from miniinfer.layers.parallel import Shard

    share = Shard(rank, size).part(w.shape[0 if by == "output" else 1])
    return w[share] if by == "output" else w[:, share]


@exercise("11", 1, "shard_linear")
def check_shard_linear(fn: Callable) -> None:
    """fn(w [N, K], rank, size, by) -> rank's share of w: by="output" its N/size consecutive rows
    (column-parallel), by="input" its K/size consecutive columns (row-parallel)."""
    def inputs(gen, case):
        size = (2, 3, 4)[case % 3]
        w = torch.randn(size * _randint(gen, 1, 5), size * _randint(gen, 1, 5), generator=gen)
        return w, _randint(gen, 0, size - 1), size, ("output", "input")[case % 2]
    check("shard_linear", fn, _shard_linear_ref, inputs, cases=12, rtol=0, atol=0)


@exercise("11", 2, "vocab_lookup")
def check_vocab_lookup(fn: Callable) -> None:
    """fn(ids [B, T], share [V/size, H], start) -> [B, T, H]: the embedding of each id that falls in
    this rank's rows start .. start + len(share) - 1, and zeros for every other id (the ranks' results
    are then added up)."""
    from miniinfer.layers.parallel import share_lookup

    def inputs(gen, case):
        size, per = _randint(gen, 2, 4), _randint(gen, 1, 9)
        rank = _randint(gen, 0, size - 1)
        start, vocab = rank * per, size * per
        ids = torch.randint(0, vocab, (_randint(gen, 1, 3), _randint(gen, 4, 7)), generator=gen)
        # the share's first and last rows, and the ids just outside it
        ids[0, :4] = torch.tensor([max(start - 1, 0), start, start + per - 1, min(start + per, vocab - 1)])
        return ids, torch.randn(per, _randint(gen, 1, 6), generator=gen), start
    check("vocab_lookup", fn, share_lookup, inputs, cases=12, rtol=0, atol=0)


# What follows each module when its layer is split over ranks (None: its output stays split).
COLLECTIVES = {"embed_tokens": "all_reduce", "qkv_proj": None, "o_proj": "all_reduce", "gate_up_proj": None,
               "down_proj": "all_reduce", "lm_head": "all_gather"}


@exercise("11", 3, "collective_after")
def check_collective_after(fn: Callable) -> None:
    """fn(module) -> the collective the ranks run on `module`'s output: "all_reduce", "all_gather", or
    None where each rank's share of the output is all that the next op needs."""
    for module, want in COLLECTIVES.items():
        got = _call(fn, (module,), f"collective_after({module!r})")
        if got != want:
            raise AssertionError(
                f"collective_after({module!r}) is {got!r}: wrong. Ask what each rank holds after {module} (a slice "
                "of the output, or a partial sum of all of it) and what the next op needs")
    print(f"passed: collective_after is right for all {len(COLLECTIVES)} modules")


@exercise("11", 4, "kv_heads_for")
def check_kv_heads_for(fn: Callable) -> None:
    """fn(rank, size, num_kv_heads) -> (start, stop): the KV heads rank keeps: its even share, or, with
    fewer KV heads than ranks, the one head that its query heads read."""
    from miniinfer.layers.parallel import Shard

    cases = [(r, s, n) for s in (1, 2, 4, 8) for n in (1, 2, 4, 8, 16) if n % s == 0 or s % n == 0 for r in range(s)]
    for rank, size, n in cases:
        heads = Shard(rank, size).kv_heads(n)
        got = _call(fn, (rank, size, n), f"kv_heads_for({rank}, {size}, {n})")
        if tuple(got) != (heads.start, heads.stop):
            raise AssertionError(f"kv_heads_for({rank}, {size}, {n}) is {tuple(got)}, expected "
                                 f"{(heads.start, heads.stop)}")
    print(f"passed: kv_heads_for is right on {len(cases)} (rank, size, KV heads)")


@torch.no_grad()
def simulated_ranks(model, size: int, answers: dict[str, Callable], prompt: list[int], n: int) -> list[int]:
    """n greedy tokens of a Llama-shaped model (the course model) computed as `size` ranks compute
    them, one rank after another in this process: each rank multiplies by only the shards that
    answers["shard_linear"] and answers["kv_heads_for"] cut, looks up its vocabulary rows with
    answers["vocab_lookup"], and the ranks' results meet as answers["collective_after"] says (a sum
    for an all-reduce, a concatenation for an all-gather, nothing for None)."""
    import torch.nn.functional as F

    from miniinfer.model.transformer import add_rms_norm, silu_and_mul

    shard, lookup, after, kv_for = (answers[k] for k in ("shard_linear", "vocab_lookup", "collective_after",
                                                        "kv_heads_for"))
    cfg, D = model.cfg, model.cfg.head_dim
    assert not (cfg.qkv_bias or cfg.qk_norm or cfg.o_bias or cfg.mlp_bias), "a Llama-shaped model only"
    per = -(-cfg.vocab_size // size)
    pad = (0, 0, 0, per * size - cfg.vocab_size)
    emb, lm = F.pad(model.model.embed_tokens.weight, pad), F.pad(model.lm_head.weight, pad)
    ranks = range(size)

    def meet(module: str, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        how = after(module)
        if how == "all_reduce":
            return [sum(parts)] * size  # type: ignore[list-item]
        if how == "all_gather":
            return [torch.cat(parts, dim=-1)] * size
        return parts

    tokens = list(prompt)
    for _ in range(n):
        ids, T = torch.tensor([tokens]), len(tokens)
        cos, sin = rope_cos_sin(torch.arange(T)[None], model.inv_freq)
        h = meet("embed_tokens", [lookup(ids, emb[r * per:(r + 1) * per], r * per) for r in ranks])
        x = [torch.zeros_like(h[0])] * size
        for layer in model.model.layers:
            attn, mlp, n1, n2 = layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm
            q_w, k_w, v_w = attn.qkv_proj.weight.split(attn.sizes)
            qkv, gate_ups = [], []
            for r in ranks:
                hn, x[r] = add_rms_norm(h[r], x[r], n1.weight, n1.eps)
                start, stop = kv_for(r, size, cfg.num_kv_heads)
                w = torch.cat([shard(q_w, r, size, "output"), k_w[start * D:stop * D], v_w[start * D:stop * D]])
                qkv.append(hn @ w.T)
            qkv = meet("qkv_proj", qkv)
            outs = []
            for r in ranks:
                kv = qkv[r].shape[-1] - cfg.num_heads * D // size
                q, k, v = (t.view(1, T, -1, D) for t in qkv[r].split([cfg.num_heads * D // size, kv // 2, kv // 2], -1))
                q, k = apply_rope(q, k, cos, sin)
                o = causal_attention(q, k, v, D ** -0.5).reshape(1, T, -1)
                outs.append(o @ shard(attn.o_proj.weight, r, size, "input").T)
            h = meet("o_proj", outs)
            for r in ranks:
                hn, x[r] = add_rms_norm(h[r], x[r], n2.weight, n2.eps)
                gate, up = mlp.gate_up_proj.weight.chunk(2)
                gate_ups.append(hn @ torch.cat([shard(gate, r, size, "output"), shard(up, r, size, "output")]).T)
            gate_up = meet("gate_up_proj", gate_ups)
            h = meet("down_proj", [silu_and_mul(gate_up[r]) @ shard(mlp.down_proj.weight, r, size, "input").T
                                   for r in ranks])
        norm = model.model.norm
        last = [add_rms_norm(h[r], x[r], norm.weight, norm.eps)[0][0, -1] for r in ranks]
        logits = meet("lm_head", [last[r] @ lm[r * per:(r + 1) * per].T for r in ranks])[0]
        tokens.append(int(logits[:cfg.vocab_size].argmax()))
    return tokens[len(prompt):]


def _histories(gen, case):
    """Random logits [B, V], each row's output-token counts and prompt tokens (as a mask)."""
    B, V = _randint(gen, 1, 6), _randint(gen, 5, 40)
    logits = torch.randn(B, V, generator=gen) * 3
    counts = torch.randint(0, 4, (B, V), generator=gen, dtype=torch.int32) * (torch.rand(B, V, generator=gen) < 0.3)
    in_prompt = torch.rand(B, V, generator=gen) < 0.2
    return logits, counts.int(), in_prompt


@exercise("12", 1, "openai_penalties")
def check_openai_penalties(fn: Callable) -> None:
    """fn(logits [B, V], counts [B, V] int32, presence [B], frequency [B]) -> logits after OpenAI's
    presence and frequency penalties, each row with its own: l - frequency x count - presence x (count > 0)."""
    from miniinfer.worker.logits_processors import penalize

    def inputs(gen, case):
        logits, counts, in_prompt = _histories(gen, case)
        B = logits.shape[0]
        return logits, counts, torch.rand(B, generator=gen) * 4 - 2, torch.rand(B, generator=gen) * 4 - 2

    def ref(logits, counts, presence, frequency):
        none = torch.zeros_like(counts, dtype=torch.bool)
        return penalize(logits, counts, none, presence, frequency, torch.ones_like(presence))
    check("openai_penalties", fn, ref, inputs, cases=12)


@exercise("12", 2, "repetition_penalty")
def check_repetition_penalty(fn: Callable) -> None:
    """fn(logits [B, V], counts [B, V], in_prompt [B, V] bool, penalty [B]) -> logits after transformers'
    repetition penalty: a token seen in the prompt or the output has its logit divided by the row's
    penalty if positive, multiplied if not."""
    from miniinfer.worker.logits_processors import penalize

    def inputs(gen, case):
        logits, counts, in_prompt = _histories(gen, case)
        return logits, counts, in_prompt, torch.rand(logits.shape[0], generator=gen) * 1.8 + 0.1

    def ref(logits, counts, in_prompt, penalty):
        zero = torch.zeros_like(penalty)
        return penalize(logits, counts, in_prompt, zero, zero, penalty)
    check("repetition_penalty", fn, ref, inputs, cases=12)


@exercise("12", 3, "min_p_filter")
def check_min_p_filter(fn: Callable) -> None:
    """fn(logits [B, V], min_p [B], temperature [B]) -> logits with -inf for each token whose probability
    at the row's temperature is below min_p times the row's top token's (the others unchanged)."""
    from miniinfer.worker.logits_processors import min_p_mask

    def inputs(gen, case):
        logits = torch.randn(_randint(gen, 1, 6), _randint(gen, 5, 40), generator=gen) * 3
        B = logits.shape[0]
        return logits, torch.rand(B, generator=gen), torch.rand(B, generator=gen) * 2 + 0.1
    check("min_p_filter", fn, min_p_mask, inputs, cases=12)


@exercise("12", 4, "top_logprobs")
def check_top_logprobs(fn: Callable) -> None:
    """fn(logits [R, V], tokens [R], k) -> (the token's log-probability [R] float32, its rank [R] int64
    (1: the most likely), the k best log-probabilities [R, k] float32 and their token ids [R, k] int64)."""
    from miniinfer.worker.logits_processors import top_logprobs

    def inputs(gen, case):
        logits = torch.randn(_randint(gen, 1, 6), _randint(gen, 5, 40), generator=gen) * 3
        tokens = torch.randint(0, logits.shape[1], (logits.shape[0],), generator=gen)
        return logits, tokens, _randint(gen, 1, min(5, logits.shape[1]))
    check("top_logprobs", fn, top_logprobs, inputs, cases=12)


@exercise("12", 5, "apply_bitmask")
def check_apply_bitmask(fn: Callable) -> None:
    """fn(logits [R, V], bitmask [R, ceil(V / 32)] int32) -> logits with -inf where a token's bit is 0."""
    from miniinfer.worker.logits_processors import apply_bitmask

    def inputs(gen, case):
        V = (33, 64, 95)[case] if case < 3 else _randint(gen, 1, 200)  # a last word part used; all 32 bits
        R = _randint(gen, 1, 5)
        bitmask = torch.randint(-2 ** 31, 2 ** 31, (R, -(-V // 32)), generator=gen, dtype=torch.int64).to(torch.int32)
        return torch.randn(R, V, generator=gen), bitmask
    check("apply_bitmask", fn, apply_bitmask, inputs, cases=12)
