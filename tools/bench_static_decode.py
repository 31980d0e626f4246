"""Chapter 02 GPU benchmark: batch-1 decode tokens/s on the Llama-3.2-1B shape (random bf16 weights).

Hand-written tool. Naive and cached decoding of miniinfer against `transformers` `generate` with
its static cache, all in one run, beside the floor (weight bytes / measured copy bandwidth).

    python tools/bench_static_decode.py run docs/benchmarks/static_decode_h200.json
"""

import json
import statistics
import tempfile
import time

import torch
import transformers
from benchlib import commands, header
from copy_bandwidth import copy_bandwidth

import miniinfer as mi

PROMPT, NEW = 32, 256
LLAMA_3_2_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                    max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
                    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192})


def timed(fn, repeats: int = 3) -> float:
    """Median seconds of fn() after one warm-up call (which absorbs compilation)."""
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(out_path: str) -> dict:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**LLAMA_3_2_1B)
    with torch.device("cuda"):
        hf = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        ours = mi.load_model(folder, device="cuda", dtype=torch.bfloat16)
    prompt = torch.randint(0, 10000, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    params = mi.SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    ids = torch.tensor([prompt], device="cuda")

    def hf_static():
        return hf.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                           cache_implementation="static")

    # Like transformers' compiled static cache, the cache and the recorded graph are made once.
    eager = mi.StaticBatchGenerator(ours, 1, PROMPT + NEW, cuda_graph=False)
    graph = mi.StaticBatchGenerator(ours, 1, PROMPT + NEW)
    runs = {
        "miniinfer naive": lambda: mi.generate_naive(ours, prompt, params),
        "miniinfer cached, eager": lambda: eager.generate([prompt], params),
        "miniinfer cached, CUDA graph": lambda: graph.generate([prompt], params),
        "transformers, static cache": hf_static,
    }
    results = {}
    for name, fn in runs.items():
        seconds = timed(fn)
        results[name] = {"seconds": seconds, "tokens_per_s": NEW / seconds}
        print(f"{name:>28}: {NEW / seconds:8.1f} tokens/s", flush=True)
    cached = graph.generate([prompt], params)[0]
    assert cached == mi.generate_cached(ours, prompt, params)  # a fresh generator: same tokens
    theirs = hf_static()[0, PROMPT:].tolist()
    same = sum(a == b for a, b in zip(cached, theirs))
    bw = copy_bandwidth()
    floor = bw * 1e9 / weight_bytes
    res = {**header(), "shape": "Llama-3.2-1B (random bf16 weights)",
           "prompt_tokens": PROMPT, "new_tokens": NEW, "weight_bytes": weight_bytes,
           "copy_GBps": bw, "floor_tokens_per_s": floor, "results": results,
           "greedy_tokens_equal_to_transformers_before_first_difference":
               next((i for i, (a, b) in enumerate(zip(cached, theirs)) if a != b), NEW),
           "greedy_tokens_equal_to_transformers": same,
           "cuda_graph_tokens_equal_to_eager": cached == eager.generate([prompt], params)[0]}
    print(f"{'floor':>28}: {floor:8.1f} tokens/s ({weight_bytes / 1e9:.2f} GB at {bw:.0f} GB/s)")
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    plot(res, out_path.removesuffix(".json") + ".png")
    return res


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["results"]) + ["floor (weights / copy bw)"]
    rates = [r["tokens_per_s"] for r in res["results"].values()] + [res["floor_tokens_per_s"]]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    colors = ["tab:blue" if "graph" in n else "tab:orange" if "transformers" in n
              else "black" if "floor" in n else "tab:gray" for n in names]
    ax.barh(names, rates, color=colors)
    for i, r in enumerate(rates):
        ax.text(r, i, f" {r:.0f}", va="center")
    ax.set_xlabel("decode tokens/s, batch 1")
    ax.set_title(f"{res['shape']}, {res['gpu']}, {res['prompt_tokens']}+{res['new_tokens']} tokens")
    ax.set_xlim(0, max(rates) * 1.15)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    commands(run=main)
