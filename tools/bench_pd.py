"""Chapter 15 GPU benchmark (two GPUs): a prefill engine on GPU 0 and a decode engine on GPU 1 against
two colocated engines with chunked prefill, one on each GPU, on the same requests.

Hand-written tool. Parts (in the order given; results merge into the JSON):
    parity    the tests' Llama / Qwen2 / Qwen3 shapes and the course model (random weights, float32,
              Triton kernels, CUDA graphs): the pair's greedy and seeded tokens against one LLMEngine's,
              the prefill engine caching prefixes and chunking prompts, the decode engine's pool small
              enough to preempt; every block back on both sides
    link      the link's bandwidth, GPU 0 -> GPU 1: a peer copy (`tensor.to`) in one process; NCCL
              send/recv between two processes (what the pair uses) by message size; and the pair's
              whole path for one request's K/V of Llama-3.2-3B's shape (gather out of the prefill pool,
              send, receive, scatter into the decode pool) for prompts of 1K-16K tokens
    goodput   Llama-3.2-3B's shape (random bf16 weights): requests with prompts of 4K-16K tokens and
              128-512 output tokens arrive at Poisson rates; for each rate and setup the time to first
              token (TTFT), the gaps between a request's outputs (ITL), and goodput: requests a second
              that meet TTFT <= 1 s and their own p99 ITL <= 50 ms. Setups: `disaggregated` (prefill on
              GPU 0, decode on GPU 1) and `colocated B` (an engine on each GPU, requests alternating,
              chunked prefill with a budget of B tokens a step)

    python tools/bench_pd.py run docs/benchmarks/pd_h100.json parity link goodput   (goodput goes on with the
              setups a run cut short left out)
    python tools/bench_pd.py plot docs/benchmarks/pd_h100.json     (the PNG beside it, on any machine)
"""

import asyncio
import dataclasses
import itertools
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_static_decode import LLAMA_3_2_1B  # noqa: E402
from benchlib import Results, commands

import miniinfer as mi  # noqa: E402
from miniinfer.course.parity import make_hf_model  # noqa: E402
from miniinfer.distributed.kv_transfer import KVLink, empty_blocks, gather_blocks, scatter_blocks  # noqa: E402
from miniinfer.engine.async_engine import AsyncLLMEngine  # noqa: E402
from miniinfer.engine.disaggregated import DisaggregatedConfig, DisaggregatedEngine  # noqa: E402

LLAMA_3_2_3B = dict(LLAMA_3_2_1B, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                    num_attention_heads=24, num_key_value_heads=8, head_dim=128)
TTFT_S, ITL_S = 1.0, 0.050  # the targets
PROMPT, OUTPUT = (4096, 16384), (128, 512)
MAX_MODEL_LEN = PROMPT[1] + OUTPUT[1]
RATES = (1.0, 2.0, 3.0, 4.0)  # requests a second
REQUESTS = 36  # a rate
BUDGETS = (512, 2048)  # the colocated engines' tokens a step
TRACE_RATE = 2.0  # the rate whose every output time is kept, for the timeline
VOCAB = 120000  # prompt tokens uniform in 3..VOCAB


