"""Chapter 09 benchmark: speculative decoding, measured.

Hand-written tool. Parts (any of them, in one run, in the order given; results merge into the JSON):
    draft    the course model (pycoder) with its draft (pycoder-draft), greedy, the 20 held-out
             function prompts of tools/eval_course_model.py, 128 tokens each: tokens/s without
             speculation and with k = 1..8, acceptance rate, tokens per verifying step; at batch 1
             (requests one after another), and at the batches of --batches
    ngram    n-gram lookup on prompts whose answer repeats them: a held-out prompt, the course
             model's own completion of it, then the prompt again (so it writes the function again)
    forced   (GPU) the Llama-3.2-1B shape with random bf16 weights, where acceptance means nothing:
             a proposer of k guesses whose acceptance is forced to a set rate (the tokens are not
             the model's; only the time is measured), batch 1, against the same engine without
             speculation
    cost     (GPU) one forward over T = 1..16 tokens a request after 512 cached ones, from CUDA
             graphs, on the Llama-3.2-1B shape at batch 1 and 32, and the device's kernels for
             each T at batch 1 (torch.profiler)
    parity   greedy tokens with and without speculation (both methods, k = 1, 4, 8), the course
             pair, on this device
    python tools/bench_spec.py run docs/benchmarks/spec_cpu_2core.json draft ngram
    python tools/bench_spec.py run docs/benchmarks/spec_h200.json --batches 1,8,32 draft ngram forced
    python tools/bench_spec.py plot docs/benchmarks/spec_cpu_2core.json
"""

import argparse
import gc
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from benchlib import Results
from eval_course_model import PROMPTS

import miniinfer as mi
import miniinfer.worker.speculative as spec

KS = range(1, 9)
MAX_TOKENS = 128


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def greedy(n: int = MAX_TOKENS) -> mi.SamplingParams:
    return mi.SamplingParams(temperature=0, max_tokens=n)


def timed(config: mi.EngineConfig, prompts, batch: int, model=None, params=None) -> dict:
    """Serve prompts `batch` at a time (max_num_seqs), after a warm-up; tokens/s and what the
    speculation did."""
    engine = mi.LLMEngine(config, model=model)
    params = params or greedy()
    engine.generate(prompts[:batch], params, use_tqdm=False)  # warm-up: kernels, graphs
    before = engine.spec and mi.worker.step.SpecStats(**vars(engine.spec))
    if device() == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t
    res = {"tokens": sum(len(o.token_ids) for o in outs), "seconds": seconds}
    res["tokens_per_s"] = res["tokens"] / seconds
    if engine.spec is not None:
        s, b = engine.spec, before
        done = mi.worker.step.SpecStats(s.proposed - b.proposed, s.accepted - b.accepted,
                                                s.verified - b.verified)
        res.update(acceptance_rate=done.acceptance_rate, tokens_per_step=done.tokens_per_step)
    res["outputs"] = [o.token_ids for o in outs]
    return res


def config(batch: int, dtype: torch.dtype | None = None, **kw) -> mi.EngineConfig:
    dt = dtype or (torch.bfloat16 if device() == "cuda" else torch.float32)
    gc.collect()  # the engines before, with their pools and graphs
    if device() == "cuda":
        torch.cuda.empty_cache()
        kw.setdefault("num_blocks", 4096)  # 65k tokens: plenty here, and no profiling of free memory
    return mi.EngineConfig(device=device(), dtype=dt, max_num_seqs=batch, **kw)


def sweep(prompts, batch: int, method: dict, ks=KS) -> dict:
    base = timed(config(batch), prompts, batch)
    rows = {"off": base}
    print(f"batch {batch}: {base['tokens_per_s']:.0f} tok/s without speculation", flush=True)
    for k in ks:
        r = timed(config(batch, num_speculative_tokens=k, **method), prompts, batch)
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["same_tokens"] = r["outputs"] == base["outputs"]
        rows[str(k)] = r
        print(f"  k={k}: {r['tokens_per_s']:.0f} tok/s ({r['speedup']:.2f}x), acceptance {r['acceptance_rate']:.2f}, "
              f"{r['tokens_per_step']:.2f} tokens/step, same tokens: {r['same_tokens']}", flush=True)
    for r in rows.values():
        del r["outputs"]
    return rows


