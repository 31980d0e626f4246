"""Chapter 14 GPU benchmark: decode attention over DeepSeek-V2-Lite's latent cache (16 heads, a 512-wide
latent and a 64-wide rotary key per token, bf16), in CUDA graphs, each against the bytes it must read.

Hand-written tool. For each batch and context (every sequence that long, blocks of 16 scattered over the
pool, copies enough that the L2 cache cannot hold them):
    latent      chapter 14's kernel (`latent_decode`): the cache read once, 576 numbers a token
    paged       chapter 05's decode kernel on the same pool, handed as keys and as values
    sdpa        torch's scaled_dot_product_attention on the absorbed form, over a contiguous copy of the
                latents (no block tables): one KV head of 576, values its first 512
    rebuilt     the decompressed form: every head's keys and values rebuilt from the latents through
                kv_b_proj (16 x (128 + 128) rows), then scaled_dot_product_attention (what prefill does,
                at decode: it reads the latents and writes and reads 16 heads' keys and values)
GB/s: the latent cache's bytes (batch x context x 576 x 2) over the time; the copy bandwidth beside them.

    python tools/bench_mla.py OUT.json [sweep]    (sweep: the kernel's configurations, into the same JSON)
"""

import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from bench_gemv import graph_us
from copy_bandwidth import copy_bandwidth

from miniinfer.kernels.attention import paged_attention
from miniinfer.kernels.mla import latent_decode

DT = torch.bfloat16
H, RANK, ROPE, NOPE, V = 16, 512, 64, 128, 128  # DeepSeek-V2-Lite
D = RANK + ROPE
BLOCK = 16
SCALE = (NOPE + ROPE) ** -0.5


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


def main(out: str) -> None:
    gbps = copy_bandwidth()
    path = Path(out)
    res = json.loads(path.read_text()) if path.exists() else {}  # a sweep's, kept
    res.update(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               date=datetime.date.today().isoformat(), copy_GBps=gbps, rows=[],
               shape=dict(heads=H, kv_lora_rank=RANK, rope_dim=ROPE, nope_dim=NOPE, v_dim=V, block_size=BLOCK))
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
            path.write_text(json.dumps(res, indent=1) + "\n")


def sweep(out: str) -> None:
    """The kernel's tile, warps, stages and programs per multiprocessor at batch 16 and 64, contexts of 4,096
    and 16,384: each configuration's time, the best, and the rule's (latent_decode's defaults)."""
    path = Path(out)
    res = json.loads(path.read_text()) if path.exists() else {}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res["sweep"] = []
    for batch, context in ((16, 4096), (64, 4096), (16, 16384)):
        nbytes = batch * context * D * 2
        worlds = [world(batch, context, s) for s in range(min(64, -(-(256 << 20) // nbytes)))]
        times = []
        for tile in (32, 64):
            for warps in (4, 8):
                for stages in (2, 3):
                    for per_sm in (1, 2, 4, 8):
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
        path.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    (sweep if sys.argv[2:] == ["sweep"] else main)(sys.argv[1])
