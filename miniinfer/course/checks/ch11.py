"""The checks of problem set 11 (tensor parallelism): each layer run on two real ranks (gloo processes)
beside the package's, and the last part: the engine at tensor_parallel_size=2 built of the student's layers.

Hand-written module (chapter 11)."""

from __future__ import annotations

import atexit
import datetime
import functools
import itertools
import multiprocessing
import multiprocessing.connection
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from miniinfer.course.checks.harness import (
    AnswerError,
    check_tokens,
    differs,
    engine_with,
    exercise,
    failing,
    randint,
    run_answer,
    saved_checkpoint,
    shape_differs,
    unanswered,
    your_answers,
)
from miniinfer.engine.processes import process_context

RANKS = 2
WAIT = 30  # seconds a collective waits for a rank that never joins it (an answer that skips one)


def _serve(rank: int, init_file: str, conn) -> None:
    """A rank of the checks: runs fn(rank, *args) for each job sent, until the pipe closes. A job that
    raises ends the process, so that the other rank's collectives with it fail instead of waiting."""
    import torch.distributed as dist

    from miniinfer.worker.worker import failure
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=RANKS,
                            timeout=datetime.timedelta(seconds=WAIT))
    while True:
        try:
            fn, args = pickle.loads(conn.recv_bytes())
        except (EOFError, KeyboardInterrupt):  # the notebook's kernel is gone or interrupted
            return
        try:
            result = ("ok", fn(rank, *args))
        except BaseException as err:
            conn.send(("error", failure(err)))  # the engine's ranks' report: the error and where it came from
            os._exit(1)
        conn.send(result)


class Ranks:
    """RANKS spawned processes in one gloo group, started on first use and kept for the next checks."""

    def __init__(self):
        ctx = process_context()
        fd, self.init_file = tempfile.mkstemp(prefix="miniinfer-checks-")
        os.close(fd)
        self.conns, self.procs = [], []
        for rank in range(RANKS):
            conn, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, self.init_file, child), daemon=True,
                               name=f"miniinfer-check-rank{rank}")
            proc.start()
            child.close()
            self.conns.append(conn)
            self.procs.append(proc)

    def run(self, fn: Callable, *args) -> list:
        """fn(rank, *args) on every rank (fn and args sent by value: a class from a notebook too), each
        rank's result; RuntimeError with each failed rank's error."""
        import cloudpickle
        job = cloudpickle.dumps((fn, args))
        for conn in self.conns:
            conn.send_bytes(job)
        results: list = []
        errors: list[str] = []
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs)):
            multiprocessing.connection.wait([conn, proc.sentinel], timeout=2 * WAIT)
            try:
                status, value = conn.recv() if conn.poll() else ("error", f"no answer in {2 * WAIT} s")
            except (EOFError, OSError):
                status, value = "error", f"the process ended (exit code {proc.exitcode})"
            (errors if status == "error" else results).append(f"rank {rank}: {value}" if status == "error" else value)
        if errors:
            self.close()
            raise RuntimeError("; ".join(errors))
        return results

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
        Path(self.init_file).unlink(missing_ok=True)
        if _ranks.get("now") is self:
            del _ranks["now"]


_ranks: dict[str, Ranks] = {}


def close_ranks() -> None:
    """End the checks' rank processes, if they run (the next check starts them again)."""
    if "now" in _ranks:
        _ranks["now"].close()


atexit.register(close_ranks)


def on_ranks(fn: Callable, *args) -> list:
    """fn(rank, *args) on each of the checks' RANKS ranks: its results, in rank order."""
    if "now" not in _ranks:
        _ranks["now"] = Ranks()
    return _ranks["now"].run(fn, *args)


@functools.cache
def _folder() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="miniinfer-checks-")  # removed when this process ends


_saved = itertools.count()


def _checkpoint(tensors: dict[str, torch.Tensor]) -> Path:
    """The tensors saved as safetensors, for the ranks to open lazily as the loader does."""
    from safetensors.torch import save_file
    path = Path(_folder().name) / f"case{next(_saved)}.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    return path


def _slices(path: Path, names: list[str]) -> list:
    from safetensors import safe_open
    f = safe_open(str(path), framework="pt")
    return [f.get_slice(n) for n in names]


