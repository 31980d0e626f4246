"""Chapter 07 GPU benchmark: prefix caching and chunked prefill in LLMEngine, on the Llama-3.2-1B
shape with random bf16 weights.

Hand-written tool. Parts (any of them, in one run, in the order given; results merge into the JSON):
    shared        256 requests in 8 groups, each sharing a 1,024-token prefix, plus 100..400 tokens
                  of their own, outputs 100..400, all arriving at once: throughput and time to first
                  token with prefix caching off and on
    hf_shared     transformers generate_batch on the same workload (one max_new_tokens: the mean)
    interference  64 requests decoding, then one 16,384-token prompt arrives: the decoders'
                  inter-token latency while it is prefilled, chunking off and at budgets 2,048 and 512
    noregress     chapter 06's workload (random prompts, no hits), both features off and on, three times
    parity        the course model's greedy tokens on the GPU, both features off and on
    step_profile  device time of one forward for the shared-prefix run's step shapes
    python tools/bench_prefix.py run docs/benchmarks/prefix_h200.json shared interference noregress
    python tools/bench_prefix.py plot docs/benchmarks/prefix_h200.json
"""

import json
import random
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from bench_engine import engine_for, greedy, hf_generate_batch, models, run_engine, workload
from benchlib import Results, commands
from copy_bandwidth import copy_bandwidth

LONG_PROMPT, LONG_ARRIVAL_S = 16384, 2.5  # by 2.5 s every decoder decodes, at any budget


def shared_workload(n: int = 256, groups: int = 8, seed: int = 0):
    rng = random.Random(seed)
    prefixes = [[rng.randint(0, 10000) for _ in range(1024)] for _ in range(groups)]
    prompts = [rng.choice(prefixes) + [rng.randint(0, 10000) for _ in range(rng.randint(100, 400))]
               for _ in range(n)]
    return prompts, [rng.randint(100, 400) for _ in range(n)]


def serve(engine, arrivals: list[tuple[float, list[int], int]]) -> dict:
    """Serve (arrival second, prompt, max_tokens) requests step by step; each token's time, by
    request in the order given."""
    order = sorted(range(len(arrivals)), key=lambda i: arrivals[i][0])
    index, arrived, times, steps = {}, [0.0] * len(arrivals), [[] for _ in arrivals], []
    cached, tokens = [0] * len(arrivals), [[] for _ in arrivals]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while order or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while order and arrivals[order[0]][0] <= now:
            i = order.pop(0)
            index[engine.add_request(arrivals[i][1], greedy(arrivals[i][2]))], arrived[i] = i, now
        if not engine.has_unfinished_requests():
            continue  # nothing to run until the next arrival
        outputs = engine.step()
        now = time.perf_counter() - t0
        steps.append((round(now, 5), len(engine.stats.scheduled), sum(engine.stats.scheduled.values())))
        for o in outputs:
            times[index[o.request_id]] += [now] * len(o.new_token_ids)
            if o.finished:
                cached[index[o.request_id]], tokens[index[o.request_id]] = o.num_cached_tokens, o.token_ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return {"seconds": now, "arrived": arrived, "times": times, "cached": cached, "tokens": tokens, "steps": steps}


def config(caching: bool, budget: int | None = None) -> dict:
    return dict(enable_prefix_caching=caching, enable_chunked_prefill=budget is not None,
                **({"max_num_batched_tokens": budget} if budget else {}))


def warm(engine) -> None:
    engine.generate([[1] * 600, [2] * 100], greedy(4), use_tqdm=False)  # Triton compiles its prefill kernels


