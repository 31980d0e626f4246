"""Chapter 14 GPU benchmark: decode attention over DeepSeek-V2-Lite's latent cache (16 heads, a 512-wide
latent and a 64-wide rotary key per token, bf16), in CUDA graphs, each against the bytes it must read; and
the V2-Lite shape (layers cut) served end to end, and the blocks its pool holds against a GQA model's.

Hand-written tool. Parts (in the order given; results merge into the JSON):
    kernel    for each batch and context (every sequence that long, blocks of 16 scattered over the pool,
              copies enough that the L2 cache cannot hold them):
        latent    chapter 14's kernel (`latent_decode`): the cache read once, 576 numbers a token
        paged     chapter 05's decode kernel on the same pool, handed as keys and as values
        sdpa      torch's scaled_dot_product_attention on the absorbed form, over a contiguous copy of the
                  latents (no block tables): one KV head of 576, values its first 512
        rebuilt   the decompressed form: every head's keys and values rebuilt from the latents through
                  kv_b_proj (16 x (128 + 128) rows), then scaled_dot_product_attention (what prefill does,
                  at decode: it reads the latents and writes and reads 16 heads' keys and values)
              GB/s: the latent cache's bytes (batch x context x 576 x 2) over the time; the copy bandwidth beside
    sweep     the kernel's tile, warps, stages and programs per multiprocessor; the best and the rule's
    engine    DeepSeek-V2-Lite's shape cut to LAYERS layers (random bf16 weights) on the course's 256-request
              workload against transformers' static batching (generate, the first 64 requests, left-padded),
              same model, same run
    blocks    the KV blocks of 16 tokens each engine's pool holds at its default memory share: the V2-Lite
              cut against Qwen3-30B-A3B's shape (GQA, the same hidden size 2,048) cut alike

    python tools/bench_mla.py run docs/benchmarks/mla_h100.json kernel sweep blocks engine
    python tools/bench_mla.py plot docs/benchmarks/mla_h100.json     (the PNG beside it, on any machine)
    ncu --kernel-name regex:_latent_decode --launch-skip 2 --launch-count 1 --section SpeedOfLight \
        --section Occupancy --section WarpStateStats python tools/bench_mla.py once 16 4096
                                                 (the kernel three times at one batch and context, for a profiler)
"""

import gc
import json
import tempfile
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
import transformers
import triton
from bench_engine import engine_for, greedy, hf_static, run_engine, workload
from bench_gemv import graph_us
from benchlib import Results, commands
from copy_bandwidth import copy_bandwidth

import miniinfer as mi
from miniinfer.kernels.attention import paged_attention
from miniinfer.kernels.mla import latent_decode

DT = torch.bfloat16
H, RANK, ROPE, NOPE, V = 16, 512, 64, 128, 128  # DeepSeek-V2-Lite
D = RANK + ROPE
BLOCK = 16
SCALE = (NOPE + ROPE) ** -0.5
LAYERS = 8  # of V2-Lite's 27: the first dense, seven of experts
V2_LITE = dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
               num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2,
               num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None,
               qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, topk_method="greedy",
               max_position_embeddings=163840, rope_parameters=dict(
                   rope_type="yarn", rope_theta=10000.0, factor=40.0, mscale=0.707, mscale_all_dim=0.707,
                   beta_fast=32, beta_slow=1, original_max_position_embeddings=4096))
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8)


