"""Hand-written, not from a notebook: HTTP plumbing that chapter 08 runs but does not teach.

An OpenAI-compatible HTTP server over AsyncLLMEngine (FastAPI + uvicorn): /v1/models,
/v1/completions and /v1/chat/completions (Server-Sent Events or whole), /health, /metrics. The
path a request shares across endpoints is here: the door's limits, each choice's stream (detokenized,
cut at stop strings), the response whole or as events, the app and its shutdown. What differs per
endpoint, and the body's mapping onto SamplingParams, is in `openai/`. Hand-written module (chapter 08);
`miniinfer serve` runs it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import sys
import time
import uuid
from typing import AsyncGenerator, AsyncIterator, Awaitable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from miniinfer.core.config import EngineConfig
from miniinfer.core.sampling_params import SamplingParams, StructuredOutput
from miniinfer.core.sequence import RequestOutput
from miniinfer.engine.async_engine import AsyncLLMEngine, Connects
from miniinfer.engine.core import EngineClosed, EngineStopped, RequestFailed, Shutdown
from miniinfer.serving.detokenize import IncrementalDetokenizer
from miniinfer.serving.openai.chat import CHAT_MAX_TOKENS, Chat
from miniinfer.serving.openai.completions import Completions, TextOffsets
from miniinfer.serving.openai.metrics import metrics
from miniinfer.serving.openai.openapi import openapi_schema
from miniinfer.serving.openai.params import (
    APIError,
    check_model,
    load_body,
    param_of,
    sampling_params,
    structure,
    validate,
)
from miniinfer.serving.openai.schema import SamplingFields

ENDPOINTS: list[Completions] = [Completions(), Chat()]

def sse_event(data: str) -> str:
    """One Server-Sent Event carrying `data`: a `data:` line per line of it, then a blank line."""
    return "".join(f"data: {line}\n" for line in data.split("\n")) + "\n"


def text_token_ids(out: RequestOutput, eos: set[int]) -> list[int]:
    """An output's new tokens that belong to the text: not the end-of-sequence token that finished it."""
    new = out.new_token_ids
    return new[:-1] if out.finish_reason == "stop" and new and new[-1] in eos else new


DISCONNECT_POLL_S = 0.25  # how often a whole request checks that its client is still there
# A request body larger than this is refused (413) before it is read: a 20 MB prompt used to hold
# the event loop for 25 s while it was tokenized, only to be refused for the context anyway.
MAX_BODY_MB = 4
# A body up to this size is parsed on the event loop: it takes well under a millisecond, less than the
# hand-over of the interpreter lock to a worker thread and back while the loop is busy streaming.
INLINE_BODY_BYTES = 32 * 1024
SHUTDOWN_TIMEOUT_S = 5.0  # after Ctrl-C (or SIGTERM), requests in flight have this long to finish
GRACE_S = 3  # then, once the engine has ended them, responses still open this long are cancelled
RETRY_AFTER_S = 5  # what a request refused while the server shuts down is told (Retry-After)
# A connection that has not sent a whole request's headers this long after it opened (or after its
# last response) is closed: uvicorn times out only a connection idle between requests, and one that
# connected and sent nothing, or half a header, held its socket forever.
HEADER_TIMEOUT_S = 10.0
# A grammar compiles at the door within this, or the request is refused: the engine compiles it again
# (beside its loop), and a schema of 2,000 properties held a core for 25 s each time.
GRAMMAR_COMPILE_S = 2.0
GRAMMAR_COMPILES = 4  # compiles past that limit (each runs on to its end) the door lets run at once


