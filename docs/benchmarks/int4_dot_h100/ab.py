# ruff: noqa  (kept as it ran on the GPU: the source of int4_dot_h100.json, removed from the tree after this commit)
"""Candidate int4 tensor-core kernel (tools/_gpu_dotk.py) against the shipped kernels on the 8B layers."""
import itertools, json, statistics, sys, time
import torch
import torch.nn.functional as F
from bench_gemv import int_copies, copies, graph_us, layers
from copy_bandwidth import copy_bandwidth
from miniinfer.kernels import quant as kq
import candidate as dk

DT = torch.bfloat16
out_path = sys.argv[1]
gbps = copy_bandwidth()
res = {"gpu": torch.cuda.get_device_name(), "copy_GBps": gbps, "rows": {}}
CFGS = [dict(block_n=n, num_warps=w, split_k=s, stages=3) for n, w, s in itertools.product((64, 128, 256), (4, 8), (1, 2, 4, 8))]
t0 = time.time()
for name, (N, K) in layers("llama_8b").items():
    if name == "lm_head":
        continue
    ws = int_copies(N, K, 4, 128)
    ils = [dk.interleave(p, 128) for p, _ in ws[:1]]
    ils = [ils[0]] + [ils[0].clone() for _ in ws[1:]]
    bf = copies(N, K)
    nbytes = ws[0][0].numel() * 4 + ws[0][1].numel() * 2
    for M in (1, 16):
        x = torch.randn(M, K, device="cuda", dtype=DT)
        ref = x.float() @ kq.dequantize_t(ws[0][0], ws[0][1], 4, torch.float32)
        out32 = torch.zeros(M, N, device="cuda", dtype=torch.float32)

        def cand(il, s, cfg, v=2):
            if cfg["split_k"] > 1:
                out32.zero_()
                fn = dk.int4_dot2 if v == 2 else dk.int4_dot
                return fn(x, il, s, out32=out32, **cfg).to(DT)
            return (dk.int4_dot2 if v == 2 else dk.int4_dot)(x, il, s, **cfg)

        row = {"N": N, "K": K, "M": M, "copy_us": nbytes / gbps / 1e3}
        shipped = (lambda w: kq.int_gemv(x, *w, 4)) if M == 1 else (lambda w: kq.int_matmul(x, *w, 4))
        row["shipped"] = graph_us([lambda w=w: shipped(w) for w in ws])
        if M == 16:
            row["dequant_cublas"] = graph_us([lambda w=w: x @ kq.dequantize_t(w[0], w[1], 4, DT) for w in ws[:4]])
        row["bf16_cublas"] = graph_us([lambda w=w: F.linear(x, w) for w in bf])
        times = {}
        for cfg in CFGS:
            key = json.dumps(cfg, sort_keys=True)
            try:
                out = cand(ils[0], ws[0][1], cfg).float()
                err = (out - ref).abs().max().item() / ref.abs().max().item()
                assert err < 2e-2, err
                times[key] = graph_us([lambda il=il, w=w: cand(il, w[1], cfg) for il, w in zip(ils, ws)])
            except Exception as e:  # noqa
                times[key] = f"{type(e).__name__}: {str(e)[:200]}"
        for cfg in (dict(block_n=128, num_warps=4, split_k=1, stages=3), dict(block_n=128, num_warps=4, split_k=4, stages=3)):
            try:
                times["v1 " + json.dumps(cfg, sort_keys=True)] = graph_us([lambda w=w: cand(w[0], w[1], cfg, 1) for w in ws])
            except Exception as e:  # noqa
                times["v1 " + json.dumps(cfg, sort_keys=True)] = f"{type(e).__name__}: {str(e)[:200]}"
        row["candidate"] = times
        good = {k: v for k, v in times.items() if isinstance(v, float)}
        best = min(good, key=good.get)
        row["best"], row["best_us"] = best, good[best]
        res["rows"][f"{name}/{M}"] = row
        print(f"{name} M={M}: shipped {row['shipped']:.1f} us ({row['copy_us'] / row['shipped']:.0%} of copy), "
              f"best candidate {good[best]:.1f} us ({row['copy_us'] / good[best]:.0%}) {best}; bf16 cuBLAS "
              f"{row['bf16_cublas']:.1f}" + (f", dequant+cuBLAS {row['dequant_cublas']:.1f}" if M == 16 else "")
              + f" [{time.time() - t0:.0f}s]", flush=True)
        json.dump(res, open(out_path, "w"), indent=1)
    del ws, bf, ils