def _compare(where: str, inputs: tuple, named: list[tuple[str, torch.Tensor | None, object]]) -> None:
    """Each (what, expected, received) equal (floats within float32's rounding of a sum in another order)."""
    __tracebackhide__ = True
    for what, expected, got in named:
        if expected is None:
            continue
        wrong: str | None
        if not isinstance(got, torch.Tensor):
            wrong = f"  expected a tensor, received {type(got).__name__}"
        elif got.shape != expected.shape:
            wrong = shape_differs(expected, got)
        else:
            wrong = differs(got, expected, 1e-5, 1e-5)
        if wrong is not None:
            raise AssertionError(f"{failing(f'{where}: {what}', inputs)}\n{wrong}")


def _column_inputs(gen: torch.Generator, case: int) -> tuple:
    """1 to 3 packed pieces (q, k, v or gate, up) of rows divisible by the ranks, a rank, and the rows
    of each piece it keeps: an even share, or one head's (a replicated KV head)."""
    K, size = randint(gen, 1, 7), (2, 4, 3)[case % 3]
    pieces = [size * randint(gen, 1, 4) for _ in range(randint(gen, 1, 3))]
    rank = randint(gen, 0, size - 1)
    rows = []
    for n in pieces:
        if case % 4 == 3:  # a piece of one "head" of n // size rows, not the rank's own
            head = randint(gen, 0, size - 1)
            rows.append(slice(head * n // size, (head + 1) * n // size))
        else:
            rows.append(slice(rank * n // size, (rank + 1) * n // size))
    name = "bias" if case % 5 == 4 else "weight"
    return K, rows, pieces, name, [torch.randn(n, *((K,) if name == "weight" else ()), generator=gen) for n in pieces]


# The cases of check_column whose checkpoint holds one piece of another shape: (which piece, what differs).
MISSHAPEN = {5: (-1, "rows"), 11: (-1, "columns"), 17: (0, "rows"), 19: (-1, "rows"), 23: (0, "columns")}


def _misshapen(gen: torch.Generator, tensors: list, which: int, what: str) -> tuple[int, list]:
    """tensors with piece `which` replaced by one of more rows (or columns), whose slices still read."""
    t = tensors[which]
    shape = (t.shape[0] + 2, *t.shape[1:]) if what == "rows" else (t.shape[0], t.shape[1] + 1)
    tensors = list(tensors)
    tensors[which] = torch.randn(*shape, generator=gen)
    return which % len(tensors), tensors


@exercise("11", 1, "YourColumn")
def check_column(cls: type) -> None:
    """cls(in_features, rows, sizes, bias).load_weight(name, tensors) -> of each packed piece i
    (tensors[i], sizes[i] rows, read lazily from a safetensors file) the rows rows[i], in order; a
    ValueError when a piece is not the shape the layer implies ([sizes[i], in_features], or [sizes[i]])."""
    from miniinfer.layers.parallel import ColumnParallelLinear
    cases = 24
    gen = torch.Generator().manual_seed(0)
    for case in range(cases):
        K, rows, sizes, name, tensors = _column_inputs(gen, case)
        which = None
        if case in MISSHAPEN:
            which, tensors = _misshapen(gen, tensors, *MISSHAPEN[case])
        path = _checkpoint({f"piece{i}": t for i, t in enumerate(tensors)})
        inputs = (K, rows, sizes, name, tensors)
        where = f"YourColumn({K}, rows={rows}, sizes={sizes}, bias=True).load_weight({name!r}, ...), case {case + 1} " \
                f"of {cases}"
        names = [f"piece{i}" for i in range(len(sizes))]
        layer = run_answer(cls, (K, rows, sizes, True), where, inputs)
        if which is not None:
            got = run_answer(_value_error(layer.load_weight), (name, _slices(path, names)), where, inputs)
            if got is not None:
                implied = [sizes[which], K] if name == "weight" else [sizes[which]]
                raise AssertionError(f"{failing(where, inputs)}\n  piece {which} has shape "
                                     f"{list(tensors[which].shape)}, the layer implies {implied}: expected "
                                     f"ValueError\n  received {_describe_result(got)}")
            continue
        expected = ColumnParallelLinear(K, rows, sizes, True).load_weight(name, _slices(path, names))
        got = run_answer(layer.load_weight, (name, _slices(path, names)), where, inputs)
        _compare(where, inputs, [("the tensor it returns", expected, got)])
    print(f"passed: YourColumn.load_weight keeps the package's rows on {cases - len(MISSHAPEN)} random layers and "
          f"refuses {len(MISSHAPEN)} checkpoints with a piece of another shape")


def _value_error(fn: Callable) -> Callable:
    """fn, returning None where it raised ValueError (what a misshapen checkpoint must get), and any
    other error it raised (a NotImplementedError raised on)."""
    def run(*args):
        try:
            return fn(*args)
        except ValueError:
            return None
        except Exception as err:
            if unanswered(err):
                raise
            return err
    return run


def _describe_result(got: object) -> str:
    if isinstance(got, Exception):
        return f"{type(got).__name__}: {got}"
    return f"a tensor of shape {list(got.shape)}" if isinstance(got, torch.Tensor) else f"{type(got).__name__}"


def _load(layer: Any, path: Path, names: dict[str, str]) -> tuple[dict[str, torch.Tensor], bool]:
    """layer's parameters from the checkpoint at path through its load_weight (names: parameter -> the
    checkpoint's tensor), as the loader does: what load_weight returned, by parameter, and whether
    every rank's fit its layer (run in the ranks: they agree, so that all run the forward or none)."""
    import torch.distributed as dist
    loaded = {param: layer.load_weight(param, _slices(path, [key])) for param, key in names.items()}
    fits = all(isinstance(v, torch.Tensor) and v.shape == getattr(layer, p).shape for p, v in loaded.items())
    everyone = torch.tensor(int(fits))
    dist.all_reduce(everyone, op=dist.ReduceOp.MIN)
    if everyone.item():
        with torch.no_grad():
            for param, value in loaded.items():
                getattr(layer, param).copy_(value)
    return loaded, bool(everyone.item())


def _row_on_rank(rank: int, cls: type, path: Path, K: int, N: int, bias: bool, x: torch.Tensor) -> list:
    """The rank's row-parallel layer, the package's and cls: what load_weight returned, and forward's
    output on the rank's input columns (None where a rank's weights did not fit its layer)."""
    from miniinfer.layers.parallel import RowParallelLinear, Shard
    columns = Shard(rank, RANKS).part(K)
    names = {"weight": "w", **({"bias": "b"} if bias else {})}
    out = []
    for make in (RowParallelLinear, cls):
        layer = make(columns, K, N, bias, rank == 0)
        loaded, fits = _load(layer, path, names)
        with torch.no_grad():
            out.append((loaded, layer(x[:, columns]) if fits else None))
    return out


@exercise("11", 2, "YourRow")
def check_row(cls: type) -> None:
    """cls(columns, in_size, out_features, bias, first) on two ranks: load_weight(name, tensors) -> the
    rank's input columns of the weight, the bias on the first rank (zeros on the others); forward(x
    [T, its columns]) -> the whole layer's output x_all @ W.T + b, on every rank (an all-reduce)."""
    cases = 10
    gen = torch.Generator().manual_seed(1)
    for case in range(cases):
        K, N, T = RANKS * randint(gen, 1, 6), randint(gen, 1, 9), randint(gen, 1, 5)
        bias = case % 3 != 2
        w, b, x = (torch.randn(N, K, generator=gen), torch.randn(N, generator=gen) * 3,
                   torch.randn(T, K, generator=gen))
        path = _checkpoint({"w": w, "b": b})
        inputs = (w, b if bias else None, x)
        where = f"YourRow over {RANKS} ranks, weight [{N}, {K}]{', with a bias' if bias else ''}, x [{T}, {K}], " \
                f"case {case + 1} of {cases}"
        ranks = run_answer(on_ranks, (_row_on_rank, cls, path, K, N, bias, x), where, inputs)
        _compare(where, inputs, [(f"rank {rank}'s {p} from load_weight", ref[p], loaded[p])
                                 for rank, ((ref, _), (loaded, _)) in enumerate(ranks) for p in ref])
        _compare(where, inputs, [(f"rank {rank}'s forward(its {K // RANKS} columns of x)", ref_out, got_out)
                                 for rank, ((_, ref_out), (_, got_out)) in enumerate(ranks)])
    print(f"passed: YourRow loads the package's shares and gives the whole output on both ranks ({cases} layers)")


def _vocab_on_rank(rank: int, classes: tuple[type, type], path: Path, V: int, H: int, x: torch.Tensor) -> list:
    """The rank's share of a vocabulary layer of each class (the package's, then the student's): what
    its load_weight returned, and its forward on x (ids, or hidden states; None where a rank's rows
    did not fit its layer)."""
    from miniinfer.layers.parallel import Shard
    out = []
    for make in classes:
        layer = make(V, H, Shard(rank, RANKS))
        loaded, fits = _load(layer, path, {"weight": "w"})
        with torch.no_grad():
            out.append((loaded["weight"], layer(x) if fits else None))
    return out


def _vocab_inputs(gen: torch.Generator, case: int, ids: bool) -> tuple:
    """A vocabulary of V rows (odd ones padded on the last rank), and ids [B, T] with the ranks' first
    and last rows among them, or hidden states [B, T, H]."""
    V, H, B, T = randint(gen, 1, 23), randint(gen, 1, 6), randint(gen, 1, 3), randint(gen, 4, 7)
    V += RANKS * (case == 0)
    w = torch.randn(V, H, generator=gen)
    if not ids:
        return V, H, w, torch.randn(B, T, H, generator=gen)
    x = torch.randint(0, V, (B, T), generator=gen)
    per = -(-V // RANKS)
    x[0, :4] = torch.tensor([0, min(per - 1, V - 1), min(per, V - 1), V - 1])
    return V, H, w, x


def _check_vocab(cls: type, base: type, what: str, ids: bool, cases: int) -> None:
    __tracebackhide__ = True
    gen = torch.Generator().manual_seed(2 + ids)
    for case in range(cases):
        V, H, w, x = _vocab_inputs(gen, case, ids)
        path = _checkpoint({"w": w})
        inputs = (w, x)
        where = f"{cls.__name__} of {V} rows over {RANKS} ranks ({-(-V // RANKS)} a rank), {what} " \
                f"{list(x.shape)}, case {case + 1} of {cases}"
        ranks = run_answer(on_ranks, (_vocab_on_rank, (base, cls), path, V, H, x), where, inputs)
        _compare(where, inputs, [(f"rank {rank}'s rows from load_weight('weight', ...)", ref, loaded)
                                 for rank, ((ref, _), (loaded, _)) in enumerate(ranks)])
        _compare(where, inputs, [(f"rank {rank}'s forward", expected, got)
                                 for rank, ((_, expected), (_, got)) in enumerate(ranks)])


@exercise("11", 3, "YourEmbedding")
def check_embedding(cls: type) -> None:
    """cls(vocab_size, hidden_size, shard) on two ranks: load_weight("weight", [w]) -> the rank's
    per_rank rows of w from start, the last share padded with zero rows; forward(ids [B, T]) -> [B, T,
    H]: the whole embedding of every id, on every rank (each rank looks up the ids in its rows, zeros
    for the others, and an all-reduce adds them up)."""
    from miniinfer.layers.parallel import VocabParallelEmbedding
    _check_vocab(cls, VocabParallelEmbedding, "ids", True, 10)
    print("passed: YourEmbedding loads the package's rows and gives the whole embedding on both ranks "
          "(10 vocabularies)")


@exercise("11", 4, "YourLMHead")
def check_lm_head(cls: type) -> None:
    """cls(vocab_size, hidden_size, shard).forward(h [B, T, H]) on two ranks -> [B, T, vocab_size]: the
    logits of the whole vocabulary, on every rank (each rank's rows, all-gathered, the padding cut)."""
    from miniinfer.layers.parallel import ParallelLMHead
    _check_vocab(cls, ParallelLMHead, "hidden states", False, 10)
    print("passed: YourLMHead gives the whole vocabulary's logits on both ranks (10 vocabularies)")


@exercise("11", 5, "YourShard")
def check_shard(cls: type) -> None:
    """cls(rank, size).part(n) -> slice: rank's even share of n things (n a multiple of size), in rank
    order; cls(rank, size).kv_heads(n) -> slice: the KV heads rank keeps of n: its even share, or, with
    fewer KV heads than ranks, the one head that its query heads read."""
    from miniinfer.layers.parallel import Shard
    parts = [(r, s, n) for s in (1, 2, 3, 4, 8) for n in (s, 2 * s, 3 * s, 7 * s, 96) if n % s == 0 for r in range(s)]
    heads = [(r, s, n) for s in (1, 2, 4, 8) for n in (1, 2, 4, 8, 16) if n % s == 0 or s % n == 0 for r in range(s)]
    for method, cases in (("part", parts), ("kv_heads", heads)):
        for rank, size, n in cases:
            expected = getattr(Shard(rank, size), method)(n)
            where = f"YourShard({rank}, {size}).{method}({n})"
            got = run_answer(lambda r, s, n, m=method: getattr(cls(r, s), m)(n), (rank, size, n), where)
            if not isinstance(got, slice) or (got.start, got.stop, got.step) != (expected.start, expected.stop, None):
                raise AssertionError(f"{where}\n  expected {expected}\n  received {got!r}")
    print(f"passed: YourShard.part is right on {len(parts)} (rank, size, n) and kv_heads on {len(heads)} "
          "(rank, size, KV heads)")


def small_checkpoint(kv_heads: int) -> str:
    """A Llama-shaped checkpoint with random weights, 4 query heads and `kv_heads` KV heads (one: each of
    two ranks must keep it whole, replicated; four: two a rank), biases on every projection (the
    row-parallel ones' join once) and a vocabulary of 301 rows (151 a rank, one of padding)."""
    return saved_checkpoint(f"{kv_heads}-kv-heads", functools.partial(_llama, kv_heads))


def _llama(kv_heads: int):
    import transformers
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, head_dim=16, attention_bias=True, mlp_bias=True, initializer_range=0.2))


# The models of the last part: the course model's 2 KV heads are one a rank; the small ones have fewer
# KV heads than ranks (replicated) and more (two a rank).
PARALLEL_MODELS: dict[str, tuple[int | None, list]] = {
    "the course model": (None, ["def fibonacci(n):", "class Stack:\n    def push(self,"]),
    "a model with one KV head": (1, [[5, 17, 99, 200, 3], [300, 1, 150, 151]]),
    "a model with four KV heads": (4, [[5, 17, 99, 200, 3], [300, 1, 150, 151]])}


@exercise("11", 6, "your_layers")
def check_parallel_engine(layers) -> None:
    """The last part: the engine at tensor_parallel_size=2 built of `layers` (a ParallelLayers of the
    student's classes, sent to two gloo worker processes) gives the greedy tokens of one process, on
    the course model and on models with one and with four KV heads; every block comes back."""
    __tracebackhide__ = True
    import miniinfer as mi
    greedy = mi.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with your_answers("11"):
        for name, (kv_heads, prompts) in PARALLEL_MODELS.items():
            folder = small_checkpoint(kv_heads) if kv_heads else None
            one = mi.LLMEngine(mi.EngineConfig(model=folder))
            expected = [o.token_ids for o in one.generate(prompts, greedy, use_tqdm=False)]
            config = mi.EngineConfig(model=folder, tensor_parallel_size=2)
            try:
                two = engine_with(config, parallel=layers)
                try:
                    got = [o.token_ids for o in two.generate(prompts, greedy, use_tqdm=False)]
                    bm = two.block_manager
                    back = bm.num_free_blocks == bm.num_blocks
                finally:
                    two.close()
            except RuntimeError as err:  # a rank's error, with the function that raised it
                raise AnswerError(f"{name}: two ranks of your layers failed\n  {err}") from err
            check_tokens([f"{name}, prompt {i + 1} of {len(prompts)} ({p!r}), two ranks of your layers against one "
                          "process" for i, p in enumerate(prompts)], expected, got)
            if not back:
                raise AssertionError(f"{name}: {bm.num_blocks - bm.num_free_blocks} blocks were not given back")
    print("passed: two ranks of your layers give one process's tokens on the course model and on models "
          "with one and with four KV heads; every block back")