def parity(res: dict) -> None:
    prompts = [[1, 5, 9, 5, 9, 5, 9, 2, 7] * 3 + [n] * n for n in (1, 4, 9, 17)] + [[3, 4] * 20]
    each = [mi.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True) for _ in prompts]
    each[1] = mi.SamplingParams(max_tokens=24, temperature=1.0, seed=5, ignore_eos=True)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("llama", "qwen2", "qwen3", "course"):
            folder = None
            if kind != "course":
                folder = f"{tmp}/{kind}"
                make_hf_model(kind).save_pretrained(folder)
            config = mi.EngineConfig(model=folder, device="cuda:0", dtype=torch.float32, num_blocks=128,
                                     block_size=4, max_num_seqs=8)
            one = mi.LLMEngine(config)
            want = [o.token_ids for o in one.generate(prompts, each, use_tqdm=False)]
            one.close()
            del one
            pair = DisaggregatedEngine(
                dataclasses.replace(config, enable_prefix_caching=True, enable_chunked_prefill=True,
                                    max_num_batched_tokens=16),
                dataclasses.replace(config, device="cuda:1", num_blocks=24, max_num_seqs=4))
            try:
                got = [o.token_ids for o in pair.generate(prompts, each, use_tqdm=False)]
                time.sleep(0.5)
                stats = pair.router.stats
                out[kind] = {"same": sum(g == w for g, w in zip(got, want)), "of": len(want),
                             "blocks_back": stats["prefill"].blocks_used == 0 and stats["decode"].blocks_used == 0}
            finally:
                pair.close()
            print(kind, out[kind], flush=True)
    res["parity"] = out


def _link_rank(rank: int, init_file: str, queue) -> None:
    """One end of the link measurements: rank 0 sends, rank 1 receives and reports."""
    device = f"cuda:{rank}"
    link = KVLink(rank, init_file)
    link.connect(device)
    out: dict = {"nccl_MB": {}, "kv_tokens": {}}
    for mb in (1, 4, 16, 64, 256, 1024, 2048):
        x = torch.empty(mb * 2**20, dtype=torch.uint8, device=device)
        times = []
        for _ in range(6):
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            (link.send if rank == 0 else link.recv)(x).wait()
            torch.cuda.synchronize()
            dist.barrier()
            times.append(time.perf_counter() - t0)
        out["nccl_MB"][mb] = x.numel() / statistics.median(times[1:]) / 1e9
    cfg = mi.ModelConfig.from_hf(LLAMA_3_2_3B)
    block = 16
    pools = tuple(torch.randn(cfg.num_layers, 1100, block, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16,
                              device=device) for _ in range(2))
    g = torch.Generator().manual_seed(rank)
    for tokens in (1024, 4096, 8192, 16384):
        n = tokens // block
        times = []
        for _ in range(4):
            ids = torch.randperm(1100, generator=g)[:n].tolist()
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if rank == 0:
                link.send(gather_blocks(pools, ids)).wait()
            else:
                kv = empty_blocks(pools, n)
                link.recv(kv).wait()
                scatter_blocks(pools, ids, kv)
            torch.cuda.synchronize()
            dist.barrier()  # the receiver's clock stops after both ends are done
            times.append(time.perf_counter() - t0)
        nbytes = 2 * cfg.num_layers * n * block * cfg.num_kv_heads * cfg.head_dim * 2
        out["kv_tokens"][tokens] = {"bytes": nbytes, "ms": statistics.median(times[1:]) * 1e3,
                                    "GBps": nbytes / statistics.median(times[1:]) / 1e9}
    if rank == 1:
        queue.put(out)
    dist.destroy_process_group()


def link(res: dict) -> None:
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda:0")
    y = torch.empty_like(x, device="cuda:1")
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        y.copy_(x)
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")
        times.append(time.perf_counter() - t0)
    peer = x.numel() / statistics.median(times) / 1e9
    del x, y
    torch.cuda.empty_cache()
    fd, init_file = tempfile.mkstemp(prefix="bench-pd-")
    os.close(fd)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_link_rank, args=(r, init_file, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    out = queue.get(timeout=300)
    for p in procs:
        p.join()
    out["peer_copy_GBps"] = peer
    res["link"] = out
    print(json.dumps(out), flush=True)


def checkpoint(folder: str) -> None:
    """Llama-3.2-3B's shape with random bf16 weights, written once (in memory, /dev/shm)."""
    import transformers
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_3_2_3B)).to(torch.bfloat16)
    hf.save_pretrained(folder)
    del hf
    torch.cuda.empty_cache()


def requests(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, VOCAB) for _ in range(rng.randint(*PROMPT))], rng.randint(*OUTPUT)) for _ in range(n)]


