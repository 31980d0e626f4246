"""Chapter 04 GPU benchmark: Triton RMSNorm, fused add+RMSNorm and RoPE against PyTorch, in GB/s and
% of the measured copy bandwidth; decode-size latencies; the model's prefill with each ops backend.

Hand-written tool.    python tools/bench_kernels.py run docs/benchmarks/kernels_h200.json
"""

import json
import tempfile

import torch
import torch.nn.functional as F
import transformers
from bench_static_decode import LLAMA_3_2_1B
from benchlib import commands, gpu_ms, graph_ms, header
from copy_bandwidth import copy_bandwidth

import miniinfer as mi

torch._dynamo.config.cache_size_limit = 256
DT = torch.bfloat16
EPS = 1e-5


def hf_rms_norm(x, w, eps=EPS):  # transformers' LlamaRMSNorm
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def hf_add_rms_norm(x, r, w, eps=EPS):
    s = x + r
    return hf_rms_norm(s, w, eps), s


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def hf_rope(q, k, cos, sin):  # transformers' apply_rotary_pos_emb, cos/sin of full width
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def ms(fn) -> float:
    """Milliseconds: the best of three medians (this machine's timings jump now and then)."""
    return gpu_ms(fn, runs=3)


def graph_us(fn, calls: int = 20) -> float:
    """Microseconds per call replayed inside a CUDA graph: GPU time without the host's launch
    overhead, which is how the engine's decode steps run (chapter 02)."""
    return graph_ms([fn] * calls, rep=100, runs=3) * 1e3


def copy_at(numel: int) -> float:
    """GB/s of y.copy_(x) for a bf16 tensor of this size: what a read + write can reach here."""
    x = torch.randn(numel, device="cuda", dtype=DT)
    y = torch.empty_like(x)
    return 2 * numel * 2 / (ms(lambda: y.copy_(x)) * 1e-3) / 1e9


def check(got, ref):
    for g, r in zip(got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple) else (ref,)):
        err = ((g.float() - r.float()).norm() / r.float().norm()).item()
        assert err < 1e-2, f"relative error {err}"


def bench_norms(compiled: dict) -> tuple[list, list]:
    norm_rows, fused_rows = [], []
    for hidden in (2048, 4096, 8192):
        for tokens in (1, 64, 4096, 32768):
            x, r = (torch.randn(tokens, hidden, device="cuda", dtype=DT) for _ in range(2))
            w = torch.randn(hidden, device="cuda", dtype=DT)
            check(mi.kernels.rms_norm(x, w, EPS), hf_rms_norm(x, w))
            check(mi.kernels.fused_add_rms_norm(x, r, w, EPS), hf_add_rms_norm(x, r, w))
            nbytes = (2 * tokens * hidden + hidden) * 2
            times = {"triton (ours)": ms(lambda: mi.kernels.rms_norm(x, w, EPS)),
                     "PyTorch eager (HF)": ms(lambda: hf_rms_norm(x, w)),
                     "F.rms_norm": ms(lambda: F.rms_norm(x, (hidden,), w, EPS)),
                     "torch.compile": ms(lambda: compiled["norm"](x, w))}
            norm_rows.append(row(f"{tokens} x {hidden}", tokens, hidden, nbytes, times))
            norm_rows[-1]["copy_same_size_GBps"] = copy_at(tokens * hidden)
            if tokens <= 64:
                norm_rows[-1]["graph_us"] = {"triton (ours)": graph_us(lambda: mi.kernels.rms_norm(x, w, EPS)),
                                             "F.rms_norm": graph_us(lambda: F.rms_norm(x, (hidden,), w, EPS)),
                                             "torch.compile": graph_us(lambda: compiled["norm"](x, w))}
            nbytes = (4 * tokens * hidden + hidden) * 2
            times = {"triton (ours)": ms(lambda: mi.kernels.fused_add_rms_norm(x, r, w, EPS)),
                     "PyTorch eager (HF)": ms(lambda: hf_add_rms_norm(x, r, w)),
                     "torch.compile": ms(lambda: compiled["add_norm"](x, r, w))}
            fused_rows.append(row(f"{tokens} x {hidden}", tokens, hidden, nbytes, times))
            if tokens <= 64:
                fused_rows[-1]["graph_us"] = {
                    "triton (ours)": graph_us(lambda: mi.kernels.fused_add_rms_norm(x, r, w, EPS)),
                    "torch.compile": graph_us(lambda: compiled["add_norm"](x, r, w))}
            print(f"norms {tokens} x {hidden} done", flush=True)
    return norm_rows, fused_rows


