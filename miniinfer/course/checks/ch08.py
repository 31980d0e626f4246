"""The checks of problem set 08 (serving): each answer against the reference, on random inputs.

Hand-written module (chapter 08)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
from typing import Callable

import torch

from miniinfer.course.checks.harness import check_tokens, exercise, named, randint, run_answer, your_answers


def _in_a_thread(coro):
    """asyncio.run(coro) in a thread of its own: a notebook's event loop already runs in this one."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


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

    for n, stop, expected in [(1, None, ([0], 0)), (5, None, ([0, 1, 2, 3, 4], 0)), (5, 2, ([0, 1], 1)),
                              (3, 1, ([0], 1)), (4, 4, ([0, 1, 2, 3], 0))]:
        got = _in_a_thread(read(n, stop))
        if got != expected:
            raise AssertionError(f"{n} outputs, the client {'reads all' if stop is None else f'leaves after {stop}'}: "
                                 f"got tokens {got[0]} and {got[1]} abort(s); expected {expected[0]} and "
                                 f"{expected[1]}")
    if (aborts := _in_a_thread(cancelled())) != 1:
        raise AssertionError(f"a client cancelled while waiting: {aborts} abort(s); expected 1")
    print("passed: the stream aborts exactly when its client leaves early")


def _client_reads(stream: str) -> list[str]:
    """The data of each event in a Server-Sent Events stream, as a client reads them."""
    events = [block for block in stream.split("\n\n") if block.strip()]
    return ["\n".join(line.removeprefix("data:").removeprefix(" ") for line in block.split("\n")
                      if line.startswith("data:")) for block in events]


PROMPTS = ["def add(a, b):\n", "class Stack:\n"]
LEAVES_AFTER = 3  # outputs the second client reads


@exercise("08", 4, "YourEngine", argument="YourEngine, sse_event, Detokenizer")
def check_streaming(engine_cls: type, sse_event: Callable, detokenizer: type) -> None:
    """The last part: engine_cls (an AsyncLLMEngine whose stream is the student's stream_request)
    serves two clients at once. The first reads to the end, its text sent as events made by sse_event
    from detokenizer's pieces: the package's greedy tokens, and events that parse back to their text.
    The second leaves after LEAVES_AFTER outputs: its tokens so far are the package's, and its abort
    gives every block back while the first goes on."""
    __tracebackhide__ = True
    import json

    import miniinfer as mi
    from miniinfer.engine.core import AbortRequest
    model, tok = mi.load_model(), mi.load_tokenizer()
    params = mi.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [mi.generate_cached(model, tok(p).input_ids, params) for p in PROMPTS]

    async def read_to_the_end(engine):
        detok, events, tokens = detokenizer(tok), [], []
        async for out in engine.generate(PROMPTS[0], params):
            tokens += out.new_token_ids
            events.append(sse_event(json.dumps({"text": detok.add(out.new_token_ids)})))
        return tokens, events + [sse_event(json.dumps({"text": detok.finish()})), sse_event("[DONE]")]

    async def leave_early(engine):
        tokens: list[int] = []
        outputs = 0
        # Too long to finish before it leaves, however the engine's steps and this client's reads interleave.
        long = dataclasses.replace(params, max_tokens=200)
        async with contextlib.aclosing(engine.generate(PROMPTS[1], long)) as outs:
            async for out in outs:
                tokens, outputs = tokens + out.new_token_ids, outputs + 1
                if outputs == LEAVES_AFTER:
                    break
        return tokens

    async def two_clients():
        engine = engine_cls(mi.LLMEngine(mi.EngineConfig(num_blocks=64, block_size=4), model=model, tokenizer=tok))
        drops, send = [], engine.client.send  # the requests the engine is told to drop, as they are sent

        def counted(message):
            if isinstance(message, AbortRequest):
                drops.append(message.request_id)
            send(message)
        engine.client.send = counted
        try:
            (tokens, events), left = await asyncio.gather(read_to_the_end(engine), leave_early(engine))
            for _ in range(200):  # the engine takes the abort between two steps
                if engine.stats.running + engine.stats.waiting == 0:
                    break
                await asyncio.sleep(0.01)
            return tokens, events, left, engine.stats.blocks_used, len(drops)
        finally:
            engine.close()

    with your_answers("08"):
        tokens, events, left, blocks_used, drops = _in_a_thread(two_clients())
    print("".join(events[:3]) + "...\n" + "".join(events[-2:]), end="")
    check_tokens(named(PROMPTS[:1], "read to the end"), expected[:1], [tokens])
    datas = _client_reads("".join(events))
    if len(datas) != len(events) or datas[-1] != "[DONE]":
        raise AssertionError(f"a client reading the {len(events)} events as one stream finds {len(datas)} events, "
                             f"the last {datas[-1:]!r}: each must end with a blank line, the last carry [DONE]")
    text = "".join(json.loads(d)["text"] for d in datas[:-1])
    if text != tok.decode(tokens):
        raise AssertionError(f"the events' text is not the tokens' text\n  expected {tok.decode(tokens)!r}\n"
                             f"  received {text!r}")
    check_tokens([f"prompt 2 of 2 ({PROMPTS[1]!r}), left after {LEAVES_AFTER} outputs"],
                 [expected[1][:len(left)]], [left[:len(expected[1])]])
    if drops != 1:
        raise AssertionError(f"the second client left after {LEAVES_AFTER} outputs, the first read to the end: the "
                             f"engine was told to drop {drops} requests, expected 1 (the second's)")
    if blocks_used:
        raise AssertionError(f"the second client left after {LEAVES_AFTER} outputs, and {blocks_used} blocks are "
                             "still in use after both clients are done: its request was not aborted")
    print(f"passed: the package's tokens and text as events; the client that left after {len(left)} tokens "
          "gave its blocks back")