def shared(model, budgets=(8192, 16384)) -> dict:
    """Caching off and on, at each token budget: every prefill step also carries the decodes of
    all running requests, so the budget sets how much of a step is prefill."""
    prompts, outs = shared_workload()
    res = {"workload": {"requests": len(prompts), "groups": 8, "prefix_tokens": 1024,
                        "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(outs)}}
    for budget in budgets:
        r = res[f"budget_{budget}"] = {}
        tokens = {}
        for name, caching in (("off", False), ("on", True)):
            engine = engine_for(model, max_num_batched_tokens=budget, **config(caching))
            warm(engine)
            run = serve(engine, [(0.0, p, o) for p, o in zip(prompts, outs)])
            ttft = [t[0] - a for t, a in zip(run["times"], run["arrived"])]
            r[name] = {"seconds": run["seconds"], "output_tokens_per_s": sum(outs) / run["seconds"],
                       "total_tokens_per_s": (sum(outs) + sum(map(len, prompts))) / run["seconds"],
                       "mean_ttft_s": statistics.mean(ttft), "p50_ttft_s": float(np.percentile(ttft, 50)),
                       "p99_ttft_s": float(np.percentile(ttft, 99)), "cached_prompt_tokens": sum(run["cached"]),
                       "computed_tokens": sum(s[2] for s in run["steps"]), "steps": run["steps"]}
            tokens[name] = run["tokens"]
            print(f"shared, budget {budget}, caching {name}: {r[name]['output_tokens_per_s']:.0f} output tok/s, "
                  f"mean TTFT {r[name]['mean_ttft_s']:.3f} s, cached {sum(run['cached'])} of "
                  f"{sum(map(len, prompts))}", flush=True)
            del engine
        # bf16 sums depend on the batch a token was computed in, so greedy paths may part; count them.
        r["same_tokens_on_and_off"] = sum(a == b for a, b in zip(tokens["off"], tokens["on"]))
        r["throughput_ratio"] = r["on"]["output_tokens_per_s"] / r["off"]["output_tokens_per_s"]
        r["ttft_ratio"] = r["off"]["mean_ttft_s"] / r["on"]["mean_ttft_s"]
    return res


def interference(model, num_decoders: int = 64, length: int = 1024, budgets=(2048, 512)) -> dict:
    """num_decoders requests of `length` prompt tokens and twice that many output tokens, then the long prompt."""
    rng = random.Random(1)
    decoders = [(0.0, [rng.randint(0, 4000) for _ in range(length)], 2 * length) for _ in range(num_decoders)]
    long = (LONG_ARRIVAL_S, [rng.randint(0, 4000) for _ in range(LONG_PROMPT)], 16)
    res = {"workload": {"decoders": num_decoders, "decoder_prompt": length, "decoder_output": 2 * length,
                        "long_prompt": LONG_PROMPT, "long_arrives_at_s": LONG_ARRIVAL_S}}
    configs = [("off", None)] + [(f"chunk_{b}", b) for b in budgets]
    for name, budget in configs:
        engine = engine_for(model, max_model_len=LONG_PROMPT + 512, **config(False, budget))
        warm(engine)
        r = serve(engine, decoders + [long])
        start, first = r["arrived"][-1], r["times"][-1][0]
        # The decoders' gaps between tokens that arrived while the long prompt was being prefilled
        # (and the gap that spans its arrival), and over the whole run.
        window = [b - a for t in r["times"][:-1] for a, b in zip(t, t[1:]) if b > start and a < first]
        every = [b - a for t in r["times"][:-1] for a, b in zip(t, t[1:])]
        res[name] = {"budget": budget or LONG_PROMPT + 512, "seconds": r["seconds"],
                     "total_tokens_per_s": (num_decoders * 3 * length + LONG_PROMPT + 16) / r["seconds"],
                     "long_ttft_s": first - start, "itl_window": [start, first],
                     "itl_p50_ms": 1e3 * float(np.percentile(window, 50)),
                     "itl_p99_ms": 1e3 * float(np.percentile(window, 99)), "itl_max_ms": 1e3 * max(window),
                     "itl_p50_all_ms": 1e3 * float(np.percentile(every, 50)),
                     "itl_p99_all_ms": 1e3 * float(np.percentile(every, 99)), "steps": r["steps"]}
        print(f"interference, {name}: decoders' ITL p50 {res[name]['itl_p50_ms']:.1f} ms, p99 "
              f"{res[name]['itl_p99_ms']:.1f} ms while the long prompt is prefilled; its TTFT "
              f"{res[name]['long_ttft_s']:.3f} s; {res[name]['total_tokens_per_s']:.0f} tok/s", flush=True)
        del engine
    for name, _ in configs[1:]:
        res[name]["p99_ratio"] = res["off"]["itl_p99_ms"] / res[name]["itl_p99_ms"]
    return res


def noregress(model) -> dict:
    prompts, outs = workload()
    res = {"off": [], "on": []}
    for name in ("off", "on") * 3:  # alternated, so that drift shows as spread, not as a gap
        engine = engine_for(model, **config(name == "on", 8192 if name == "on" else None))
        warm(engine)
        r = run_engine(engine, prompts, outs)
        res[name].append(r["output_tokens_per_s"])
        print(f"chapter 06 workload, features {name}: {r['output_tokens_per_s']:.0f} output tok/s", flush=True)
        del engine
    res["ratio"] = statistics.median(res["on"]) / statistics.median(res["off"])
    return res


def step_profile(model) -> dict:
    """Device time of one forward for the step shapes of the shared-prefix run: whole prompts,
    pieces after a cached 1,024-token prefix, and those with 200 decoders beside them."""
    from miniinfer.worker.kv_cache import VarlenKVCache

    bs, rng = 16, random.Random(2)
    cache = VarlenKVCache(model.cfg, 40000, bs, "cuda", torch.bfloat16)
    tables = [list(range(i * 100, i * 100 + 100)) for i in range(400)]

    def shape(full: int, pieces: int, decoders: int):
        tokens, cached = [], []
        for _ in range(full):
            tokens.append([rng.randint(0, 10000) for _ in range(1274)]), cached.append(0)
        for _ in range(pieces):
            tokens.append([rng.randint(0, 10000) for _ in range(250)]), cached.append(1024)
        for _ in range(decoders):
            tokens.append([rng.randint(0, 10000)]), cached.append(1300)
        return tokens, tables[:len(tokens)], cached

    res = {}
    for name, (full, pieces, decoders) in {"6 whole prompts": (6, 0, 0), "32 pieces after 1024 cached": (0, 32, 0),
                                           "32 pieces + 200 decoders": (0, 32, 200),
                                           "6 whole prompts + 200 decoders": (6, 0, 200),
                                           "200 decoders": (0, 0, 200)}.items():
        args = shape(full, pieces, decoders)
        for _ in range(3):
            cache.run(model, *args)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            cache.run(model, *args)
        end.record()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            cache.run(model, *args)
            torch.cuda.synchronize()
        top = sorted(((e.key, e.device_time_total / 1e3) for e in prof.key_averages()), key=lambda x: -x[1])[:6]
        res[name] = {"tokens": sum(map(len, args[0])), "ms": start.elapsed_time(end) / 10,
                     "top_kernels_ms": [(k[:60], round(t, 2)) for k, t in top]}
        print(name, res[name], flush=True)
    return res


def parity() -> dict:
    """Greedy tokens of the course model (trained weights, float32, Triton kernels) on the GPU with
    both features on and off: random bf16 weights give near-tied logits, where any change of batch
    shape may flip a token, so this is the end-to-end exactness check on the device."""
    import miniinfer as mi

    model = mi.load_model(None, device="cuda", dtype=torch.float32)
    tok = mi.load_tokenizer(None)
    rng = random.Random(3)
    heads = [tok(f'"""Module {i}: helpers."""\nimport os\nimport sys\n\n\n').input_ids * 8 for i in range(4)]
    prompts = [rng.choice(heads) + tok(f"def f{i}(x, y):\n").input_ids for i in range(64)]
    outs = {}
    for name, kw in (("off", {}), ("on", dict(enable_prefix_caching=True, enable_chunked_prefill=True,
                                             max_num_batched_tokens=256, block_size=8))):
        engine = mi.LLMEngine(mi.EngineConfig(device="cuda", dtype=torch.float32, max_model_len=1024, num_blocks=8192,
                                              **kw),
                              model=model, tokenizer=tok)
        outs[name] = [o.token_ids for o in engine.generate(prompts, greedy(48), use_tqdm=False)]
        outs[name] += [o.token_ids for o in engine.generate(prompts, greedy(48), use_tqdm=False)]  # again: hits
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        del engine
    same = sum(a == b for a, b in zip(outs["off"], outs["on"]))
    print(f"parity: {same} of {len(outs['on'])} requests give the same tokens with both features on", flush=True)
    return {"requests": len(outs["on"]), "same_tokens": same}


def main(out_path: str, parts: list[str]) -> None:
    results = Results(out_path, model="Llama-3.2-1B shape, random bf16 weights", copy_GBps=copy_bandwidth())
    res = results.data
    hf, model = models("llama")
    for part in parts:
        if part == "shared":
            res["shared"] = shared(model)
        elif part == "hf_shared":
            prompts, outs = shared_workload()
            res["hf_shared"] = hf_generate_batch(hf, prompts, outs)
        elif part == "interference":
            res["interference"] = interference(model)
        elif part == "noregress":
            res["noregress"] = noregress(model)
        elif part == "parity":
            res["parity"] = parity()
        elif part == "step_profile":
            res["step_profile"] = step_profile(model)
        else:
            raise ValueError(f"unknown part {part!r}")
        results.write()


def plot(out_path: str) -> None:
    import matplotlib.pyplot as plt

    res = json.loads(Path(out_path).read_text())
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4), gridspec_kw={"width_ratios": [1, 1.6, 1]})
    sh = res["shared"]
    budgets = [k for k in sh if k.startswith("budget_")]
    x = np.arange(len(budgets))
    for i, name in enumerate(("off", "on")):
        v = [sh[b][name]["output_tokens_per_s"] for b in budgets]
        ax1.bar(x + 0.4 * i - 0.2, v, 0.4, label=f"caching {name}", color=f"C{i}")
        for xi, vi in zip(x, v):
            ax1.text(xi + 0.4 * i - 0.2, vi, f"{vi:,.0f}", ha="center", va="bottom", fontsize=7)
    if "hf_shared" in res:
        ax1.axhline(res["hf_shared"]["output_tokens_per_s"], color="C7", ls="--", label="transformers generate_batch")
    ax1.set_xticks(x, [f"budget {int(b[7:]):,}\n"
                       f"TTFT {sh[b]['off']['mean_ttft_s']:.2f} -> {sh[b]['on']['mean_ttft_s']:.2f} s "
                       f"({sh[b]['ttft_ratio']:.1f}x)" for b in budgets], fontsize=8)
    ax1.set_ylabel("output tokens/s")
    ax1.legend(fontsize=7, loc="lower right")
    ax1.set_title("256 requests over 8 shared 1,024-token prefixes", fontsize=10)
    it = res["interference"]
    configs = [(k, "chunking off" if k == "off" else f"budget {it[k]['budget']:,}") for k in it if k != "workload"]
    for key, label in configs:  # the duration of each step around the long prompt's arrival
        t = np.array([s[0] for s in it[key]["steps"]])
        dt = np.diff(t, prepend=t[0]) * 1e3
        keep = (t > it[key]["itl_window"][0] - 0.2) & (t < it["off"]["itl_window"][1] + 1.0)
        ax2.plot(t[keep], dt[keep], ".-", ms=3, lw=0.8, label=f"{label}: p99 ITL {it[key]['itl_p99_ms']:.0f} ms")
    ax2.set_yscale("log")
    ax2.axvline(it["off"]["itl_window"][0], color="0.5", ls=":")
    ax2.set_xlabel("seconds")
    ax2.set_ylabel("step time = decoders' inter-token latency (ms)")
    w = it["workload"]
    ax2.set_title(f"{w['decoders']} decoders, a {w['long_prompt']:,}-token prompt arrives", fontsize=10)
    ax2.legend(fontsize=8)
    x = np.arange(len(configs))
    ax3.bar(x - 0.2, [it[k]["itl_p50_ms"] for k, _ in configs], 0.4, label="p50")
    ax3.bar(x + 0.2, [it[k]["itl_p99_ms"] for k, _ in configs], 0.4, label="p99")
    ax3.set_xticks(x, [label for _, label in configs])
    ax3.set_yscale("log")
    ax3.set_ylabel("decoders' ITL while it is prefilled (ms)")
    ax3.legend(fontsize=8)
    ax3.set_title(res["gpu"], fontsize=10)
    fig.tight_layout()
    fig.savefig(Path(out_path).with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    commands(run=lambda out, *parts: main(out, list(parts)), plot=plot)