async def drive(engines: list[AsyncLLMEngine], work: list[tuple[list[int], int]], rate: float) -> list[dict]:
    """Each request sent at its Poisson arrival time to the next engine in turn; the times of its outputs."""
    rng = random.Random(1)
    starts = list(itertools.accumulate(rng.expovariate(rate) for _ in work))
    t_zero = time.perf_counter()

    async def one(i: int) -> dict:
        prompt, max_tokens = work[i]
        await asyncio.sleep(max(0.0, t_zero + starts[i] - time.perf_counter()))
        sent = time.perf_counter()
        times, tokens = [], []
        params = mi.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        async for o in engines[i % len(engines)].generate(prompt, params):
            times.append(time.perf_counter())
            tokens.append(len(o.new_token_ids))
        return {"sent": sent - t_zero, "times": [t - t_zero for t in times], "tokens": tokens,
                "prompt": len(prompt)}

    return await asyncio.gather(*(one(i) for i in range(len(work))))


def p(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else float("nan")


def summarize(runs: list[dict]) -> dict:
    ttft = [r["times"][0] - r["sent"] for r in runs]
    gaps = [[b - a for a, b in zip(r["times"], r["times"][1:])] for r in runs]
    good = [t <= TTFT_S and p(g, 99) <= ITL_S for t, g in zip(ttft, gaps)]
    span = max(r["times"][-1] for r in runs) - min(r["sent"] for r in runs)
    every = [x for g in gaps for x in g]
    return {"goodput_rps": sum(good) / span, "met": sum(good), "of": len(runs), "seconds": span,
            "output_tok_s": sum(sum(r["tokens"]) for r in runs) / span,
            "ttft_s": {"p50": p(ttft, 50), "p90": p(ttft, 90), "p99": p(ttft, 99)},
            "itl_ms": {"p50": p(every, 50) * 1e3, "p90": p(every, 90) * 1e3, "p99": p(every, 99) * 1e3},
            "met_ttft": sum(t <= TTFT_S for t in ttft), "met_itl": sum(p(g, 99) <= ITL_S for g in gaps)}


def goodput(res: dict, save: Callable[[], None]) -> None:
    in_memory = Path("/dev/shm").exists() and shutil.disk_usage("/dev/shm").free > 16 * 2**30
    folder = tempfile.mkdtemp(dir="/dev/shm" if in_memory else None)
    t0 = time.perf_counter()
    checkpoint(folder)
    print(f"checkpoint {time.perf_counter() - t0:.0f} s", flush=True)
    base = mi.EngineConfig(model=folder, device="cuda:0", dtype=torch.bfloat16, max_model_len=MAX_MODEL_LEN,
                           gpu_memory_utilization=0.85)
    setups = {"disaggregated": lambda: [AsyncLLMEngine(DisaggregatedConfig(
        dataclasses.replace(base, enable_prefix_caching=True, max_num_batched_tokens=MAX_MODEL_LEN),
        dataclasses.replace(base, device="cuda:1")))]}
    for budget in BUDGETS:
        setups[f"colocated {budget}"] = lambda budget=budget: [AsyncLLMEngine(dataclasses.replace(
            base, device=f"cuda:{i}", enable_chunked_prefill=True, max_num_batched_tokens=budget)) for i in (0, 1)]
    out: dict = {"rates": list(RATES), "requests": REQUESTS, "prompt": PROMPT, "output": OUTPUT,
                 "targets": {"ttft_s": TTFT_S, "itl_ms": ITL_S * 1e3}, "setups": {}, "trace": {}}
    done = res.get("goodput", {})
    if {k: done.get(k) for k in ("rates", "requests", "prompt", "output")} == \
            {k: json.loads(json.dumps(out[k])) for k in ("rates", "requests", "prompt", "output")}:
        out["setups"], out["trace"] = done["setups"], done["trace"]  # a run cut short goes on where it stopped
    for name, make in setups.items():
        if len(out["setups"].get(name, {})) == len(RATES):
            continue
        t0 = time.perf_counter()
        engines = make()
        print(f"{name}: started in {time.perf_counter() - t0:.0f} s", flush=True)
        asyncio.run(drive(engines, requests(4, seed=99), 4.0))  # warm: kernels of long prompts met once
        out["setups"][name] = {}
        for rate in RATES:
            runs = asyncio.run(drive(engines, requests(REQUESTS, seed=int(rate * 10)), rate))
            out["setups"][name][str(rate)] = summarize(runs)
            if rate == TRACE_RATE:
                out["trace"][name] = [{"sent": round(r["sent"], 4), "prompt": r["prompt"],
                                       "times": [round(t, 4) for t in r["times"]]} for r in runs]
            print(name, rate, json.dumps(out["setups"][name][str(rate)]), flush=True)
            res["goodput"] = out
            save()  # a run cut short keeps what it measured
        for e in engines:
            e.close()
    res["goodput"] = out
    for f in Path(folder).iterdir():
        f.unlink()
    Path(folder).rmdir()


def run(out_path: str, parts: list[str]) -> None:
    results = Results(out_path)
    run_part = {"parity": parity, "link": link, "goodput": lambda res: goodput(res, results.write)}
    for part in parts:
        run_part[part](results.data)
        results.write()


def plot(out_path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    res = json.loads(Path(out_path).read_text())
    g = res["goodput"]
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    for name, by_rate in g["setups"].items():
        rates = [float(r) for r in by_rate]
        axes[0].plot(rates, [v["goodput_rps"] for v in by_rate.values()], "o-", label=name)
        axes[1].plot(rates, [v["ttft_s"]["p90"] for v in by_rate.values()], "o-", label=name)
        axes[2].plot(rates, [v["itl_ms"]["p99"] for v in by_rate.values()], "o-", label=name)
    axes[0].set(xlabel="arrival rate (requests/s)", ylabel="goodput (requests/s)",
                title=f"meeting TTFT <= {g['targets']['ttft_s']:g} s and p99 ITL <= {g['targets']['itl_ms']:g} ms")
    axes[1].axhline(g["targets"]["ttft_s"], color="gray", ls=":")
    axes[1].set(xlabel="arrival rate (requests/s)", ylabel="p90 TTFT (s)", yscale="log", title="time to first token")
    axes[2].axhline(g["targets"]["itl_ms"], color="gray", ls=":")
    axes[2].set(xlabel="arrival rate (requests/s)", ylabel="p99 ITL (ms)", yscale="log", title="inter-token latency")
    axes[0].legend(fontsize=8)
    lk = res["link"]
    sizes = [int(s) for s in lk["nccl_MB"]]
    axes[3].plot(sizes, list(lk["nccl_MB"].values()), "o-", label="NCCL send/recv")
    kv = lk["kv_tokens"]
    axes[3].plot([v["bytes"] / 2**20 for v in kv.values()], [v["GBps"] for v in kv.values()], "s-",
                 label="one request's K/V (gather, send, scatter)")
    axes[3].axhline(lk["peer_copy_GBps"], color="gray", ls=":", label="peer copy")
    axes[3].set(xscale="log", xlabel="MB", ylabel="GB/s", title="GPU 0 -> GPU 1")
    axes[3].legend(fontsize=8)
    gpu, gpus = (res["gpu"], res["gpus"]) if "gpu" in res else (res["gpus"][0], len(res["gpus"]))  # pd_h100: by name
    fig.suptitle(f"{gpu} x {gpus}, Llama-3.2-3B shape (random bf16), prompts "
                 f"{g['prompt'][0]}-{g['prompt'][1]} tokens, outputs {g['output'][0]}-{g['output'][1]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(Path(out_path).with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    commands(run=lambda out, *parts: run(out, list(parts)), plot=plot)