def repeat_prompts() -> list[str]:
    """Each held-out prompt, the course model's greedy completion, then the prompt again."""
    engine = mi.LLMEngine(config(8))
    outs = engine.generate(PROMPTS, greedy(96), use_tqdm=False)
    return [p + o.text + "\n\n" + p for p, o in zip(PROMPTS, outs)]


class ForcedProposer(spec.Proposer):
    """k guesses that are kept at a set rate: timing only (the tokens are not the model's)."""
    rate, rng = 0.8, np.random.default_rng(0)

    def __init__(self, config: mi.EngineConfig):
        self.config = config

    def propose(self, runner, out, room):
        return {rid: [1] * k for rid, k in room.items()}, None


def forced_verify(logits, s, guesses, q):
    has = guesses >= 0
    keep = torch.from_numpy(ForcedProposer.rng.random(len(guesses)) < ForcedProposer.rate).to(guesses.device)
    return has & keep, logits.argmax(-1)


def forced(rates=(0.5, 0.8, 0.9), ks=(1, 2, 3, 4, 6, 8)) -> dict:
    """Batch-1 decode on the Llama-3.2-1B shape with acceptance forced to each rate."""
    from bench_engine import models
    _, model = models("llama")
    prompts = [list(range(100 + i, 132 + i)) for i in range(4)]
    params = mi.SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    base = timed(config(1, max_model_len=2048), prompts, 1, model, params)
    print(f"Llama shape, batch 1: {base['tokens_per_s']:.0f} tok/s without speculation", flush=True)
    spec.PROPOSERS["ngram"] = ForcedProposer  # the ngram slot of the engine, for this process only
    spec.verify = forced_verify
    rows = {"off": {k: v for k, v in base.items() if k != "outputs"}}
    for rate in rates:
        for k in ks:
            ForcedProposer.rate, ForcedProposer.rng = rate, np.random.default_rng(0)
            r = timed(config(1, max_model_len=2048, speculative_method="ngram", num_speculative_tokens=k),
                      prompts, 1, model, params)
            del r["outputs"]
            r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
            rows[f"{rate}/{k}"] = r
            print(f"  rate {rate}, k={k}: {r['tokens_per_s']:.0f} tok/s ({r['speedup']:.2f}x), measured acceptance "
                  f"{r['acceptance_rate']:.2f}", flush=True)
    return rows


def cost(batches=(1, 32), lengths=range(1, 17)) -> dict:
    """Replay time of a forward over T tokens per request (the verifying forward of k = T-1)."""
    from bench_engine import models
    from torch.profiler import ProfilerActivity, profile
    _, model = models("llama")
    res: dict = {}
    for B in batches:
        cache = mi.VarlenKVCache(model.cfg, B * 34, 16, "cuda", torch.bfloat16)
        tables = [list(range(34 * b, 34 * b + 34)) for b in range(B)]
        for T in lengths:
            graphs = mi.worker.cuda_graphs.DecodeGraphs(model, cache, B, 2048, T)
            batch = mi.VarlenBatch.build([[7] * T] * B, tables, [512] * B, 16, "cuda")
            for _ in range(5):
                graphs(batch)
            times = []
            for _ in range(30):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graphs(batch)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            row = res.setdefault(str(B), {})[str(T)] = {"ms": statistics.median(times)}
            if B == 1:
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    graphs(batch)
                    torch.cuda.synchronize()
                kernels: dict = {}
                for e in prof.events():
                    if e.device_type.name == "CUDA":
                        kernels[e.name[:60]] = kernels.get(e.name[:60], 0) + e.device_time / 1e3
                row["top_kernels_ms"] = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:6])
            print(f"batch {B}, T={T}: {row['ms']:.3f} ms", flush=True)
            del graphs
    return res