def shutting_down(what: str) -> APIError:
    """503 for a request the server will not finish because it is shutting down (Ctrl-C or SIGTERM)."""
    return APIError(f"the server is shutting down: {what}; try again later, or another server", 503,
                    type="server_error", code="shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)})


def engine_stopped() -> APIError:
    """503 for a request the engine can no longer take: its process ended, or it could run no step again
    (a tensor-parallel rank died). /health says so too; the server's log says why."""
    return APIError("the engine has stopped: it serves no new request", 503, type="server_error",
                    code="engine_stopped")


def generation_failed(err: Exception, what: str) -> APIError:
    """The answer to a request that failed after it started: the server shut down before `what`
    finished (503), its own sampling values left no token (400), or the engine failed (500)."""
    if isinstance(err, EngineClosed):
        return shutting_down(f"the {what} was not finished within its shutdown timeout")
    if isinstance(err, RequestFailed):
        return APIError(f"generation failed: {err}")
    return APIError(f"generation failed: {err}", 500, type="server_error")


@dataclasses.dataclass(frozen=True, slots=True)
class ChoiceDelta:
    """What one engine output adds to one choice of a response."""
    index: int  # the choice's place in the response (prompt i, choice j of n: i * n + j)
    text: str  # its new text, stop strings cut
    finish_reason: str | None
    tokens: int  # the choice's tokens so far
    logprobs: list | None  # the new tokens' TokenLogprobs (an echoed prompt's first token: its bare id)


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """The server's own limits, beside the engine's (`miniinfer serve --help` names each flag)."""
    chat_max_tokens: int = CHAT_MAX_TOKENS
    max_body_mb: float = MAX_BODY_MB
    # A request's sequences (prompts x n), and the tokens they may hold together (each prompt's and
    # max_tokens, times n); None: the engine's max_num_seqs, and its KV pool's tokens. One request of
    # 128 prompts x n=256 (1.2 KB) once made 32,768 sequences and held the engine for everyone else.
    max_seqs_per_request: int | None = None
    max_tokens_per_request: int | None = None
    shutdown_timeout: float = SHUTDOWN_TIMEOUT_S
    header_timeout: float = HEADER_TIMEOUT_S


class StopStrings:
    """Cuts streamed text at the first stop string. Text that could be the start of one is held back
    until the next piece shows whether it is, so no part of a stop string is ever sent."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.hold = max(map(len, stops), default=1) - 1
        self.pending = ""

    def feed(self, piece: str, final: bool) -> tuple[str, bool]:
        """The text that can be sent now, and whether a stop string was found (the text ends there)."""
        if not self.stops:  # the common case, once per streamed token
            return piece, False
        self.pending += piece
        found = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if found:
            return self.pending[:min(found)], True
        cut = len(self.pending) if final else max(len(self.pending) - self.hold, 0)
        text, self.pending = self.pending[:cut], self.pending[cut:]
        return text, False


class Server:
    """The OpenAI HTTP API over one AsyncLLMEngine: requests in, choices out, streamed or whole."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str, options: ServerOptions = ServerOptions()):
        self.engine, self.model_name, self.chat_max_tokens = engine, model_name, options.chat_max_tokens
        self.max_body_bytes = int(options.max_body_mb * 2 ** 20)
        self.tokenizer = engine.tokenizer
        limits = engine.limits
        self.max_model_len = limits.max_model_len
        self.vocab_size = limits.vocab_size
        self.max_seqs = options.max_seqs_per_request or engine.max_num_seqs
        self.max_tokens = options.max_tokens_per_request or limits.num_blocks * limits.block_size
        self.draining = False  # shutting down: new requests get 503
        self.slow_grammars: set[int] = set()  # their hashes: a client must not grow this by 4 MB a request
        self.grammar_pool = concurrent.futures.ThreadPoolExecutor(GRAMMAR_COMPILES + 1, thread_name_prefix="grammar")
        self.overdue: list[concurrent.futures.Future] = []
        self.eos = set(engine.eos_token_ids)
        self.prompt_tokens = 0
        self.created = int(time.time())
        # No token covers more characters than the longest entry of the vocabulary: a text longer
        # than the context times that can never fit, and is refused without tokenizing it.
        longest = max(map(len, self.tokenizer.get_vocab()), default=1) if self.tokenizer is not None else 1
        self.max_prompt_chars = self.max_model_len * longest

    # ----- the door: a request's limits and its grammar, or APIError -----

    async def compile(self, field: str, structure: StructuredOutput) -> None:
        """Compile a grammar in a thread of the door's (xgrammar lets go of the interpreter lock: the loop
        streams on); one that does not compile, or not within GRAMMAR_COMPILE_S, is the request's fault,
        in its field. A compile past the limit runs on to its end: while GRAMMAR_COMPILES of them do,
        new grammars get a 429."""
        if hash(structure) in self.slow_grammars:  # once too slow, always: its compile may have finished since
            raise APIError(f"the grammar takes over {GRAMMAR_COMPILE_S:g} s to compile", param=field)
        self.overdue = [f for f in self.overdue if not f.done()]
        if len(self.overdue) >= GRAMMAR_COMPILES:
            raise APIError("the server is busy compiling slow grammars: try again later", status=429, param=field)
        # The door's checks of the grammar alone (chapter 12's compile it), in the thread.
        probe, tokenizer, limits = SamplingParams(structured_output=structure), self.tokenizer, self.engine.limits
        checks = self.engine.checks
        compiling = self.grammar_pool.submit(lambda: [check(probe, tokenizer, limits) for check in checks])
        try:
            await asyncio.wait_for(asyncio.wrap_future(compiling), GRAMMAR_COMPILE_S)
        except ValueError as err:
            raise APIError(str(err), param=field) from None
        except TimeoutError:
            self.slow_grammars.add(hash(structure))
            self.overdue.append(compiling)
            raise APIError(f"the grammar takes over {GRAMMAR_COMPILE_S:g} s to compile", param=field) from None

    def check_chars(self, chars: int, param: str) -> None:
        if chars > self.max_prompt_chars:
            raise APIError(f"the prompt's {chars} characters cannot fit the context of {self.max_model_len} tokens",
                           param=param)

    def tokenize(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise APIError("this model has no tokenizer: send token ids", param="prompt")
        self.check_chars(len(text), "prompt")
        return self.tokenizer(text).input_ids

    # ----- generation: one request's choices, each an async stream of ChoiceDeltas -----

    def requests(self, prompts: list[list[int]], params: SamplingParams, n: int, stops: list[str],
                 echo: bool = False) -> list[AsyncIterator[ChoiceDelta]]:
        """One stream per choice; every request checked before any starts. echo: each choice's
        text starts with its prompt's."""
        for ids in prompts:
            try:
                self.engine.check_request(ids, params)
            except ValueError as err:
                raise APIError(str(err), param=param_of(err)) from None
        self.prompt_tokens += sum(map(len, prompts))
        streams = []
        for i, ids in enumerate(prompts):
            for j in range(n):
                # The choices of a seeded request differ from each other and are reproducible.
                seed = None if params.seed is None else (params.seed + j) % 2 ** 64  # stays a 64-bit seed
                p = dataclasses.replace(params, seed=seed) if j else params
                # The engine starts it now; its turn is its place in this request: the scheduler serves
                # every request's first sequence before any request's second, and so on.
                try:
                    stream = self.engine.stream(ids, p, turn=i * n + j)
                except EngineStopped:
                    raise engine_stopped() from None
                streams.append(self.choice(i * n + j, stream, stops, ids if echo else None))
        return streams

    async def choice(self, index: int, outputs: AsyncGenerator[RequestOutput, None], stops: list[str],
                     echo: list[int] | None = None) -> AsyncIterator[ChoiceDelta]:
        detok, stop, count = IncrementalDetokenizer(self.tokenizer), StopStrings(stops), 0
        # Closed as soon as this choice ends: a stream left early aborts its request at once.
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                count += len(out.new_token_ids)  # (out.token_ids would copy every token so far)
                logprobs: list | None = out.new_logprobs
                piece = detok.add(text_token_ids(out, self.eos)) + (detok.finish() if out.finished else "")
                piece, stopped = stop.feed(piece, out.finished)
                if echo is not None:  # the prompt first, and its tokens' log-probabilities if asked
                    piece = self.decode(echo) + piece
                    if out.prompt_logprobs is not None:  # its first token has none: the token id stands in
                        logprobs = [lp or t for t, lp in zip(echo, out.prompt_logprobs)] + (logprobs or [])
                    echo = None
                if stopped:
                    yield ChoiceDelta(index, piece, "stop", count, logprobs)
                    return
                yield ChoiceDelta(index, piece, out.finish_reason, count, logprobs)

    def decode(self, ids: list[int]) -> str:
        """The text of token ids; a model without a tokenizer names them."""
        return self.tokenizer.decode(ids) if self.tokenizer is not None else "".join(f"token_id:{t}" for t in ids)

    @functools.cached_property
    def vocab_bytes(self) -> list[bytes]:
        """Each token id's own bytes, read by xgrammar from the tokenizer's pieces (byte-level BPE or
        SentencePiece's byte fallback): a token may hold part of a character, which its decoded
        text cannot show (it decodes to U+FFFD)."""
        import xgrammar as xgr
        return xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size).decoded_vocab

    def token_piece(self, token: int) -> tuple[str, bytes]:
        """A token's text and its own bytes; one that holds part of a character is named by its bytes,
        as OpenAI's API names it ("bytes:\\xf0\\x9f")."""
        if self.tokenizer is None:
            text = self.decode([token])
            return text, text.encode()
        data = self.vocab_bytes[token]
        try:
            return data.decode(), data
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data), data

    def admit(self, prompts: list[list[int]], params: SamplingParams, n: int) -> None:
        """Refuse a request larger than this server takes in one: its sequences (prompts x n), and the
        tokens they may hold together."""
        seqs = len(prompts) * n
        if seqs > self.max_seqs:
            raise APIError(f"the request asks for {seqs} sequences ({len(prompts)} prompts x n={n}); this server "
                           f"takes at most {self.max_seqs} in one request (--max-seqs-per-request)",
                           param="n" if len(prompts) == 1 else "prompt")
        tokens = n * sum(len(ids) + params.max_tokens for ids in prompts)
        if tokens > self.max_tokens:
            raise APIError(f"the request's sequences may hold {tokens} tokens (each prompt and max_tokens, times n); "
                           f"this server takes at most {self.max_tokens} in one request (--max-tokens-per-request)",
                           param="max_tokens")

    def parse(self, raw: bytes, endpoint: Completions) -> tuple[SamplingFields, list[list[int]]]:
        """A request body, validated against its endpoint's model, and its prompts' token ids."""
        req = validate(endpoint.request, load_body(raw, endpoint.unsupported))
        return req, endpoint.prompts(self, req)

    async def run(self, raw: bytes, endpoint: Completions) -> dict | AsyncIterator[str]:
        """A request's response: a JSON body, or (stream=true) an iterator of SSE events. A large body
        is parsed and tokenized in a worker thread: the event loop must keep answering meanwhile."""
        req, prompts = self.parse(raw, endpoint) if len(raw) <= INLINE_BODY_BYTES else \
            await asyncio.to_thread(self.parse, raw, endpoint)
        grammar = structure(req)
        check_model(req, self.model_name)
        params, n, stops = sampling_params(req, endpoint.max_tokens(self, req, prompts), endpoint.logprobs(req),
                                           grammar and grammar[1])
        self.admit(prompts, params, n)
        if params.logprobs is not None and self.tokenizer is not None and "vocab_bytes" not in self.__dict__:
            await asyncio.to_thread(getattr, self, "vocab_bytes")  # the first time: seconds, off the event loop
        if grammar is not None:
            await self.compile(*grammar)
        choices = merge(self.requests(prompts, params, n, stops, endpoint.echo(req)))
        prompt_tokens = sum(map(len, prompts))
        head = {"id": f"{endpoint.id_prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.model_name}
        if req.stream:
            return self.events(endpoint, choices, head, prompt_tokens, n * len(prompts),
                               req.stream_options is not None and req.stream_options.include_usage)
        texts: dict[int, str] = {}
        reasons: dict[int, str | None] = {}
        tokens: dict[int, int] = {}
        logprobs: dict[int, list] = {}
        try:
            async for d in choices:
                texts[d.index] = texts.get(d.index, "") + d.text
                reasons[d.index], tokens[d.index] = d.finish_reason, d.tokens
                if d.logprobs is not None:
                    logprobs.setdefault(d.index, []).extend(d.logprobs)
        except RuntimeError as err:
            raise generation_failed(err, "request") from None
        lp = {i: endpoint.logprobs_json(items, self.token_piece, TextOffsets()) for i, items in logprobs.items()}
        out = [endpoint.choice(i, texts[i], reasons[i], lp.get(i)) for i in sorted(texts)]
        return {**head, "object": endpoint.object, "choices": out, "usage": _usage(prompt_tokens, tokens)}

    async def events(self, endpoint: Completions, choices: AsyncIterator[ChoiceDelta], head: dict,
                     prompt_tokens: int, num_choices: int, include_usage: bool) -> AsyncIterator[str]:
        # Every chunk of this response starts the same: its JSON is written once, the choice per chunk.
        start = f"data: {_json({**head, 'object': endpoint.chunk_object})[:-1]},\"choices\":["

        def chunk(choice: dict) -> str:
            return f"{start}{_json(choice)}]}}\n\n"  # one SSE line: JSON escapes its newlines

        tokens: dict[int, int] = {}
        offsets: dict[int, TextOffsets] = {}  # where each choice's next token's text starts
        try:
            for i in range(num_choices):
                if (opening := endpoint.opening(i)) is not None:
                    yield chunk(opening)
            async for d in choices:
                tokens[d.index] = d.tokens
                lp = endpoint.logprobs_json(d.logprobs, self.token_piece, offsets.setdefault(d.index, TextOffsets())) \
                    if d.logprobs else None
                if d.text or d.finish_reason or lp:
                    yield chunk(endpoint.delta(d.index, d.text, d.finish_reason, lp))
        except Exception as err:  # the status line is long gone: an error event, then the end as usual
            yield sse_event(_json(generation_failed(err, "stream").body()))
            yield sse_event("[DONE]")
            return
        if include_usage:
            usage = _usage(prompt_tokens, tokens)
            yield sse_event(_json({**head, "object": endpoint.chunk_object, "choices": [], "usage": usage}))
        yield sse_event("[DONE]")


def _usage(prompt_tokens: int, tokens: dict[int, int]) -> dict[str, int]:
    """OpenAI's usage object; `tokens`: each choice's generated tokens."""
    completion = sum(tokens.values())
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def _json(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))


