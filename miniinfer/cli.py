"""Hand-written, not from a notebook: the command line over every floor, which no chapter teaches.

The `miniinfer` command (also `python -m miniinfer`): serve, generate, chat, bench, grade. Chapter 08
wrote it; it belongs to no chapter, since its commands reach them all (`serve --disaggregated` is chapter
15's pair). PyTorch and the engine are imported by the commands that need them, so that `--help`,
`bench` and `grade` start at once."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")


class Help(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help says it (or there is none to say)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if not shown and "default" not in text and action.option_strings:
            text += f" (default: {action.default})"
        return text.strip()


# What the command line does that EngineConfig's defaults do not: pick the GPU when there is one.
AUTO = {"device": "default: cuda when available, else cpu", "dtype": "default: bfloat16 on CUDA, else float32"}


def engine_options(ap: argparse.ArgumentParser) -> None:
    """One option per EngineConfig field, in the field's group, with its help, default and choices."""
    from miniinfer.core.config import EngineConfig
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(EngineConfig):
        group = f.metadata["group"]
        if group not in groups:
            groups[group] = ap.add_argument_group(f"engine: {group}")
        flag, kind, text = "--" + f.name.replace("_", "-"), str(f.type), f.metadata["help"]
        if f.name in AUTO:
            text, default = f"{text} ({AUTO[f.name]})", None
        else:
            default = f.default
        if "dtype" in kind:
            choices = DTYPES + (("fp8",) if f.name == "kv_cache_dtype" else ())
            groups[group].add_argument(flag, choices=choices, default=default and str(default).removeprefix("torch."),
                                       help=text)
        elif isinstance(f.default, bool):
            groups[group].add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=text)
        else:
            convert = int if "int" in kind else float if "float" in kind else str
            # None, where a field may take it, is spelled "none" on the command line
            groups[group].add_argument(flag, type=convert, default=default, help=text,
                                       choices=["none" if c is None else c for c in f.metadata["choices"]] or None)


def engine_config(args: argparse.Namespace):
    import torch

    import miniinfer as mi
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(mi.EngineConfig)}
    values.update({f.name: None for f in dataclasses.fields(mi.EngineConfig)
                   if None in f.metadata["choices"] and values[f.name] == "none"})
    values["device"] = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    values["dtype"] = args.dtype or ("bfloat16" if values["device"].startswith("cuda") else "float32")
    for name in ("dtype", "kv_cache_dtype"):
        values[name] = values[name] and (values[name] if values[name] == "fp8" else getattr(torch, values[name]))
    try:
        return mi.EngineConfig(**values)
    except ValueError as err:  # a bad option: its message, not a traceback
        raise SystemExit(f"miniinfer: {err}") from None


def make_engine(args: argparse.Namespace):
    """The engine of the command's options, for text in and out: SystemExit where it cannot be."""
    import miniinfer as mi
    config = engine_config(args)
    try:
        engine = mi.LLMEngine(config)
    except ValueError as err:  # a checkpoint or draft that cannot serve
        raise SystemExit(f"miniinfer: {err}") from None
    if engine.tokenizer is None:  # a checkpoint saved without one: the Python API and the server take token ids
        engine.close()
        raise SystemExit(f"miniinfer: {config.model} has no tokenizer files, and this command reads text: "
                         "copy a tokenizer into the folder, or give token ids to LLMEngine or the server")
    return engine


def sampling_options(ap: argparse.ArgumentParser, max_tokens: int) -> None:
    ap.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens to generate at most")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    ap.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    ap.add_argument("--top-p", type=float, default=1.0,
                    help="sample among the likeliest tokens of this total probability")
    ap.add_argument("--seed", type=int, default=None,
                    help="the request's random seed (default: none, not reproducible)")


def sampling(args: argparse.Namespace):
    import miniinfer as mi
    return mi.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                             max_tokens=args.max_tokens, seed=args.seed)