def parity() -> dict:
    """In float32: in bfloat16 a verifying forward (k+1 tokens a request) rounds differently from a
    decode step, and near-ties may flip."""
    res = {}
    prompts = PROMPTS[:8]
    base = timed(config(4, torch.float32), prompts, 4)["outputs"]
    methods = [("draft", dict(speculative_model="pycoder-draft")), ("ngram", dict(speculative_method="ngram"))]
    for name, method in methods:
        for k in (1, 4, 8):
            engine = mi.LLMEngine(config(4, torch.float32, num_speculative_tokens=k, **method))
            outs = [o.token_ids for o in engine.generate(prompts, greedy(), use_tqdm=False)]
            bm = engine.block_manager
            res[f"{name}/{k}"] = {"same_tokens": outs == base, "blocks_back": bm.num_free_blocks == bm.num_blocks}
            print(name, k, res[f"{name}/{k}"], flush=True)
    return res


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    return f"{platform.machine()}, {os.cpu_count()} cores"


def main(out_path: str, parts: list[str], batches: list[int]) -> None:
    results = Results(out_path, device=torch.cuda.get_device_name() if device() == "cuda" else cpu_name(),
                      threads=torch.get_num_threads(), max_tokens=MAX_TOKENS)
    res = results.data
    for part in parts:
        if part == "draft":
            for b in batches:
                res.setdefault("draft", {})[str(b)] = sweep(PROMPTS, b, dict(speculative_model="pycoder-draft"))
        elif part == "ngram":
            prompts = repeat_prompts()
            for b in batches:
                res.setdefault("ngram", {})[str(b)] = sweep(prompts, b, dict(speculative_method="ngram"))
        elif part == "forced":
            res["forced"] = forced()
        elif part == "cost":
            res["cost"] = cost()
        elif part == "parity":
            res["parity"] = parity()
        else:
            raise ValueError(f"unknown part {part!r}")
        results.write()


def plot(out_path: str) -> None:
    """Speed-up against k: the course pair per batch and, where recorded, the forward's cost against
    its tokens and the forced-acceptance curves of the Llama shape."""
    import matplotlib.pyplot as plt

    res = json.loads(Path(out_path).read_text())
    panels = ["pair"] + [p for p in ("cost", "forced") if p in res]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.6), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "pair":
            for name, style in (("draft", "o-"), ("ngram", "s--")):
                for b, rows in res.get(name, {}).items():
                    ks = [k for k in rows if k != "off"]
                    ax.plot([int(k) for k in ks], [rows[k]["speedup"] for k in ks], style, ms=3,
                            label=f"{name}, batch {b}")
            ax.set_title("course model: pycoder-draft and n-grams", fontsize=9)
            ax.set_xlabel("k (guesses per step)")
            ax.set_ylabel("tokens/s over no speculation")
            ax.axhline(1, color="gray", lw=0.8)
        elif panel == "cost":
            for b, rows in res["cost"].items():
                ts = [int(t) for t in rows]
                ax.plot(ts, [rows[str(t)]["ms"] / rows["1"]["ms"] for t in ts], "o-", ms=3,
                        label=f"batch {b} ({rows['1']['ms']:.2f} ms at T=1)")
            ax.set_title("Llama-3.2-1B shape: a forward over T tokens a request", fontsize=9)
            ax.set_xlabel("T (tokens per request)")
            ax.set_ylabel("time over T = 1")
        else:
            rows = res["forced"]
            for rate in sorted({k.split("/")[0] for k in rows if k != "off"}):
                ks = sorted(int(k.split("/")[1]) for k in rows if k.startswith(rate + "/"))
                ax.plot(ks, [rows[f"{rate}/{k}"]["speedup"] for k in ks], "o-", ms=3,
                        label=f"each guess kept at {rate}")
            ax.set_title(f"Llama-3.2-1B shape, batch 1 ({rows['off']['tokens_per_s']:.0f} tok/s without)", fontsize=9)
            ax.set_xlabel("k (guesses per step)")
            ax.set_ylabel("tokens/s over no speculation")
            ax.axhline(1, color="gray", lw=0.8)
        ax.legend(fontsize=7)
    fig.suptitle(f"Speculative decoding, {res['device']}, torch {res['torch']} ({res['date']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(Path(out_path).with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("command", choices=["run", "plot"])
    ap.add_argument("out")
    ap.add_argument("parts", nargs="*")
    ap.add_argument("--batches", default="1", help="comma-separated batch sizes")
    args = ap.parse_args()
    if args.command == "run":
        main(args.out, args.parts, [int(b) for b in args.batches.split(",")])
    plot(args.out)