async def until_disconnected(request: Request, work: Awaitable):
    """work's result, or a 499 once the client has gone: a whole response runs to its end before
    anything is sent, so without this an abandoned request would too (a stream aborts itself)."""
    task = asyncio.ensure_future(work)
    while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
        if await request.is_disconnected():
            task.cancel()  # its streams close, which aborts their requests in the engine
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return Response(status_code=499)
    return task.result()


async def merge(streams: list[AsyncIterator]) -> AsyncIterator:
    """The items of several async iterators as they come; closing this closes them all."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    items: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream):
        try:
            async for item in stream:
                await items.put(item)
            await items.put(done)
        except Exception as err:
            await items.put(err)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item = await items.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:  # a cancelled pump leaves its request's stream, which aborts the request
            t.cancel()


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, or 413 as soon as it is known to be over `limit` bytes: from its
    Content-Length before reading anything, else while reading it."""
    too_large = APIError(f"the body is larger than {limit / 2 ** 20:g} MiB", 413)
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def build_app(engine: AsyncLLMEngine, model_name: str, options: ServerOptions = ServerOptions()) -> FastAPI:
    """The FastAPI application: the OpenAI routes, /health and /metrics."""
    server = Server(engine, model_name, options)
    app = FastAPI(title="miniinfer")
    app.state.server = server

    def cached_openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_schema(app, server, ENDPOINTS)
        return app.openapi_schema

    app.openapi = cached_openapi  # type: ignore[method-assign]  # FastAPI's documented way to replace it

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(HTTPException)  # unknown routes and methods, in the same shape
    async def http_error(request: Request, err: HTTPException):
        return JSONResponse(APIError(str(err.detail), err.status_code).body(), status_code=err.status_code,
                            headers=err.headers)  # a 405's Allow

    @app.exception_handler(Exception)
    async def server_error(request: Request, err: Exception):
        return JSONResponse(APIError(f"internal error: {err}", 500, type="server_error").body(), status_code=500)

    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "the engine has stopped"}, status_code=503)
        if server.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": server.created, "owned_by": "miniinfer",
                "max_model_len": server.max_model_len, "vocab_size": server.vocab_size}
        return {"object": "list", "data": [card]}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus():
        return PlainTextResponse(metrics(server), media_type="text/plain; version=0.0.4")

    def route(endpoint: Completions):
        async def generate(request: Request):
            if server.draining:
                raise shutting_down("it takes no new requests")
            if not engine.alive:
                raise engine_stopped()
            raw = await read_body(request, server.max_body_bytes)
            result = await until_disconnected(request, server.run(raw, endpoint))
            if isinstance(result, (dict, Response)):
                return result
            return StreamingResponse(result, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        app.post(endpoint.path)(generate)

    for endpoint in ENDPOINTS:
        route(endpoint)

    return app


def header_timeout(protocol: type, seconds: float) -> type:
    """uvicorn's HTTP protocol class, closing a connection that has not sent a whole request's headers
    within `seconds` of opening or of its last response."""

    class Protocol(protocol):  # type: ignore[valid-type, misc]
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self.arm()

        def arm(self) -> None:
            # The request then being served: a new one by the deadline means its headers came in time.
            self.loop.call_later(seconds, self.expire, self.cycle)

        def expire(self, served) -> None:
            if self.cycle is served and not self.transport.is_closing():
                self.transport.close()

    return Protocol


def serve(config: EngineConfig | Connects, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          options: ServerOptions = ServerOptions()) -> None:
    """Serve an engine (or chapter 15's pair of engines) over HTTP until interrupted. The engine runs in
    its own process: in this one, the event loop's work for every streamed token would hold the GIL
    that the engine's host code needs.
    Ctrl-C (or SIGTERM) drains: new requests get 503, those in flight have options.shutdown_timeout
    to finish, then the engine ends the rest (503, or a stream's error event and [DONE]); a second
    Ctrl-C ends them at once."""
    import uvicorn
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as http
    except ImportError:  # httptools is optional: uvicorn's pure-Python parser
        from uvicorn.protocols.http.h11_impl import H11Protocol as http  # type: ignore[assignment]
    # The thread that receives the engine's outputs gives up the GIL at every read of the pipe and
    # must win it back from a busy event loop: by default that can take 5 ms each time, longer than
    # a decode step, and the engine process then waits on a full pipe.
    sys.setswitchinterval(0.0005)
    async_engine = AsyncLLMEngine(config)
    app = build_app(async_engine, model_name, options)
    server: Server = app.state.server

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        async_engine.close()  # at shutdown: uvicorn may end the process right after

    class Uvicorn(uvicorn.Server):
        drain: tuple[int, float] | None = None  # the signal that started draining, and when

        def handle_exit(self, sig, frame) -> None:
            if self.drain is None:
                self.drain = sig, time.monotonic()
                server.draining = True
                print(f"shutting down: requests in flight have {options.shutdown_timeout:g} s to finish "
                      "(Ctrl-C again ends them now)", file=sys.stderr, flush=True)
            else:
                async_engine.client.send(Shutdown())  # every request still running ends now
                super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            # Called every 0.1 s: once nothing runs, or the time is up, the engine stops and uvicorn follows.
            if self.drain is not None and not self.should_exit:
                sig, since = self.drain
                if not async_engine.streams or time.monotonic() - since > options.shutdown_timeout:
                    async_engine.client.send(Shutdown())
                    super().handle_exit(sig, None)
            return await super().on_tick(counter)

    app.router.lifespan_context = lifespan
    protocol = header_timeout(http, options.header_timeout)
    Uvicorn(uvicorn.Config(app, host=host, port=port, access_log=False, http=protocol,
                           timeout_graceful_shutdown=GRACE_S)).run()
