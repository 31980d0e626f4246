"""Chapter 13 GPU benchmark: a mixture-of-experts layer and model of Qwen3-30B-A3B's shape (random bf16
weights), our fused experts against `torch._grouped_mm` and transformers' own MoE block in the same run.

Hand-written tool. Parts (in the order given; results merge into the JSON):
    layer     one MoE layer (router and experts) at 1, 16, 256 and 4,096 tokens: ours (fused, eager and in a
              CUDA graph), the same routing through torch._grouped_mm, transformers' Qwen3MoeSparseMoeBlock
              (its default experts implementation), our one-expert-at-a-time reference; each against the bytes
              of the experts its tokens chose at the copy bandwidth, and checked against the reference
    sweep     the fused kernels' tiles at 1-4,096 tokens, in CUDA graphs (up to 32 pairs the per-pair kernel's
              too): the best, and moe_config's pick
    batch1    the model cut to 8 of its 48 layers: batch-1 decode tokens/s through the engine against its
              active-weight floor (what one token reads: attention, router, 8 experts a layer, LM head)
    workload  the same model on the course's 256-request workload against transformers' generate_batch

    python tools/bench_moe.py run docs/benchmarks/moe_h200.json layer sweep batch1 workload
    python tools/bench_moe.py plot docs/benchmarks/moe_h200.json     (the PNG beside it, on any machine)
"""

import gc
import itertools
import json
import tempfile
from pathlib import Path

import torch
import transformers
import triton
from bench_engine import engine_for, greedy, hf_generate_batch, run_engine, served_and_step, workload
from bench_gemv import graph_us
from benchlib import Results, commands, gpu_ms
from copy_bandwidth import copy_bandwidth

import miniinfer as mi
from miniinfer.kernels.moe import fused_experts, fused_route, moe_config
from miniinfer.layers.moe import experts_reference, route
from miniinfer.model.transformer import silu_and_mul

DT = torch.bfloat16
QWEN3_30B_A3B = dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                     moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                     max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
LAYERS = 8  # of 48: the model's weights would not fit one GPU's memory in bf16 with transformers' copy beside it