def bench_rope(compiled: dict) -> list:
    rows = []
    Hq, Hk, D = 32, 8, 128
    for tokens in (1, 64, 4096, 32768):
        q = torch.randn(tokens, Hq, D, device="cuda", dtype=DT)
        k = torch.randn(tokens, Hk, D, device="cuda", dtype=DT)
        tf = mi.model.transformer
        cos, sin = tf.rope_cos_sin(torch.arange(tokens, device="cuda"), tf.rope_inv_freq(D, 5e5).cuda())
        cos, sin = cos.to(DT), sin.to(DT)
        cos_full, sin_full = torch.cat((cos, cos), -1)[:, None], torch.cat((sin, sin), -1)[:, None]
        check(mi.kernels.apply_rope(q, k, cos, sin), hf_rope(q, k, cos_full, sin_full))
        nbytes = (2 * tokens * (Hq + Hk) * D + 2 * tokens * D // 2) * 2
        times = {"triton (ours)": ms(lambda: mi.kernels.apply_rope(q, k, cos, sin)),
                 "PyTorch eager (HF)": ms(lambda: hf_rope(q, k, cos_full, sin_full)),
                 "torch.compile": ms(lambda: compiled["rope"](q, k, cos_full, sin_full))}
        rows.append(row(f"{tokens} x ({Hq}+{Hk}) x {D}", tokens, None, nbytes, times))
        if tokens <= 64:
            rows[-1]["graph_us"] = {"triton (ours)": graph_us(lambda: mi.kernels.apply_rope(q, k, cos, sin)),
                                    "torch.compile": graph_us(lambda: compiled["rope"](q, k, cos_full, sin_full))}
    return rows


def row(shape, tokens, hidden, nbytes, times):
    return {"shape": shape, "tokens": tokens, "hidden": hidden, "bytes": nbytes,
            "us": {k: v * 1e3 for k, v in times.items()},
            "GBps": {k: nbytes / (v * 1e-3) / 1e9 for k, v in times.items()}}


def prefill() -> dict:
    config = transformers.LlamaConfig(**LLAMA_3_2_1B)
    with torch.device("cuda"):
        hf = transformers.LlamaForCausalLM(config).to(DT).eval()
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        model = mi.load_model(folder, device="cuda", dtype=DT)
    del hf
    ids = torch.randint(0, 10000, (4, 1024), device="cuda")
    res = {}
    with torch.no_grad():
        outs = {}
        for name in ("torch", "triton"):
            model.use_ops(name)
            outs[name] = model(ids)[:, -1].float()
            res[name] = ids.numel() / (gpu_ms(lambda: model(ids), warmup=100, rep=500) * 1e-3)
    agree = (outs["torch"].argmax(-1) == outs["triton"].argmax(-1)).float().mean().item()
    return {"shape": "Llama-3.2-1B (random bf16 weights), batch 4 x 1024", "tokens": ids.numel(),
            "tokens_per_s": {f"{k} ops": v for k, v in res.items()}, "next_token_agreement": agree}


COLORS = {"triton (ours)": "tab:blue", "PyTorch eager (HF)": "tab:orange", "F.rms_norm": "tab:green",
          "torch.compile": "tab:red"}


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    panels = [("rms_norm", "RMSNorm, hidden 4096"), ("fused_add_rms_norm", "add + RMSNorm, hidden 4096"),
              ("rope", "RoPE, q 32 x 128, k 8 x 128")]
    for ax, (op, title) in zip(axes, panels):
        rows = [r for r in res[op] if r["hidden"] in (None, 4096)]
        for impl in rows[0]["GBps"]:
            ax.plot([r["tokens"] for r in rows], [r["GBps"][impl] for r in rows], "o-", label=impl,
                    color=COLORS[impl])
        ax.axhline(res["copy_GBps"], color="black", linestyle="--", label="copy bandwidth")
        ax.set_xscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel("GB/s")
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=8)
    fig.suptitle(f"{res['gpu']}, bf16, torch {res['torch']}, triton {res['triton']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(out_path: str) -> None:
    torch.manual_seed(0)
    # dynamic=False: a kernel specialized to each shape, as a real model's fixed hidden size gets.
    compiled = {"norm": torch.compile(hf_rms_norm, dynamic=False),
                "add_norm": torch.compile(hf_add_rms_norm, dynamic=False),
                "rope": torch.compile(hf_rope, dynamic=False)}
    res = {**header(), "dtype": "bfloat16", "copy_GBps": copy_bandwidth(),
           "timing": "best of 3 triton.testing.do_bench medians, L2 flushed between runs"}
    res["rms_norm"], res["fused_add_rms_norm"] = bench_norms(compiled)
    res["rope"] = bench_rope(compiled)
    res["decode_us"] = [{"op": op, "shape": r["shape"], "us": r["us"], "graph_us": r["graph_us"]}
                        for op in ("rms_norm", "fused_add_rms_norm", "rope") for r in res[op] if r["tokens"] <= 64]
    res["prefill"] = prefill()
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    plot(res, out_path.removesuffix(".json") + ".png")
    bw = res["copy_GBps"]
    print(f"copy {bw:.0f} GB/s")
    for op in ("rms_norm", "fused_add_rms_norm", "rope"):
        for r in res[op]:
            print(f"{op:<19}{r['shape']:<24}" + "  ".join(f"{k[:12]}: {v / bw:5.1%}" for k, v in r["GBps"].items())
                  + "  | us: " + " ".join(f"{v:.1f}" for v in r["us"].values()))
    for r in res["rms_norm"]:
        print("copy at", r["shape"], f"{r['copy_same_size_GBps'] / bw:.1%}")
    for r in res["decode_us"]:
        print("graph", r["op"], r["shape"], {k: round(v, 2) for k, v in r["graph_us"].items()})
    print(res["prefill"])


if __name__ == "__main__":
    commands(run=main)
