"""The `miniinfer` command (also `python -m miniinfer`): serve, generate, chat, bench.
Hand-written module (chapter 08)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def engine_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the embedded course model)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=DTYPES, default=None, help="default: bfloat16 on CUDA, else float32")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=None, help="KV pool size (default: from free memory)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--preemption-mode", choices=["recompute", "swap"], default="recompute")
    ap.add_argument("--enable-prefix-caching", action="store_true")
    ap.add_argument("--enable-chunked-prefill", action="store_true")
    ap.add_argument("--no-cuda-graph", action="store_true")


def engine_config(args: argparse.Namespace):
    import miniinfer as mi
    dtype = DTYPES[args.dtype] if args.dtype else torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    return mi.EngineConfig(
        model=args.model, device=args.device, dtype=dtype, block_size=args.block_size, num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
        preemption_mode=args.preemption_mode, enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill, cuda_graph=not args.no_cuda_graph)


def make_engine(args: argparse.Namespace):
    import miniinfer as mi
    return mi.LLMEngine(engine_config(args))


def sampling_options(ap: argparse.ArgumentParser, max_tokens: int) -> None:
    ap.add_argument("--max-tokens", type=int, default=max_tokens)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)


def sampling(args: argparse.Namespace):
    import miniinfer as mi
    return mi.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                             max_tokens=args.max_tokens, seed=args.seed)


def stream_text(engine, ids: list[int], params) -> tuple[str, int]:
    """Print a request's text as it is generated; its text and token count."""
    from miniinfer.detokenize import IncrementalDetokenizer
    from miniinfer.server import text_token_ids
    detok, n = IncrementalDetokenizer(engine.tokenizer), 0
    eos = set(engine.model.cfg.eos_token_ids)
    for out in engine.stream(ids, params):
        print(detok.add(text_token_ids(out, eos)) + (detok.finish() if out.finished else ""), end="", flush=True)
        n = len(out.token_ids)
    return detok.text, n


def cmd_serve(args: argparse.Namespace) -> None:
    from miniinfer.server import serve
    name = args.served_model_name or (Path(args.model).name if args.model else "pycoder")
    serve(engine_config(args), name, host=args.host, port=args.port)


def cmd_generate(args: argparse.Namespace) -> None:
    engine = make_engine(args)
    print(args.prompt, end="")
    t0 = time.perf_counter()
    _, n = stream_text(engine, engine.tokenizer(args.prompt).input_ids, sampling(args))
    print(f"\n[{n} tokens in {time.perf_counter() - t0:.2f} s on {args.device}]")


def cmd_chat(args: argparse.Namespace) -> None:
    history = [{"role": "system", "content": args.system}] if args.system else []
    if args.url:
        reply = lambda: asyncio.run(chat_remote(args, history))
    else:
        from miniinfer.server import chat_prompt
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
    from miniinfer.bench import sse_data
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
    from miniinfer.bench import random_requests, run_bench, summary
    span = lambda s: tuple(int(x) for x in s.split(":")) if ":" in s else (int(s), int(s))
    requests = random_requests(args.num_prompts, span(args.input_len), span(args.output_len), args.vocab, args.seed)
    result = asyncio.run(run_bench(args.url, requests, args.rate, args.concurrency, args.model_name,
                                   seed=args.seed, processes=args.processes))
    result.update(input_len=args.input_len, output_len=args.output_len, num_prompts=args.num_prompts)
    print(summary(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="miniinfer", description="miniinfer: serve, generate, chat, bench")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    engine_options(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="default: the model folder's name")
    p.set_defaults(run=cmd_serve)

    p = sub.add_parser("generate", help="complete a prompt, streaming to the terminal")
    p.add_argument("prompt")
    engine_options(p)
    sampling_options(p, 64)
    p.set_defaults(run=cmd_generate)

    p = sub.add_parser("chat", help="chat, in-process or with a running server (--url)")
    p.add_argument("--url", default=None, help="a server, e.g. http://127.0.0.1:8000 (default: in-process)")
    p.add_argument("--model-name", default=None, help="the served model to ask for (with --url)")
    p.add_argument("--system", default=None, help="a system message")
    engine_options(p)
    sampling_options(p, 128)
    p.set_defaults(run=cmd_chat)

    p = sub.add_parser("bench", help="load-test an OpenAI-compatible server (streamed completions)")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model-name", default=None, help="default: the server's first model")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", default="100:1024", help="prompt tokens, N or LOW:HIGH (uniform)")
    p.add_argument("--output-len", default="100:1024", help="output tokens, N or LOW:HIGH (uniform)")
    p.add_argument("--vocab", type=int, default=10000, help="prompt token ids are uniform in 0..VOCAB-1")
    p.add_argument("--rate", type=float, default=math.inf, help="requests/s, Poisson arrivals (default: all at once)")
    p.add_argument("--concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--processes", type=int, default=1, help="client processes (one reads ~20k chunks/s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the result as JSON here")
    p.set_defaults(run=cmd_bench)

    args = ap.parse_args(argv)
    try:
        args.run(args)
    except KeyboardInterrupt:
        sys.exit(130)
