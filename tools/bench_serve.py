"""Chapter 08 GPU benchmark: our OpenAI-compatible server under load, measured from the client side
by `miniinfer.serving.bench` (the `miniinfer bench` load generator), against the in-process engine on the
same requests.

Hand-written tool. On the Llama-3.2-1B shape (random bf16 weights) with a word-level tokenizer of the
full 128,256-token vocabulary (the server must turn every generated id into text):
  1. the in-process LLMEngine on the course's 256-request workload (all at once): output tokens/s;
  2. `python -m miniinfer serve` in its own process, the same 256 requests sent at once (saturation),
     then Poisson arrivals at rising request rates, then saturation again; the client is 4 processes.
    python tools/bench_serve.py run docs/benchmarks/serve_h200.json [rates...]
    python tools/bench_serve.py saturation docs/benchmarks/serve_saturation_h200.json 3
    python tools/bench_serve.py saturation OUT.json 2 --profile   # the server's threads sampled: OUT.stacks.json
    python tools/bench_serve.py saturation OUT.json 2 clients=8   # the client as 8 processes (4 unless told)
    python tools/bench_serve.py saturation OUT.json 3 --trace   # each run's timeline over the three processes
    python tools/bench_serve.py http_cpu OUT.json 3   # no GPU: the HTTP process's CPU time per streamed token
    python tools/bench_serve.py plot docs/benchmarks/serve_h200.json
"""

import asyncio
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
import transformers
from bench_engine import greedy, workload
from bench_static_decode import LLAMA_3_2_1B
from benchlib import commands, header

import miniinfer as mi
from miniinfer.serving.bench import read_metrics, run_bench

MAX_MODEL_LEN = 2048
RATES = [2, 4, 8, 16, 32, 64]
PER_RATE = 128
# Client processes: one Python process cannot read the ~30k chunks/s of saturation (`clients=N`).
CLIENTS = 4