def stream_text(engine, ids: list[int], params) -> tuple[str, int]:
    """Print a request's text as it is generated; its text and token count."""
    from miniinfer.serving.detokenize import IncrementalDetokenizer
    from miniinfer.serving.server import text_token_ids
    detok, n = IncrementalDetokenizer(engine.tokenizer), 0
    eos = set(engine.info.eos_token_ids)
    for out in engine.stream(ids, params):
        print(detok.add(text_token_ids(out, eos)) + (detok.finish() if out.finished else ""), end="", flush=True)
        n = len(out.token_ids)
    return detok.text, n


def disaggregated(args: argparse.Namespace, config):
    """Chapter 15's pair: the engine options for both, the prefill engine on --device, the decode
    engine on --decode-device (default: the next GPU, or the CPU)."""
    import torch

    from miniinfer.engine.disaggregated import DisaggregatedConfig
    device = torch.device(config.device)
    decode = args.decode_device or (f"cuda:{(device.index or 0) + 1}" if device.type == "cuda" else "cpu")
    try:
        return DisaggregatedConfig(config, dataclasses.replace(config, device=decode))
    except ValueError as err:
        raise SystemExit(f"miniinfer: {err}") from None


def cmd_serve(args: argparse.Namespace) -> None:
    from miniinfer.serving.server import ServerOptions, serve
    name = args.served_model_name or (Path(args.model).name if args.model else "pycoder")
    options = ServerOptions(args.chat_max_tokens, args.max_body_mb, args.max_seqs_per_request,
                            args.max_tokens_per_request, args.shutdown_timeout, args.header_timeout)
    config = engine_config(args)
    if config.node_rank > 0:  # another machine's share of the ranks (chapter 16): the engine is on node 0
        from miniinfer.engine.pipeline import serve_node
        return serve_node(config)
    if args.disaggregated:
        config = disaggregated(args, config)
    elif config.data_parallel_size > 1:
        from miniinfer.engine.data_parallel import Replicas
        config = Replicas(config)
    serve(config, name, host=args.host, port=args.port, options=options)


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt as given, or read from --file or stdin (`-`): newlines need no shell quoting."""
    if args.file is not None:
        if args.prompt is not None:
            raise SystemExit("give the prompt as an argument or with --file, not both")
        return Path(args.file).read_text()
    if args.prompt is None or args.prompt == "-":
        if args.prompt is None and sys.stdin.isatty():
            raise SystemExit("no prompt: give one as an argument, with --file, or on stdin")
        return sys.stdin.read()
    return args.prompt


def cmd_route(args: argparse.Namespace) -> None:
    import uvicorn

    from miniinfer.serving.route import route_app
    uvicorn.run(route_app(args.worker, args.router), host=args.host, port=args.port, log_level="warning")


def cmd_generate(args: argparse.Namespace) -> None:
    prompt = read_prompt(args)
    if not prompt:
        raise SystemExit("the prompt is empty")
    engine = make_engine(args)
    print(prompt, end="")
    t0 = time.perf_counter()
    _, n = stream_text(engine, engine.tokenizer(prompt).input_ids, sampling(args))
    print(f"\n[{n} tokens in {time.perf_counter() - t0:.2f} s on {engine.config.device}]")


def cmd_chat(args: argparse.Namespace) -> None:
    history = [{"role": "system", "content": args.system}] if args.system else []
    if args.url:
        reply = lambda: asyncio.run(chat_remote(args, history))
    else:
        from miniinfer.serving.openai.chat import chat_prompt
        engine = make_engine(args)
        reply = lambda: stream_text(engine, chat_prompt(engine.tokenizer, history), sampling(args))[0]
    print("Type a message; an empty line or Ctrl-D ends the chat.")
    while True:
        try:
            line = input("you> ")
        except EOFError:
            break
        if not line.strip():
            break
        history.append({"role": "user", "content": line})
        print("assistant> ", end="", flush=True)
        history.append({"role": "assistant", "content": reply()})
        print()


async def chat_remote(args: argparse.Namespace, history: list[dict]) -> str:
    import httpx

    from miniinfer.serving.bench import sse_data
    body = {"messages": history, "stream": True, "max_tokens": args.max_tokens, "temperature": args.temperature,
            "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed}
    if args.model_name:
        body["model"] = args.model_name
    text = ""
    async with httpx.AsyncClient(timeout=None) as client, \
            client.stream("POST", args.url.rstrip("/") + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"the server said {r.status_code}: {(await r.aread()).decode()}")
        async for data in sse_data(r):
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise SystemExit(chunk["error"]["message"])
            for c in chunk["choices"]:
                piece = c["delta"].get("content") or ""
                print(piece, end="", flush=True)
                text += piece
    return text


def cmd_bench(args: argparse.Namespace) -> None:
    import httpx

    from miniinfer.serving.bench import random_requests, run_bench, served_model, summary
    name, vocab = args.model_name, args.vocab
    if name is None or vocab is None:  # else the flags say all it needs: no /v1/models
        try:
            card = served_model(args.url, name)
        except (httpx.HTTPError, ValueError, KeyError) as err:
            why = err or type(err).__name__
            raise SystemExit(f"miniinfer bench: cannot read {args.url}/v1/models: {why}") from None
        name, vocab = card["id"], vocab or card.get("vocab_size")
        if vocab is None:
            raise SystemExit(f"{args.url}/v1/models gives no vocab_size for {name}: pass --vocab")
    def span(s: str) -> tuple[int, int]:
        low, _, high = s.partition(":")
        return int(low), int(high or low)

    requests = random_requests(args.num_prompts, span(args.input_len), span(args.output_len), vocab, args.seed)
    result = asyncio.run(run_bench(args.url, requests, args.rate, args.concurrency, name,
                                   seed=args.seed, processes=args.processes))
    result.update(input_len=args.input_len, output_len=args.output_len, num_prompts=args.num_prompts, vocab=vocab)
    print(summary(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if result["failed"]:
        raise SystemExit(f"{result['failed']} of {result['requests']} requests failed")


def cmd_grade(args: argparse.Namespace) -> None:
    try:
        import ipykernel  # noqa: F401
        import nbclient  # noqa: F401
    except ImportError:
        raise SystemExit("miniinfer grade needs nbclient and ipykernel: pip install -e '.[dev]'") from None
    from miniinfer.course import grade
    t0 = time.perf_counter()

    def progress(path: Path, rows: list, seconds: float) -> None:
        passed = sum(r.status == "passed" for r in rows)
        print(f"{path}: {passed}/{len(rows)} passed ({seconds:.1f} s)", flush=True)

    rows = grade.grade(args.paths, timeout=args.timeout, jobs=args.jobs, progress=progress)
    grade.write_csv(rows, args.out)
    page = Path(args.out).with_suffix(".html")
    grade.write_html(rows, page)
    print(f"\n{grade.summary(rows)}\n\n{len({r.notebook for r in rows})} notebooks graded in "
          f"{time.perf_counter() - t0:.0f} s; one row per notebook and exercise in {args.out}, the class "
          f"at a glance in {page}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="miniinfer", description="miniinfer: serve, route, generate, chat, bench, grade")
    sub = ap.add_subparsers(dest="command", required=True)
    command = lambda name, text: sub.add_parser(name, help=text, description=text, formatter_class=Help)  # noqa: E731

    p = command("serve", "OpenAI-compatible HTTP server")
    engine_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--served-model-name", default=None, help="default: the model folder's name")
    p.add_argument("--chat-max-tokens", type=int, default=512,  # server.CHAT_MAX_TOKENS, without importing it
                   help="max_tokens of a chat request that gives none (capped by the context left)")
    p.add_argument("--max-body-mb", type=float, default=4,  # server.MAX_BODY_MB
                   help="a request body larger than this is refused with 413 before it is read")
    p.add_argument("--max-seqs-per-request", type=int, default=None,
                   help="sequences one request may ask for, prompts x n (default: --max-num-seqs)")
    p.add_argument("--max-tokens-per-request", type=int, default=None,
                   help="tokens one request's sequences may hold together, each prompt and max_tokens times n "
                        "(default: the KV pool's)")
    p.add_argument("--shutdown-timeout", type=float, default=5,  # server.SHUTDOWN_TIMEOUT_S
                   help="after Ctrl-C or SIGTERM, seconds requests in flight have to finish (new ones get 503)")
    p.add_argument("--header-timeout", type=float, default=10,  # server.HEADER_TIMEOUT_S
                   help="a connection that sends no whole request header this long (after opening or its last "
                        "response) is closed")
    p.add_argument("--disaggregated", action="store_true",
                   help="a prefill engine and a decode engine, each in its own process on its own device (chapter 15)")
    p.add_argument("--decode-device", default=None,
                   help="with --disaggregated: the decode engine's device (default: the GPU after --device's, or cpu)")
    p.set_defaults(run=cmd_serve)

    p = command("route", "route OpenAI requests to miniinfer servers over HTTP, by a replica rule (chapter 16)")
    p.add_argument("--worker", action="append", required=True, metavar="URL",
                   help="a `miniinfer serve` to send requests to, e.g. http://10.0.0.2:8000 (give it once per worker)")
    p.add_argument("--router", default="least_loaded", choices=("round_robin", "least_loaded", "prefix"),
                   help="which worker takes a request: in turn, the one with the fewest answers under way, or the "
                        "one that most likely holds the prompt's prefix")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.set_defaults(run=cmd_route)

    p = command("generate", "complete a prompt, streaming to the terminal")
    p.add_argument("prompt", nargs="?", default=None, help="the prompt; - or none: read it from stdin")
    p.add_argument("--file", default=None, help="read the prompt from this file (default: the argument, or stdin)")
    engine_options(p)
    sampling_options(p, 64)
    p.set_defaults(run=cmd_generate)

    p = command("chat", "chat, in-process or with a running server (--url)")
    p.add_argument("--url", default=None, help="a server, e.g. http://127.0.0.1:8000 (default: in-process)")
    p.add_argument("--model-name", default=None,
                   help="the served model to ask for, with --url (default: the server's first)")
    p.add_argument("--system", default=None, help="a system message (default: none)")
    engine_options(p)
    sampling_options(p, 128)
    p.set_defaults(run=cmd_chat)

    p = command("bench", "load-test an OpenAI-compatible server (streamed completions)")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server")
    p.add_argument("--model-name", default=None, help="default: the server's first model")
    p.add_argument("--num-prompts", type=int, default=256, help="requests to send")
    p.add_argument("--input-len", default="100:1024", help="prompt tokens, N or LOW:HIGH (uniform)")
    p.add_argument("--output-len", default="100:1024", help="output tokens, N or LOW:HIGH (uniform)")
    p.add_argument("--vocab", type=int, default=None, help="prompt token ids are uniform in 0..VOCAB-1 "
                   "(default: the vocab_size the server's /v1/models gives)")
    p.add_argument("--rate", type=float, default=math.inf, help="requests/s, Poisson arrivals (default: all at once)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="at most this many requests in flight (default: no limit)")
    p.add_argument("--processes", type=int, default=1, help="client processes (one reads ~20k chunks/s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts and lengths")
    p.add_argument("--out", default=None, help="write the result as JSON here (default: print it only)")
    p.set_defaults(run=cmd_bench)

    p = command("grade", "run students' problem-set notebooks, one row per notebook and exercise")
    p.add_argument("paths", nargs="+", metavar="PATH", help="notebooks, or folders searched for them")
    p.add_argument("--out", default="grades.csv",
                   help="the CSV: notebook, chapter, exercise, status, message, speed (and beside it the .html)")
    p.add_argument("--timeout", type=float, default=600, help="seconds one notebook may run")
    p.add_argument("--jobs", type=int, default=1, help="notebooks graded at once (one kernel each)")
    p.set_defaults(run=cmd_grade)

    args = ap.parse_args(argv)
    try:
        args.run(args)
    except KeyboardInterrupt:
        sys.exit(130)
