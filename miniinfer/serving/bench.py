"""Hand-written, not from a notebook: a measuring tool that chapter 08 runs but does not teach.

A load generator for any OpenAI-compatible completions endpoint, in the spirit of `vllm bench
serve`: requests sent at a Poisson rate or at a fixed concurrency, each streamed, and the time to
first token (TTFT), the gaps between streamed chunks (inter-token latency, ITL) and the throughput
measured from the client's side. Hand-written module (chapter 08); `miniinfer bench` runs it."""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import random
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator, Sequence

import httpx
from tqdm.auto import tqdm


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0  # seconds from sending to the first text
    itl: list[float] = field(default_factory=list)  # seconds between text chunks
    latency: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    text: str = ""


def random_requests(n: int, input_len: tuple[int, int] = (100, 1024), output_len: tuple[int, int] = (100, 1024),
                    vocab: int = 10000, seed: int = 0) -> list[tuple[list[int], int]]:
    """n (prompt token ids, max_tokens) pairs, lengths and tokens uniform in the ranges given."""
    rng = random.Random(seed)
    return [([rng.randrange(vocab) for _ in range(rng.randint(*input_len))], rng.randint(*output_len))
            for _ in range(n)]


async def sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The data of each Server-Sent Event of a streamed response (a multi-line field joined by newlines)."""
    data: list[str] = []
    async for line in response.aiter_lines():
        if line.startswith("data:"):
            data.append(line[6:] if line.startswith("data: ") else line[5:])
        elif not line and data:
            yield "\n".join(data)
            data = []


def served_model(url: str, name: str | None = None) -> dict:
    """The model card a server's /v1/models gives for `name` (None: its first model)."""
    cards = httpx.get(url.rstrip("/") + "/v1/models").raise_for_status().json()["data"]
    card = next((c for c in cards if c["id"] == name), None) if name else cards[0]
    if card is None:
        raise ValueError(f"the server serves {[c['id'] for c in cards]}, not {name!r}")
    return card


def read_metrics(url: str) -> dict[str, float]:
    """A miniinfer server's /metrics, by name without the `miniinfer_` prefix."""
    return {line.split()[0].removeprefix("miniinfer_"): float(line.split()[1])
            for line in httpx.get(url.rstrip("/") + "/metrics").text.splitlines() if line.startswith("miniinfer_")}


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int] | str,
                      max_tokens: int, extra: dict) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0, **extra}
    r = Result()
    t0 = last = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                r.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return r
            async for data in sse_data(response):
                if data == "[DONE]":
                    r.ok = True
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    r.error = chunk["error"]["message"]
                    return r
                if chunk.get("usage"):
                    r.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    r.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    r.text += chunk["choices"][0]["text"]
                    now = time.perf_counter()
                    if r.ttft == 0:
                        r.ttft = now - t0
                    else:
                        r.itl.append(now - last)
                    last = now
    except (httpx.HTTPError, OSError) as err:
        r.error = f"{type(err).__name__}: {err}"
        return r
    r.latency = time.perf_counter() - t0
    return r


def percentiles(xs: list[float], ps=(50, 90, 99)) -> dict[str, float]:
    if not xs:
        return {}
    xs = sorted(xs)
    out = {f"p{p}": xs[min(len(xs) - 1, math.ceil(p / 100 * len(xs)) - 1)] for p in ps}
    return {"mean": statistics.fmean(xs), **out}


async def run_bench(url: str, requests: Sequence[tuple[list[int] | str, int]], rate: float = math.inf,
                    concurrency: int | None = None, model: str | None = None, extra: dict | None = None,
                    seed: int = 0, progress: bool = True, processes: int = 1) -> dict:
    """Send `requests` ((prompt, max_tokens) pairs) to an OpenAI-compatible server at `url`: Poisson
    arrivals at `rate` requests/s (inf: all at once), at most `concurrency` in flight; a summary dict.
    One Python process reads a few tens of thousands of streamed chunks per second: past that, split
    the requests over `processes` client processes, so that the client is not what is measured."""
    url = url.rstrip("/")
    model = model or served_model(url)["id"]
    if processes == 1:
        results, duration = await drive(url, requests, rate, concurrency, model, extra, seed, progress)
    else:
        start_at = time.time() + 10  # every client process is up by then: they start together
        shards = [(url, requests[i::processes], rate / processes, concurrency and max(concurrency // processes, 1),
                   model, extra, seed + i, False, start_at) for i in range(processes)]
        loop = asyncio.get_running_loop()
        with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
            parts = await asyncio.gather(*(loop.run_in_executor(pool, drive_in_process, s) for s in shards))
        results, duration = [r for rs, _ in parts for r in rs], max(d for _, d in parts)
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    return {
        "url": url, "model": model, "rate": rate if rate != math.inf else "inf", "concurrency": concurrency,
        "client_processes": processes,
        "requests": len(results), "completed": len(done), "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration, "request_throughput": len(done) / duration,
        "output_tokens": out_tokens, "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in done)) / duration,
        "ttft_s": percentiles([r.ttft for r in done]),
        "itl_s": percentiles([x for r in done for x in r.itl]),
        "latency_s": percentiles([r.latency for r in done]),
    }


async def drive(url: str, requests: Sequence, rate: float, concurrency: int | None, model: str, extra: dict | None,
                seed: int, progress: bool, start_at: float | None = None) -> tuple[list[Result], float]:
    """One client process's part: every request's Result, and the seconds from the first send to the end."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        gate = asyncio.Semaphore(concurrency or len(requests))
        bar = tqdm(total=len(requests), desc="requests", disable=not progress)
        rng = random.Random(seed)

        async def send(prompt, max_tokens) -> Result:
            async with gate:
                r = await one_request(client, url, model, prompt, max_tokens, extra or {})
            bar.update(1)
            return r

        if start_at is not None:
            await asyncio.sleep(max(start_at - time.time(), 0))
        t0 = time.perf_counter()
        tasks = []
        for prompt, max_tokens in requests:
            tasks.append(asyncio.create_task(send(prompt, max_tokens)))
            if rate != math.inf:
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        bar.close()
    return results, duration


def drive_in_process(args: tuple) -> tuple[list[Result], float]:
    return asyncio.run(drive(*args))


def summary(result: dict) -> str:
    """A few lines for a terminal."""
    ms = lambda d: ", ".join(f"{k} {v * 1000:.1f}" for k, v in d.items())
    return (f"{result['completed']}/{result['requests']} requests in {result['duration_s']:.2f} s "
            f"({result['request_throughput']:.2f} req/s), {result['output_throughput']:.1f} output tok/s"
            + (f"\nTTFT ms:    {ms(result['ttft_s'])}\nITL ms:     {ms(result['itl_s'])}\n"
               f"latency ms: {ms(result['latency_s'])}" if result["completed"] else "")
            + (f"\nerrors: {result['errors']}" if result["errors"] else ""))