def checkpoint(folder: Path, tiny: bool = False) -> None:
    """A Llama-3.2-1B-shaped checkpoint with random bf16 weights and a tokenizer for every id; tiny:
    the same vocabulary and tokenizer around one narrow layer, in float32 on the CPU."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    torch.manual_seed(0)
    if tiny:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{
            **LLAMA_3_2_1B, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}))
    else:
        with torch.device("cuda"):
            hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_3_2_1B)).to(torch.bfloat16)
    hf.save_pretrained(folder)
    del hf
    vocab = {f"w{i}": i for i in range(LLAMA_3_2_1B["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w1").save_pretrained(folder)


def in_process(folder: Path, prompts, outs, repeat: int = 1) -> dict:
    engine = mi.LLMEngine(mi.EngineConfig(model=folder, device="cuda", dtype=torch.bfloat16,
                                          max_model_len=MAX_MODEL_LEN))
    engine.generate(prompts[:8], greedy(8), use_tqdm=False)  # the same warm-up the server's first requests get
    runs, profile = [], []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for p, o in zip(prompts, outs):
            engine.add_request(p, greedy(o))
        steps, step_seconds = 0, 0.0
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            steps, step_seconds = steps + 1, step_seconds + time.perf_counter() - t
        seconds = time.perf_counter() - t0
        runs.append(sum(outs) / seconds)
        profile.append({"seconds": seconds, "steps": steps, "step_seconds": step_seconds})
    res = {"output_tokens_per_s": max(runs), "runs_output_tokens_per_s": runs, "profile": profile,
           "num_blocks": engine.block_manager.num_blocks}
    del engine
    gc.collect()  # the engine's pool is freed only once the engine is collected
    torch.cuda.empty_cache()
    print("in-process:", res, flush=True)
    return res


def start_server(folder: Path, port: int, log: Path, stacks: Path | None = None,
                 max_model_len: int = MAX_MODEL_LEN, extra: tuple[str, ...] = (),
                 name: str = "llama-3.2-1b-shape") -> subprocess.Popen:
    cmd = [sys.executable, "-m", "miniinfer", "serve", "--model", str(folder), "--port", str(port),
           "--max-model-len", str(max_model_len), "--served-model-name", name, *extra]
    if stacks:
        cmd[1:1] = [str(Path(__file__).parent / "sample_stacks.py"), str(stacks)]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(log.read_text())
        time.sleep(0.5)


def bench(url: str, prompts, outs, rate: float, clients: int = CLIENTS) -> dict:
    before, t0 = read_metrics(url), time.time()
    r = asyncio.run(run_bench(url, list(zip(prompts, outs)), rate=rate, progress=False, processes=clients))
    after, r["wall"] = read_metrics(url), [t0, time.time()]
    # Where the engine's time went during the run, from the server's counters.
    r["engine"] = {k: after[f"engine_{k}_total"] - before[f"engine_{k}_total"]
                   for k in ("steps", "step_seconds", "wait_seconds")}
    print(f"rate {r['rate']}: {r['completed']}/{r['requests']} ok, {r['output_throughput']:.0f} out tok/s, "
          f"TTFT p50 {r['ttft_s'].get('p50', 0) * 1e3:.0f} ms, ITL p50 {r['itl_s'].get('p50', 0) * 1e3:.1f} ms "
          f"p99 {r['itl_s'].get('p99', 0) * 1e3:.1f} ms", flush=True)
    return r


def read_traces(folder: Path) -> dict[str, list[tuple]]:
    """The events that tools/serve_trace wrote, by kind."""
    events: dict[str, list[tuple]] = {k: [] for k in "ECRHQD"}
    for path in folder.glob("trace.*.txt"):
        for line in path.read_text().splitlines():
            kind, *fields = line.split()
            events[kind].append(tuple(fields))
    return events


def timeline(events: dict[str, list[tuple]], t0: float, t1: float) -> dict:
    """One run's figures, in seconds from its first request sent."""
    def within(kind):
        return sorted(e for e in events[kind] if t0 <= float(e[0]) <= t1)

    steps = [(float(s), float(e), int(r)) for s, e, r, _, _ in within("E")]
    adds = [float(t) for t, c in within("C") if c == "AddRequest"]
    sent, parsed, done = ([float(e[0]) for e in within(k)] for k in "QHD")
    start = sent[0]
    return {
        "sent_s": [sent[0] - start, sent[-1] - start],  # first and last request sent by a client
        "parsed_s": [parsed[0] - start, parsed[-1] - start],  # first and last body handed to Server.run
        "at_engine_s": [adds[0] - start, adds[-1] - start],  # first and last AddRequest taken by the engine
        "first_step_s": steps[0][0] - start, "last_step_end_s": steps[-1][1] - start,
        "last_stream_end_s": done[-1] - start,
        "steps": len(steps), "step_busy_s": sum(e - s for s, e, _ in steps),
        "idle_between_steps_s": sum(b[0] - a[1] for a, b in zip(steps, steps[1:])),
        "max_running": max(r for _, _, r in steps),
    }


