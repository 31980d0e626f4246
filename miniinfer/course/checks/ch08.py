"""The checks of problem set 08 (serving): each answer against the reference, on random inputs.

Hand-written module (chapter 08)."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from miniinfer.course.checks.harness import exercise, randint, run_answer


@exercise("08", 1, "sse_event")
def check_sse_event(fn: Callable) -> None:
    """fn(data) -> the text of one Server-Sent Event carrying `data` (any string, newlines included)."""
    from miniinfer.serving.server import sse_event
    gen = torch.Generator().manual_seed(0)
    cases = ['{"text":"hi"}', "[DONE]", "", "two\nlines", "\n", "data: inside", "a\n\nb"]
    cases += ["".join("ab\n: {}"[randint(gen, 0, 6)] for _ in range(randint(gen, 0, 12))) for _ in range(40)]
    for data in cases:
        got, expected = run_answer(fn, (data,), f"sse_event({data!r})"), sse_event(data)
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
        text = "".join(words[randint(gen, 0, len(words) - 1)] for _ in range(randint(gen, 1, 12)))
        ids = tok(text).input_ids
        case_of = f"case {case + 1} (text {text!r}, token ids {ids})"
        detok, pieces, i = run_answer(cls, (tok,), case_of), [], 0
        while i < len(ids):
            n = 1 if case % 2 else randint(gen, 1, 3)
            piece = run_answer(detok.add, (ids[i:i + n],), f"{case_of}, add({ids[i:i + n]})")
            i += n
            pieces.append(piece)
            so_far = tok.decode(ids[:i])
            where = f"text {text!r}, after {i} of its {len(ids)} token ids (fed {n} at a time)"
            if not isinstance(piece, str) or "\ufffd" in piece:
                raise AssertionError(f"{where}: add returned {piece!r}, a broken character")
            if n == 1 and not so_far.endswith("\ufffd") and "".join(pieces) != so_far:
                raise AssertionError(f"{where}: the ids so far decode to {so_far!r}, but only "
                                     f"{''.join(pieces)!r} was handed out")
        pieces.append(run_answer(detok.finish, (), f"{case_of}, finish()"))
        if "".join(pieces) != text:
            raise AssertionError(f"text {text!r}: the pieces {pieces!r} add up to {''.join(pieces)!r}")
    print("passed: the detokenizer streams 30 texts exactly, without broken characters")


@exercise("08", 3, "stream_request")
def check_stream_request(fn: Callable) -> None:
    """fn(outputs: asyncio.Queue, abort) -> an async generator of the outputs taken from the queue, up
    to and including the first finished one; abort() is called once if the stream ends before that."""
    import asyncio
    import concurrent.futures
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
