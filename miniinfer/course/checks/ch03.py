"""The checks of problem set 03 (paged blocks): each answer against the reference, on random inputs.

Hand-written module (chapter 03)."""

from __future__ import annotations

from typing import Callable

import torch

from miniinfer.core.block_manager import BlockManager, OutOfBlocks
from miniinfer.course.checks.harness import (
    AnswerError,
    blocks_back,
    check,
    check_tokens,
    exercise,
    named,
    randint,
    random_block_size,
    run_answer,
    show,
    unanswered,
    your_answers,
)
from miniinfer.worker.paged_cache import PagedKVCache, gather_kv, slot_mapping


@exercise("03", 3, "slot_mapping")
def check_slot_mapping(fn: Callable) -> None:
    """fn(block_table: list[int], start, num_tokens, block_size) -> LongTensor [num_tokens] of slots."""
    def inputs(gen, case):
        bs, n_blocks = random_block_size(gen, case, 8), randint(gen, 1, 6)
        table = torch.randperm(50, generator=gen)[:n_blocks].tolist()
        start = randint(gen, 0, bs * n_blocks - 1)
        return table, start, randint(gen, 1, bs * n_blocks - start), bs
    check("slot_mapping", fn, slot_mapping, inputs)


@exercise("03", 4, "gather_kv")
def check_gather_kv(fn: Callable) -> None:
    """fn(pool [num_blocks, block_size, Hk, D], block_tables [B, max_blocks], length) -> [B, length, Hk, D]."""
    def inputs(gen, case):
        nb, bs, Hk, D = randint(gen, 4, 30), random_block_size(gen, case, 8), randint(gen, 1, 3), randint(gen, 1, 9)
        B, width = randint(gen, 1, 3), randint(gen, 1, 4)
        tables = torch.randint(0, nb, (B, width), generator=gen)
        return torch.randn(nb, bs, Hk, D, generator=gen), tables, randint(gen, 1, width * bs)
    check("gather_kv", fn, gather_kv, inputs)


_OPS = {"allocate": "allocate", "append": "append_token", "free": "free"}


def _run_ops(cls, ops: list[tuple], num_blocks: int, block_size: int, case: int) -> None:
    """Run the same operations on the student's class and the reference BlockManager; they must
    agree on which calls fail, on free counts and on table lengths, and tables must not overlap."""
    where = f"case {case + 1} (num_blocks={num_blocks}, block_size={block_size})"
    mine = run_answer(cls, (num_blocks, block_size), where)
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
                if unanswered(err):
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
        kind, seq = kinds[randint(gen, 0, len(kinds) - 1)], randint(gen, 0, 4)
        ops.append((kind, seq, randint(gen, 1, 20)) if kind == "allocate" else (kind, seq))
    return ops


def _check_block_ops(cls, with_append: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    kinds = ["allocate", "free"] + ["append"] * 3 * with_append
    cases = 30
    for case in range(cases):
        _run_ops(cls, _random_ops(gen, kinds), randint(gen, 4, 16), random_block_size(gen, case), case)
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


PROMPTS = ["def add(a, b):\n", "class Stack:\n", "import os\n\n\ndef"]


@exercise("03", 5, "paged_generation", argument="MyBlockManager, slot_mapping, gather_kv")
def check_paged_generation(cls, slots: Callable, gather: Callable) -> None:
    """The last part: `generate_paged` on cls(num_blocks, 3), a pool just big enough for three prompts
    of 16 new tokens each, with chapter 03's backend writing through `slots` (slot_mapping) and
    reading through `gather` (gather_kv), gives the static cache's greedy tokens and ends with every
    block free."""
    __tracebackhide__ = True
    import miniinfer as mi
    model, tok = mi.load_model(), mi.load_tokenizer()
    prompts = [tok(text).input_ids for text in PROMPTS]
    params = mi.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    pool = sum(-(-(len(p) + params.max_tokens) // 3) for p in prompts)
    yours = type("YourPagedKVCache", (PagedKVCache,), {"slot_mapping": staticmethod(slots),
                                                       "gather_kv": staticmethod(gather)})
    with your_answers("03"):
        bm = cls(pool, 3)
        got = mi.generate_paged(model, prompts, params, block_manager=bm, backend=yours)
    show(tok, [p + g for p, g in zip(prompts, got)])
    check_tokens(named(PROMPTS, "blocks of 3"),
                 [mi.generate_cached(model, p, params) for p in prompts], got)
    blocks_back(bm, f"{len(PROMPTS)} prompts in a pool of {pool} blocks of 3")
    print(f"passed: the static cache's greedy tokens on {len(PROMPTS)} prompts, all {pool} blocks free at the end")
