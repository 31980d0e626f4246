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
    parity   greedy tokens with and without speculation (both methods, k = 1, 4, 8), the course
             pair, on this device
    python tools/bench_spec.py run docs/benchmarks/spec_cpu_2core.json draft ngram
    python tools/bench_spec.py run docs/benchmarks/spec_h200.json --batches 1,8,32 draft ngram forced
    python tools/bench_spec.py plot docs/benchmarks/spec_cpu_2core.json
"""

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers

import miniinfer as mi
import miniinfer.speculative as spec
from eval_course_model import PROMPTS

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
    before = engine.runner.spec and mi.model_runner.SpecStats(**vars(engine.runner.spec))
    if device() == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t
    res = {"tokens": sum(len(o.token_ids) for o in outs), "seconds": seconds}
    res["tokens_per_s"] = res["tokens"] / seconds
    if engine.runner.spec is not None:
        s, b = engine.runner.spec, before
        done = mi.model_runner.SpecStats(s.proposed - b.proposed, s.accepted - b.accepted, s.verified - b.verified)
        res.update(acceptance_rate=done.acceptance_rate, tokens_per_step=done.tokens_per_step)
    res["outputs"] = [o.token_ids for o in outs]
    return res


def config(batch: int, **kw) -> mi.EngineConfig:
    dt = torch.bfloat16 if device() == "cuda" else torch.float32
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
    sys.path.insert(0, str(Path(__file__).parent))
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


def parity() -> dict:
    res = {}
    prompts = PROMPTS[:8]
    base = timed(config(4), prompts, 4)["outputs"]
    methods = [("draft", dict(speculative_model="pycoder-draft")), ("ngram", dict(speculative_method="ngram"))]
    for name, method in methods:
        for k in (1, 4, 8):
            engine = mi.LLMEngine(config(4, num_speculative_tokens=k, **method))
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
    path = Path(out_path)
    res = json.loads(path.read_text()) if path.exists() else {}
    res.update(device=torch.cuda.get_device_name() if device() == "cuda" else cpu_name(),
               threads=torch.get_num_threads(), torch=torch.__version__, transformers=transformers.__version__,
               date=datetime.date.today().isoformat(), max_tokens=MAX_TOKENS)
    for part in parts:
        if part == "draft":
            res["draft"] = {str(b): sweep(PROMPTS, b, dict(speculative_model="pycoder-draft")) for b in batches}
        elif part == "ngram":
            res["ngram"] = {str(b): sweep(repeat_prompts(), b, dict(speculative_method="ngram")) for b in batches}
        elif part == "forced":
            res["forced"] = forced()
        elif part == "parity":
            res["parity"] = parity()
        else:
            raise ValueError(f"unknown part {part!r}")
        path.write_text(json.dumps(res, indent=1))


def plot(out_path: str) -> None:
    import matplotlib.pyplot as plt

    res = json.loads(Path(out_path).read_text())
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name in ("draft", "ngram"):
        for b, rows in res.get(name, {}).items():
            ks = [k for k in rows if k != "off"]
            ax.plot([int(k) for k in ks], [rows[k]["speedup"] for k in ks], "o-", label=f"{name}, batch {b}")
    ax.axhline(1, color="gray", lw=0.8)
    ax.set_xlabel("k (guesses per step)")
    ax.set_ylabel("tokens/s over no speculation")
    ax.set_title(f"Speculative decoding on {res['device']} ({res['date']})", fontsize=9)
    ax.legend(fontsize=7)
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