def main(out_path: str, rates: list[float], repeat: int = 1, profile: bool = False, trace: bool = False,
         clients: int = CLIENTS) -> None:
    """With rates: the in-process engine, then the server at saturation, at each rate, and at saturation
    again. Without: the in-process engine `repeat` times, then the server at saturation `repeat` times.
    trace: the server and client processes log timestamped events (tools/serve_trace), and each
    saturation run gets its `timeline`."""
    import fastapi
    import uvicorn
    res = header(fastapi=fastapi.__version__, uvicorn=uvicorn.__version__, httpx=httpx.__version__,
                 model="Llama-3.2-1B shape, random bf16 weights, word-level tokenizer over 128,256 ids",
                 max_model_len=MAX_MODEL_LEN)
    prompts, outs = workload()
    res["workload"] = {"requests": len(prompts), "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(outs),
                       "note": "the course's 256 requests; each rate sends the first %d of them" % PER_RATE}
    path = Path(out_path)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama"
        checkpoint(folder)
        res["in_process"] = in_process(folder, prompts, outs, repeat)
        path.write_text(json.dumps(res, indent=1))
        traces = Path(tmp) / "traces"
        if trace:  # inherited by the server and the client processes
            traces.mkdir()
            os.environ["MI_TRACE"] = str(traces)
            os.environ["PYTHONPATH"] = f"{Path(__file__).parent / 'serve_trace'}:{os.environ.get('PYTHONPATH', '')}"
        proc = start_server(folder, 8000, path.with_suffix(".server.log"),
                            path.with_suffix(".stacks.json") if profile else None)
        url = "http://127.0.0.1:8000"
        try:
            bench(url, prompts[:8], [8] * 8, float("inf"))  # warm-up, as in-process
            res["saturation"] = [bench(url, prompts, outs, float("inf"), clients)
                                 for _ in range(repeat if not rates else 1)]
            if rates:
                res["rates"] = []
                for rate in rates:
                    res["rates"].append(bench(url, prompts[:PER_RATE], outs[:PER_RATE], rate, clients))
                    path.write_text(json.dumps(res, indent=1))
                res["saturation"].append(bench(url, prompts, outs, float("inf"), clients))
        finally:
            proc.terminate()
            proc.wait(60)
        if trace:
            events = read_traces(traces)
            for r in res["saturation"]:
                r["timeline"] = timeline(events, *r["wall"])
                print("timeline:", r["timeline"], flush=True)
    ratios = sorted(r["output_throughput"] / res["in_process"]["output_tokens_per_s"] for r in res["saturation"])
    res["server_vs_in_process"] = {"each": ratios, "median": ratios[len(ratios) // 2]}
    print("server / in-process at saturation:", res["server_vs_in_process"], flush=True)
    path.write_text(json.dumps(res, indent=1))


def http_cpu(out_path: str, runs: int) -> None:
    """The CPU seconds the server's HTTP process (all its threads; the engine has a process of its own)
    spends per streamed token, on the CPU: a tiny model with the full 128,256-id tokenizer, 128
    requests of 200 tokens at once from one client process, `runs` times."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "tiny"
        checkpoint(folder, tiny=True)
        proc = start_server(folder, 8131, Path(out_path).with_suffix(".server.log"), max_model_len=512,
                            extra=("--max-num-seqs", "128"))
        url = "http://127.0.0.1:8131"

        def cpu_seconds() -> float:
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

        requests = [([5 + i % 1000 for i in range(j, j + 20)], 200) for j in range(128)]
        try:
            asyncio.run(run_bench(url, requests[:8], progress=False))  # warm-up
            for _ in range(runs):
                before = cpu_seconds()
                r = asyncio.run(run_bench(url, requests, progress=False))
                cpu = cpu_seconds() - before
                rows.append({"completed": r["completed"], "output_tokens": r["output_tokens"],
                             "duration_s": r["duration_s"], "http_cpu_s": cpu,
                             "http_cpu_us_per_token": 1e6 * cpu / r["output_tokens"]})
                print(rows[-1], flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    Path(out_path).write_text(json.dumps(header(runs=rows), indent=1))


def plot(out_path: str) -> None:
    import matplotlib.pyplot as plt

    res = json.loads(Path(out_path).read_text())
    runs = sorted(res["rates"], key=lambda r: r["rate"])
    rates = [r["rate"] for r in runs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    ax1.plot(rates, [r["output_throughput"] for r in runs], "o-", label="server, Poisson arrivals (128 requests)")
    for i, s in enumerate(res["saturation"]):
        ax1.axhline(s["output_throughput"], color="C1", ls="--", lw=1,
                    label="server, 256 requests at once" if i == 0 else None)
    ax1.axhline(res["in_process"]["output_tokens_per_s"], color="k", ls=":", label="in-process engine, 256 at once")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("request rate (requests/s)")
    ax1.set_ylabel("output tokens/s")
    ax1.set_ylim(0)
    ax1.legend(fontsize=8)
    ax1.set_title(f"throughput, {res['gpu']}", fontsize=10)
    for key, label, color in [("ttft_s", "TTFT", "C0"), ("itl_s", "ITL", "C2")]:
        for p, ls in [("p50", "-"), ("p99", "--")]:
            ax2.plot(rates, [r[key][p] * 1e3 for r in runs], ls, marker="o", color=color, label=f"{label} {p}")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("request rate (requests/s)")
    ax2.set_ylabel("milliseconds (log scale)")
    ax2.legend(fontsize=8)
    ax2.set_title("latency from the client's side (Llama-3.2-1B shape)", fontsize=10)
    fig.tight_layout()
    fig.savefig(Path(out_path).with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    commands(run=lambda out, *rates: main(out, [float(r) for r in rates] or RATES),
             saturation=lambda out, repeat, *flags: main(
                 out, [], repeat=int(repeat), profile="--profile" in flags, trace="--trace" in flags,
                 clients=next((int(f[8:]) for f in flags if f.startswith("clients=")), CLIENTS)),
             http_cpu=lambda out, n: http_cpu(out, int(n)), plot=plot)