def grouped(x, weights, ids, w13, w2):
    """The experts through torch._grouped_mm: the pairs sorted by expert, one grouped GEMM for gate/up and one
    for down over the experts' runs (`offs`: each run's end), then each pair's weight and the sum per token."""
    k = ids.shape[1]
    order = ids.flatten().argsort(stable=True)
    offs = torch.bincount(ids.flatten(), minlength=w13.shape[0]).cumsum(0).to(torch.int32)
    h = silu_and_mul(torch._grouped_mm(x[order // k], w13.transpose(1, 2), offs=offs))
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs) * weights.flatten()[order, None].to(x.dtype)
    return torch.zeros_like(x).index_add_(0, order // k, y)


def cycled_us(fns: list) -> float:
    """Microseconds per call, each call the next of fns (one per copy of the layer)."""
    it = itertools.cycle(fns)
    return gpu_ms(lambda: next(it)(), rep=200) * 1e3


def layer(gbps: float) -> dict:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = transformers.Qwen3MoeConfig(**{k: v for k, v in QWEN3_30B_A3B.items() if k != "model_type"})
    cfg._experts_implementation = "grouped_mm"  # what transformers' model gives its blocks by default
    H, k, I = cfg.hidden_size, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    torch.manual_seed(0)
    blocks = []  # copies cycled through, so that a call finds its experts' weights in memory, not in L2
    for _ in range(4):
        with torch.device("cuda"):
            block = Qwen3MoeSparseMoeBlock(cfg).to(DT).eval()
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0, 0.02)
        blocks.append(block)
    res = {}
    for T in (1, 16, 256, 4096):
        x = torch.randn(T, H, device="cuda", dtype=DT)

        def ours(blk, experts=fused_experts):  # the router's top-k as the engine runs it on CUDA: one kernel
            weights, ids = fused_route(x @ blk.gate.weight.t(), k, True)
            return experts(x, weights, ids, blk.experts.gate_up_proj, blk.experts.down_proj)
        runs = {"ours_fused": ours, "torch_grouped_mm": lambda blk: ours(blk, grouped),
                "transformers": lambda blk: blk(x[None])[0], "ours_reference": lambda blk: ours(blk, experts_reference)}
        with torch.no_grad():
            ref = runs["ours_reference"](blocks[0]).float()
            row = {"tokens": T, "max_rel_err_vs_reference": {
                n: ((fn(blocks[0]).float() - ref).abs().max() / ref.abs().max()).item() for n, fn in runs.items()}}
            row["us"] = {n: cycled_us([lambda b=b, fn=fn: fn(b) for b in blocks]) for n, fn in runs.items()}
            row["us"]["ours_fused_graph"] = graph_us([lambda b=b: ours(b) for b in blocks])
        touched = route(x @ blocks[0].gate.weight.t(), k, True)[1].unique().numel()
        row.update(experts_touched=touched, floor_us=touched * 3 * H * I * 2 / gbps / 1e3)
        print(f"layer, {T} tokens ({touched} experts): " + ", ".join(f"{n} {v:.1f} us" for n, v in row["us"].items())
              + f"; floor {row['floor_us']:.1f} us; errors {row['max_rel_err_vs_reference']}", flush=True)
        res[str(T)] = row
    return res


SWEEP = [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=bk, num_warps=w, num_stages=3) for m in (16, 32, 64)
         for n in (32, 64, 128) for bk in (64, 128) for w in (4, 8)]
SWEEP_GEMV = [dict(BLOCK_N=n, BLOCK_K=bk, num_warps=w) for n in (1, 2, 4, 8) for bk in (256, 512, 1024)
              for w in (2, 4, 8) if n * bk <= 8192]  # the per-pair kernel, for few pairs (BLOCK_K: row_piece's most)


def sweep() -> dict:
    cfg = QWEN3_30B_A3B
    H, E, k, I = cfg["hidden_size"], cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    torch.manual_seed(0)
    layers = [(torch.randn(E, 2 * I, H, device="cuda", dtype=DT) * 0.02, torch.randn(E, H, I, device="cuda", dtype=DT)
               * 0.02, torch.randn(E, H, device="cuda", dtype=DT) * 0.02) for _ in range(4)]
    res = {}
    for T in (1, 2, 4, 16, 256, 4096):
        x = torch.randn(T, H, device="cuda", dtype=DT)
        routed = [(route(x @ g.t(), k, True), w13, w2) for w13, w2, g in layers]

        def timed(config):
            try:
                return graph_us([lambda r=r, config=config: fused_experts(x, *r[0], r[1], r[2], config=config)
                                 for r in routed])
            except triton.runtime.errors.OutOfResources:  # too large a tile for shared memory
                return float("inf")
        configs = SWEEP + (SWEEP_GEMV if T * k <= 32 else [])
        times = sorted((timed(c), i) for i, c in enumerate(configs))
        rule = moe_config(T * k, E, x.device)
        res[str(T)] = {"best_us": times[0][0], "best": configs[times[0][1]], "rule": rule, "rule_us": timed(rule),
                       "top5": [(t, configs[i]) for t, i in times[:5]]}
        if T * k <= 32:  # the best of each kernel
            res[str(T)]["best_tiled_us"] = min(t for t, i in times if "BLOCK_M" in configs[i])
            res[str(T)]["best_per_pair_us"] = min(t for t, i in times if "BLOCK_M" not in configs[i])
        print(f"sweep {T} tokens: {json.dumps({k: v for k, v in res[str(T)].items() if k != 'top5'})}", flush=True)
    return res


def models():
    """transformers' Qwen3-MoE and ours, cut to LAYERS layers, with the same random bf16 weights (the
    checkpoint written to shared memory: 10 GB)."""
    cfg = transformers.Qwen3MoeConfig(**{**{k: v for k, v in QWEN3_30B_A3B.items() if k != "model_type"},
                                         "num_hidden_layers": LAYERS, "eos_token_id": None, "bos_token_id": None})
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = transformers.Qwen3MoeForCausalLM(cfg).to(DT).eval()
    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
        hf.save_pretrained(folder)
        ours = mi.load_model(folder, device="cuda", dtype=DT)
    return hf, ours


def active_bytes(model) -> int:
    """The weights one decode token reads: everything but the embedding table (a row of it) and the experts
    its router did not choose."""
    total = sum(p.numel() for p in model.parameters()) - model.model.embed_tokens.weight.numel()
    moe = model.cfg.experts
    per_expert = 3 * model.cfg.hidden_size * moe.intermediate_size
    return 2 * (total - len(moe.sparse_layers) * (moe.num_experts - moe.top_k) * per_expert)


def batch1(model, gbps: float) -> dict:
    """Served tokens/s and the device's step (bench_engine's served_and_step), each against the
    active-weight floor."""
    res = served_and_step(model)
    nbytes = active_bytes(model)
    res.update(active_bytes=nbytes, floor_tokens_per_s=gbps * 1e9 / nbytes)
    res["fraction_of_floor"] = res["tokens_per_s"] / res["floor_tokens_per_s"]
    res["step_fraction_of_floor"] = res["step_tokens_per_s"] / res["floor_tokens_per_s"]
    print(f"batch 1: {res['tokens_per_s']:.0f} tok/s, {res['fraction_of_floor']:.0%} of the active floor; the step "
          f"{res['step_us']:.0f} us, {res['step_fraction_of_floor']:.0%}", flush=True)
    return res


def main(out: str, parts: list[str]) -> None:
    results = Results(out, copy_GBps=copy_bandwidth(), shape=dict(QWEN3_30B_A3B, layers_kept=LAYERS))
    res = results.data
    pair = None
    for part in parts:
        if part == "layer":
            res["layer"] = layer(res["copy_GBps"])
        elif part == "sweep":
            res["sweep"] = sweep()
        elif part in ("batch1", "workload"):
            if pair is None:
                pair = models()
            hf, ours = pair
            if part == "batch1":
                res["batch1"] = batch1(ours, res["copy_GBps"])
            else:
                prompts, outs = workload()
                engine = engine_for(ours)  # the collector first: batch 1's engine still holds its pool
                engine.generate(prompts[:8], greedy(8), use_tqdm=False)
                res["workload"] = {"ours": run_engine(engine, prompts, outs)}
                del engine
                gc.collect()
                torch.cuda.empty_cache()
                print(f"ours: {res['workload']['ours']['output_tokens_per_s']:.0f} output tok/s", flush=True)
                results.write()  # transformers' run may outlast the device's limit
                res["workload"]["hf_generate_batch"] = hf_generate_batch(hf, prompts, outs)
        else:
            raise SystemExit(f"unknown part {part!r}")
        results.write()


def plot(path: str) -> None:
    """The layer's time against its token count (ours in a graph and eager, torch._grouped_mm, transformers,
    the floor) and batch-1 decode and the workload against their references, as a PNG beside the JSON."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.loads(Path(path).read_text())
    rows = res["layer"].values()
    tokens = [r["tokens"] for r in rows]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.2), gridspec_kw={"width_ratios": [2, 1, 1]})
    for key, label, style in [("ours_fused_graph", "ours (CUDA graph)", "o-"), ("ours_fused", "ours (eager)", "o--"),
                              ("torch_grouped_mm", "torch._grouped_mm (eager)", "s--"),
                              ("transformers", "transformers' block (eager)", "^--")]:
        a.plot(tokens, [r["us"][key] for r in rows], style, label=label)
    a.plot(tokens, [r["floor_us"] for r in rows], "k:", label="chosen experts' bytes at copy bandwidth")
    a.set(xscale="log", yscale="log", xlabel="tokens in the step", ylabel="us per MoE layer",
          title="one MoE layer of Qwen3-30B-A3B's shape")
    a.legend(fontsize=8)
    b1 = res["batch1"]
    b.bar(["served", "device step", "floor"], [b1["tokens_per_s"], 1e6 / b1["step_us"], b1["floor_tokens_per_s"]],
          color=["#3182bd", "#9ecae1", "#bbbbbb"])
    b.set(ylabel="tokens/s", title=f"batch 1, {res['shape']['layers_kept']} of 48 layers: "
          f"{b1['fraction_of_floor']:.0%} of the floor")
    w = res["workload"]
    c.bar(["miniinfer", "transformers\ngenerate_batch"], [w["ours"]["output_tokens_per_s"],
                                                         w["hf_generate_batch"]["output_tokens_per_s"]],
          color=["#3182bd", "#bbbbbb"])
    c.set(ylabel="output tokens/s", title=f"256 requests: "
          f"{w['ours']['output_tokens_per_s'] / w['hf_generate_batch']['output_tokens_per_s']:.1f}x")
    fig.suptitle(f"{res['gpu']}, bf16, copy {res['copy_GBps']:,.0f} GB/s, torch {res['torch']}, triton {res['triton']}")
    fig.tight_layout()
    fig.savefig(Path(path).with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    commands(run=lambda out, *parts: main(out, list(parts)), plot=plot)