def world(batch: int, context: int, seed: int) -> dict:
    """One step's inputs: a pool holding batch sequences of `context` tokens in shuffled blocks."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    per = triton.cdiv(context, BLOCK)
    pool = torch.randn(batch * per, BLOCK, 1, D, device="cuda", dtype=DT, generator=g)
    tables = torch.randperm(batch * per, device="cuda", generator=g).view(batch, per).int()
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, H, D, device="cuda", dtype=DT, generator=g)
    # the same tokens, contiguous, for the forms without block tables
    flat = pool.flatten(0, 1)[(tables.long()[:, :, None] * BLOCK + torch.arange(BLOCK, device="cuda")).flatten(1)]
    return dict(pool=pool, tables=tables, lens=lens, q=q, flat=flat[:, :context, 0])


def rebuilt(w: dict, kv_b: torch.Tensor) -> torch.Tensor:
    """Keys and values of every head rebuilt from the latents, then SDPA: [B, H, V]."""
    latent, k_rope = w["flat"].split([RANK, ROPE], dim=-1)
    kv = (latent @ kv_b.t()).view(*latent.shape[:2], H, NOPE + V)
    k = torch.cat([kv[..., :NOPE], k_rope[:, :, None].expand(-1, -1, H, -1)], dim=-1)
    q = torch.randn_like(k[:, :1])  # a query per head in the decompressed space (192 wide)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), kv[..., NOPE:].transpose(1, 2),
                                         scale=SCALE)
    return out[:, :, 0]


def kernel(res: dict, save: Callable[[], None]) -> None:
    gbps = res["copy_GBps"]
    res.update(rows=[], shape=dict(heads=H, kv_lora_rank=RANK, rope_dim=ROPE, nope_dim=NOPE, v_dim=V,
                                   block_size=BLOCK))
    kv_b = torch.randn(H * (NOPE + V), RANK, device="cuda", dtype=DT) / RANK ** 0.5
    for batch in (1, 16, 64):
        for context in (1024, 4096, 16384):
            nbytes = batch * context * D * 2
            copies = min(64, -(-(256 << 20) // nbytes))  # 256 MB in all at least: not from the L2 cache
            worlds = [world(batch, context, s) for s in range(copies)]
            ref = latent_decode(worlds[0]["q"], worlds[0]["pool"], worlds[0]["tables"], worlds[0]["lens"], SCALE)
            check = paged_attention(worlds[0]["q"], worlds[0]["pool"], worlds[0]["pool"], worlds[0]["tables"],
                                    worlds[0]["lens"], SCALE)
            forms = {
                "latent": lambda w: latent_decode(w["q"], w["pool"], w["tables"], w["lens"], SCALE, max_len=context),
                "paged": lambda w: paged_attention(w["q"], w["pool"], w["pool"], w["tables"], w["lens"], SCALE,
                                                   max_len=context),
                "sdpa": lambda w: F.scaled_dot_product_attention(
                    w["q"][:, :, None], w["flat"][:, None], w["flat"][:, None, :, :RANK], scale=SCALE,
                    enable_gqa=True)[:, :, 0],
                "rebuilt": lambda w: rebuilt(w, kv_b),
            }
            row = {"batch": batch, "context": context, "latent_bytes": nbytes,
                   "max_abs_diff_latent_vs_paged": (ref.float() - check.float()).abs().max().item()}
            for name, fn in forms.items():
                if name == "rebuilt" and batch * context * H * (NOPE + ROPE + V) * 2 > 2**32 or \
                        name == "sdpa" and batch * context * H * D * 4 > 12 * 2**30:
                    us = float("nan")  # over 4 GB of rebuilt keys and values, or 12 GB of SDPA's keys per head
                else:
                    us = graph_us([lambda w=w, fn=fn: fn(w) for w in worlds])
                row[f"{name}_us"] = us
                row[f"{name}_GBps"] = nbytes / us / 1e3
            row["latent_fraction_of_copy"] = row["latent_GBps"] / gbps
            print(json.dumps(row), flush=True)
            res["rows"].append(row)
            del worlds
            torch.cuda.empty_cache()
            save()


def sweep(res: dict, save: Callable[[], None]) -> None:
    """The kernel's tile, warps, stages and programs per multiprocessor at batch 16 and 64, contexts of 4,096
    and 16,384: each configuration's time, the best, and the rule's (latent_decode's defaults)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res["sweep"] = []
    for batch, context in ((16, 4096), (64, 4096), (16, 16384)):
        nbytes = batch * context * D * 2
        worlds = [world(batch, context, s) for s in range(min(64, -(-(256 << 20) // nbytes)))]
        times = []
        for tile in (32, 64):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    for per_sm in (1, 2, 4):
                        splits = max(1, min(round(per_sm * sms / batch), context // (2 * tile)))
                        cfg = dict(tile=tile, num_warps=warps, num_stages=stages, num_splits=splits)
                        try:
                            us = graph_us([lambda w=w: latent_decode(w["q"], w["pool"], w["tables"], w["lens"], SCALE,
                                                                     **cfg) for w in worlds])
                        except triton.runtime.errors.OutOfResources:
                            continue
                        times.append((us, dict(cfg, per_sm=per_sm)))
        times.sort(key=lambda t: t[0])
        rule = graph_us([lambda w=w: latent_decode(w["q"], w["pool"], w["tables"], w["lens"], SCALE, max_len=context)
                         for w in worlds])
        row = {"batch": batch, "context": context, "best_us": times[0][0], "best": times[0][1],
               "best_GBps": nbytes / times[0][0] / 1e3, "rule_us": rule, "rule_GBps": nbytes / rule / 1e3,
               "top5": times[:5]}
        print(json.dumps({k: v for k, v in row.items() if k != "top5"}), flush=True)
        res["sweep"].append(row)
        del worlds
        torch.cuda.empty_cache()
        save()


def checkpoint(model_type: str, shape: dict, folder: str) -> transformers.PreTrainedModel:
    """A random bf16 model of the shape, cut to LAYERS layers, saved into folder (shared memory: 10 GB)."""
    cfg = transformers.AutoConfig.for_model(model_type, **shape, num_hidden_layers=LAYERS, eos_token_id=None,
                                            bos_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).eval()
    model.save_pretrained(folder)
    return model


def engine(res: dict, save: Callable[[], None]) -> None:
    """Ours, then transformers', on the 256 requests (ours written first: theirs may outlast the call)."""
    prompts, outs = workload()
    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
        hf = checkpoint("deepseek_v2", V2_LITE, folder)
        ours = engine_for(mi.load_model(folder, device="cuda", dtype=torch.bfloat16))
    ours.generate(prompts[:8], greedy(8), use_tqdm=False)  # warm-up: compiles, captures
    res["engine"] = {"layers_kept": LAYERS, "ours": run_engine(ours, prompts, outs)}
    print(f"ours: {res['engine']['ours']['output_tokens_per_s']:.0f} output tok/s", flush=True)
    del ours
    gc.collect()
    torch.cuda.empty_cache()
    save()
    # transformers 5.17's generate_batch fails on this model (its paged cache sizes a head by the config's
    # head_dim, 64 here, and the keys are 192 wide) and reports no tokens: its static batching, then
    res["engine"]["hf_static"] = hf_static(hf, prompts, outs)


def blocks(res: dict, save: Callable[[], None]) -> None:
    """Each model's pool at the engine's default memory share: blocks, bytes a block, tokens."""
    res["blocks"] = {}
    for name, model_type, shape in (("DeepSeek-V2-Lite (MLA)", "deepseek_v2", V2_LITE),
                                    ("Qwen3-30B-A3B (GQA)", "qwen3_moe", QWEN3_30B_A3B)):
        with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
            checkpoint(model_type, shape, folder)  # transformers' copy freed before ours loads
            e = engine_for(mi.load_model(folder, device="cuda", dtype=torch.bfloat16))
        runner = e.executor.runner
        res["blocks"][name] = row = {
            "num_blocks": e.block_manager.num_blocks, "bytes_per_block": runner.kv_bytes_per_block(),
            "pool_bytes": runner.cache.nbytes, "tokens": e.block_manager.num_blocks * e.config.block_size,
            "weight_bytes": sum(p.numel() * p.element_size() for p in runner.model.parameters())}
        print(name, json.dumps(row), flush=True)
        del e, runner
        gc.collect()
        torch.cuda.empty_cache()


def main(out: str, parts: list[str]) -> None:
    results = Results(out, copy_GBps=copy_bandwidth())
    for part in parts:
        {"kernel": kernel, "sweep": sweep, "engine": engine, "blocks": blocks}[part](results.data, results.write)
        results.write()


def plot(path: str) -> None:
    """GB/s of each form against the context (batch 16 and 64), and the workload against transformers'."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.loads(Path(path).read_text())
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.4), gridspec_kw={"width_ratios": [2, 1]})
    for batch, style in ((16, "--"), (64, "-")):
        rows = [r for r in res["rows"] if r["batch"] == batch]
        ctx = [r["context"] for r in rows]
        for key, label, color in (("latent", "latent kernel", "#3182bd"), ("paged", "chapter 05's kernel", "#e6550d"),
                                  ("rebuilt", "rebuilt + SDPA", "#999999")):
            a.plot(ctx, [r[f"{key}_GBps"] for r in rows], "o" + style, color=color, label=f"{label}, batch {batch}")
    a.axhline(res["copy_GBps"], color="k", ls=":", label="copy bandwidth")
    a.axhline(0.8 * res["copy_GBps"], color="k", ls="-.", lw=0.7, label="80% of copy")
    a.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="GB/s of latent cache read",
          title="decode attention over DeepSeek-V2-Lite's latent cache")
    a.legend(fontsize=7, ncol=2)
    if "engine" in res:
        w = res["engine"]
        ours, theirs = w["ours"]["output_tokens_per_s"], w["hf_static"]["output_tokens_per_s"]
        b.bar(["miniinfer", "transformers\ngenerate (64)"], [ours, theirs], color=["#3182bd", "#bbbbbb"])
        b.set(ylabel="output tokens/s", title=f"V2-Lite, {w['layers_kept']} of 27 layers, 256 requests: "
              f"{ours / theirs:.1f}x")
    fig.suptitle(f"{res['gpu']}, bf16, copy {res['copy_GBps']:,.0f} GB/s, torch {res['torch']}, triton {res['triton']}")
    fig.tight_layout()
    fig.savefig(Path(path).with_suffix(".png"), dpi=110)


def once(batch: int, context: int) -> None:
    w = world(batch, context, 0)
    for _ in range(3):
        latent_decode(w["q"], w["pool"], w["tables"], w["lens"], SCALE, max_len=context)
    torch.cuda.synchronize()


if __name__ == "__main__":
    commands(once=lambda batch, context: once(int(batch), int(context)), run=lambda out, *parts: main(out, list(parts)),
             plot=plot)
