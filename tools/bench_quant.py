"""Chapter 10 GPU benchmark: quantized matmuls and the engine with quantized weights and KV cache.

Hand-written tool. Parts (any of them, in one run, in the order given; results merge into the JSON):
    check    the Triton kernels against dequantize-then-matmul, compiled, on random odd shapes
    sweep    tile sizes, K-splits, warps and stages of the int8/int4 kernel per shape and batch
    kernels  GB/s of each format's matmul at the Llama-3.2-1B and an 8B-sized layer's shapes, batch
             1/16/256, against the copy bandwidth: bf16 (cuBLAS), int8, int4 (ours), int4
             dequantized then cuBLAS, fp8 (torch._scaled_mm)
    decode   batch-1 and batch-16 decode tokens/s of the engine per weight format, Llama-3.2-1B and 8B-sized shapes,
             each shape in a process of its own (decode:llama-1b: that shape alone, merged into the JSON)
    kv_check the attention kernels over e4m3 pools against the PyTorch references
    e2e      the end-to-end workload with the FP8 KV cache and with FP8 weights, against bf16
    (the GEMV at 1-16 rows and against gemlite and torchao: tools/bench_gemv.py int_sweep formats)
    python tools/bench_quant.py run docs/benchmarks/quant_h200.json check sweep kernels
    python tools/bench_quant.py plot docs/benchmarks/quant_h200.json
"""

import itertools
import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from benchlib import Results, commands, graph_ms
from copy_bandwidth import copy_bandwidth

import miniinfer as mi
from miniinfer.kernels import quant as kq
from miniinfer.layers import quantization as quant

DT = torch.bfloat16
# (name, N, K) of each projection: out_features, in_features
SHAPES = {"llama-1b": [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192)],
          "llama-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]}
BATCHES = (1, 16, 256)
FORMATS = {"int8": (8, None), "int4": (4, 128)}


def us(fn) -> float:
    """Microseconds per call, replayed from a CUDA graph (the engine's decode steps run so)."""
    return graph_ms([fn] * 10, rep=30, runs=2) * 1e3


def layer(fmt: str, N: int, K: int):
    torch.manual_seed(0)
    w = torch.randn(N, K, device="cuda", dtype=DT) * 0.02
    if fmt == "fp8":
        return w, quant.quantize_fp8(w)
    bits, group = FORMATS[fmt]
    codes, scale = quant.quantize_int(w, bits, group)
    return w, (quant.pack(codes, bits).t().contiguous(), scale.t().contiguous())


def check() -> dict:
    """Max error against dequantize-then-matmul in float32, on shapes no tile divides."""
    rows = []
    for (bits, group), dtype, (M, N, K) in itertools.product(
            [(8, None), (4, 128), (4, 32)], (torch.float32, torch.float16, torch.bfloat16),
            [(1, 37, 256), (3, 999, 384), (5, 1000, 384), (33, 515, 1024), (300, 77, 4096)]):
        torch.manual_seed(M + N)
        codes, scale = quant.quantize_int(torch.randn(N, K, device="cuda"), bits, group)
        scale = scale.to(dtype)
        packed = quant.pack(codes, bits)
        x = torch.randn(M, K, device="cuda", dtype=dtype)
        bias = torch.randn(N, device="cuda", dtype=dtype)
        ref = F.linear(x.float(), quant.dequantize(packed, scale, bits).float(), bias.float())
        out = kq.int_matmul(x, packed.t().contiguous(), scale.t().contiguous(), bits, bias)
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        rows.append({"bits": bits, "group": group, "dtype": str(dtype), "MNK": [M, N, K], "rel_err": err})
    worst = max(r["rel_err"] for r in rows)
    x = torch.randn(7, 5000, device="cuda", dtype=DT) * 3
    (a, sa), (b, sb) = kq.quantize_fp8(x), quant.quantize_fp8(x)
    fp8 = {"values_differing": int((a.float() != b.float()).sum()), "scale_max_diff": (sa - sb).abs().max().item()}
    print(f"fp8 row quantization against PyTorch: {fp8}", flush=True)
    print(f"check: {len(rows)} cases, worst relative error {worst:.2e}", flush=True)
    return {"cases": rows, "worst_rel_err": worst, "fp8_rows": fp8}


def sweep() -> dict:
    """Every config per (format, shape, batch); the fastest kept with its microseconds."""
    best = {}
    for fmt, (bits, group) in FORMATS.items():
        for model, shapes in SHAPES.items():
            for (name, N, K), M in itertools.product(shapes, (1, 16)):
                _, (packed, scale) = layer(fmt, N, K)
                x = torch.randn(M, K, device="cuda", dtype=DT)
                def run(cfg):
                    try:
                        return us(lambda: kq.int_matmul(x, packed, scale, bits, None, cfg))
                    except Exception as e:  # out of shared memory, for instance
                        print(f"  {cfg}: {type(e).__name__}", flush=True)
                        return float("inf")

                tiles = itertools.product((16,), (64, 128), (128, 256), (2, 4, 8))
                times = [(run(cfg), cfg) for cfg in (dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=4,
                                                          num_stages=2)
                                                     for bm, bn, bk, sk in tiles if not (group and group % bk))]
                for _, top in sorted(times, key=lambda tc: tc[0])[:1]:  # then warps and stages around the best
                    for warps, stages in ((2, 3), (8, 3), (4, 2), (4, 4)):
                        cfg = {**top, "num_warps": warps, "num_stages": stages}
                        times.append((run(cfg), cfg))
                t, cfg = min(times, key=lambda tc: tc[0])
                weight_bytes = packed.numel() * 4 + scale.numel() * 2
                key = f"{fmt}/{model}/{name}/{M}"
                best[key] = {"us": t, "config": cfg, "weight_GBps": weight_bytes / t / 1e3,
                             "default_us": us(lambda: kq.int_matmul(x, packed, scale, bits, None)),
                             "top5": sorted(times, key=lambda tc: tc[0])[:5]}
                print(f"{key}: {t:.1f} us ({best[key]['weight_GBps']:.0f} GB/s) with {cfg}; "
                      f"default {best[key]['default_us']:.1f} us", flush=True)
    return best


def kernels(gbps: float) -> dict:
    """Each format's matmul at each shape and batch: microseconds and bytes moved per second."""
    rows = []
    for model, shapes in SHAPES.items():
        for (name, N, K), M in itertools.product(shapes, BATCHES):
            x = torch.randn(M, K, device="cuda", dtype=DT)
            w, _ = layer("int8", N, K)
            w = w.to(DT)
            io = (M * K + M * N) * 2
            entry = {"model": model, "layer": name, "N": N, "K": K, "M": M, "us": {}, "GBps": {}}
            runs = {"bf16": (lambda: F.linear(x, w), N * K * 2)}
            for fmt, (bits, _group) in FORMATS.items():
                _, (packed, scale) = layer(fmt, N, K)
                nbytes = packed.numel() * 4 + scale.numel() * 2
                runs[fmt] = ((lambda p=packed, s=scale, b=bits: kq.int_matmul(x, p, s, b)), nbytes)
            _, (wq, ws) = layer("fp8", N, K)
            ws = ws.float().reshape(1, N)
            runs["fp8"] = ((lambda: fp8_matmul(x, wq, ws)), N * K + N * 4)
            for fmt, (fn, nbytes) in runs.items():
                t = us(fn)
                entry["us"][fmt] = t
                entry["GBps"][fmt] = (nbytes + io) / t / 1e3
            entry["fraction_of_copy"] = {f: g / gbps for f, g in entry["GBps"].items()}
            rows.append(entry)
            print(f"{model} {name} M={M}: " + ", ".join(f"{f} {t:.1f} us ({100 * entry['fraction_of_copy'][f]:.0f}%)"
                                                        for f, t in entry["us"].items()), flush=True)
    return {"rows": rows}


def fp8_matmul(x, wq, ws):
    xq, xs = kq.quantize_fp8(x)  # the activations' quantization is part of the cost
    return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=DT)


DECODE_SHAPES = ("llama-8b", "llama-1b")  # the goals' first


def decode(gbps: float, shape: str, res: dict, save=lambda res: None) -> dict:
    """Batch-1 decode tokens/s of the engine per weight format on one shape (the Llama-3.2-1B or an
    8B-sized Llama, random bf16 weights), added to res: against each format's floor (every weight byte
    read once per token); then 16 requests at once, served and on the device. One shape a process
    (main): after the 8B-sized rows the same process served the 1B shape's at up to half the rate a
    fresh one does."""
    import gc

    from bench_engine import batch1, llama_8b, models, served_and_step, timeline1

    res = dict(res)
    build = llama_8b if shape == "llama-8b" else lambda: models("llama")[1]
    res[shape] = {}
    for fmt in ("bf16", "int8", "int4", "fp8", "int4+int8-head"):
        model = build()  # anew for each format: two 8B models and a pool do not fit an 80 GB card
        layers, _, head = fmt.partition("+")  # "+int8-head": the LM head too (EngineConfig.quantize_lm_head)
        quant.quantize_model(model, None if layers == "bf16" else layers,
                             lm_head=head.removesuffix("-head") or None)
        tensors = {t.data_ptr(): t for t in itertools.chain(model.parameters(), model.buffers())
                   if t is not model.inv_freq}
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        r = batch1(model, gbps)
        t = timeline1(model, gbps)  # the step replayed on the device: no host in it
        d = res[shape][fmt] = {"tokens_per_s": r["tokens_per_s"], "weight_bytes": nbytes,
                               "floor_tokens_per_s": gbps * 1e9 / nbytes, "step_us": t["step_us"],
                               "kernels": t["kernels"], "by_class": t["by_class"]}
        d["fraction_of_floor"] = d["tokens_per_s"] / d["floor_tokens_per_s"]
        d["step_fraction_of_floor"] = nbytes / gbps / 1e3 / d["step_us"]
        d["speedup_vs_bf16"] = d["tokens_per_s"] / res[shape]["bf16"]["tokens_per_s"]
        d["step_speedup_vs_bf16"] = res[shape]["bf16"]["step_us"] / d["step_us"]
        b16 = d["batch16"] = served_and_step(model, batch=16)
        b16["speedup_vs_bf16"] = b16["tokens_per_s"] / res[shape]["bf16"]["batch16"]["tokens_per_s"]
        print(f"decode {shape} {fmt}: {r['tokens_per_s']:.0f} tok/s ({d['speedup_vs_bf16']:.2f}x bf16), "
              f"{nbytes / 1e9:.2f} GB of weights, {100 * d['fraction_of_floor']:.0f}% of its floor; step "
              f"{d['step_us']:.0f} us on the device ({d['step_speedup_vs_bf16']:.2f}x bf16, "
              f"{100 * d['step_fraction_of_floor']:.0f}% of its floor); batch 16: {b16['tokens_per_s']:.0f} "
              f"tok/s ({b16['speedup_vs_bf16']:.2f}x bf16), its step {b16['step_us']:.0f} us", flush=True)
        del model
        gc.collect()
        torch.cuda.empty_cache()
        save(res)  # format by format: a run cut short keeps what it measured
    return res


def kv_check() -> dict:
    """The Triton attention kernels over e4m3 pools against the PyTorch references over the same pools:
    store (saturating at 448), decode and prefill, bf16 queries."""
    torch.manual_seed(0)
    Hq, Hk, D, bs, nb = 8, 2, 64, 16, 64
    fp8 = torch.float8_e4m3fn
    k_cache, v_cache = (torch.zeros(nb, bs, Hk, D, device="cuda", dtype=fp8) for _ in range(2))
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    N = 300
    k, v = (torch.randn(N, Hk, D, device="cuda", dtype=DT) * 3 for _ in range(2))
    k[0, 0, 0] = 1000.0  # beyond e4m3's range: stored as 448
    slots = torch.randperm(nb * bs, device="cuda")[:N].int()
    mi.kernels.store_kv(k, v, k_cache, v_cache, slots)
    mi.store_kv_ref(k, v, k_ref, v_ref, slots)
    same = torch.equal(k_cache.float(), k_ref.float()) and torch.equal(v_cache.float(), v_ref.float())
    res = {"store_equal": bool(same),
           "saturated_to": k_cache.flatten(0, 1)[slots[0].long(), 0, 0].float().item()}
    tables = torch.randperm(nb, device="cuda").int().view(4, 16)
    lens = torch.tensor([1, 77, 200, 256], device="cuda", dtype=torch.int32)
    q = torch.randn(4, Hq, D, device="cuda", dtype=DT)
    out = mi.kernels.paged_attention(q, k_cache, v_cache, tables, lens, D ** -0.5)
    ref = mi.paged_attention_ref(q.float(), k_cache, v_cache, tables, lens, D ** -0.5)
    res["decode_max_err"] = (out.float() - ref).abs().max().item()
    qsl = torch.tensor([0, 1, 30, 130, 135], device="cuda", dtype=torch.int32)
    qp = torch.randn(135, Hq, D, device="cuda", dtype=DT)
    out = mi.kernels.prefill_attention(qp, k_cache, v_cache, qsl, lens, tables, D ** -0.5, 100)
    ref = mi.prefill_attention_ref(qp.float(), k_cache, v_cache, qsl, lens, tables, D ** -0.5)
    res["prefill_max_err"] = (out.float() - ref).abs().max().item()
    print(f"fp8 KV kernels: {res}", flush=True)
    return res


def e2e() -> dict:
    """The course's end-to-end workload on the Llama-3.2-1B shape: bf16, the FP8 KV cache, FP8 weights
    (and both); the pool sized from free memory each time. Greedy agreement with bf16 is the share of
    requests whose tokens are all the same (random weights make the logits nearly flat, so this is
    a harsh test of any rounding)."""
    import copy

    from bench_engine import engine_for, models, run_engine, workload

    _, base = models("llama")
    prompts, outs = workload()
    res, tokens = {}, {}
    for name, fmt, kv in (("bf16", None, None), ("fp8 KV", None, "fp8"), ("fp8 weights", "fp8", None),
                          ("fp8 weights + KV", "fp8", "fp8")):
        model = copy.deepcopy(base)
        if fmt:
            quant.quantize_model(model, fmt)
        engine = engine_for(model, kv_cache_dtype=kv)
        engine.generate(prompts[:8], mi.SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        r = run_engine(engine, prompts, outs)
        r.pop("trace")
        greedy = [mi.SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)] * 64
        tokens[name] = [o.token_ids for o in engine.generate(prompts[:64], greedy, use_tqdm=False)]
        r["same_tokens_as_bf16"] = sum(a == b for a, b in zip(tokens[name], tokens["bf16"])) / 64
        res[name] = r
        print(f"e2e {name}: {r['output_tokens_per_s']:.0f} output tok/s, {r['num_blocks']} blocks, "
              f"{100 * r['same_tokens_as_bf16']:.0f}% of 64 greedy requests as bf16", flush=True)
        del engine, model
    return res


PARTS = {"check": check, "sweep": sweep, "kv_check": kv_check,
         "e2e": e2e, "decode": decode, "kernels": kernels}


def main(out: str, parts: list[str]) -> None:
    results = Results(out)
    res = results.data
    res.setdefault("copy_GBps", copy_bandwidth())
    for part in parts:
        name, _, shape = part.partition(":")
        if name not in PARTS:
            raise SystemExit(f"unknown part {part!r}")
        if name == "decode" and not shape:  # each shape in a fresh process, merging into the file
            results.write()
            for one in DECODE_SHAPES:
                subprocess.run([sys.executable, __file__, "run", out, f"decode:{one}"], check=True)
            results.data = res = json.loads(Path(out).read_text())
        elif name == "decode":
            if shape not in DECODE_SHAPES:
                raise SystemExit(f"unknown shape {shape!r}: one of {DECODE_SHAPES}")
            res[name] = decode(res["copy_GBps"], shape, res.get("decode", {}), results.saver("decode"))
        else:
            res[part] = PARTS[part](res["copy_GBps"]) if part == "kernels" else PARTS[part]()
        results.write()


# Issue 42's goals for batch-1 decode against bf16
DECODE_GOALS = {("llama-8b", "int4"): 2.5, ("llama-8b", "int8"): 1.6, ("llama-8b", "fp8"): 1.6,
                ("llama-1b", "int4"): 1.8}


def plot(path: str) -> None:
    """The kernels' share of the copy bandwidth at one row (8B-sized layers) and batch-1 decode per
    format, beside the JSON."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.loads(Path(path).read_text())
    fmts = ("bf16", "int8", "int4", "fp8")
    fig, axes = plt.subplots(1, 2 if "kernels" in res else 1, figsize=(12 if "kernels" in res else 7, 4.2),
                             squeeze=False)
    if "kernels" in res:  # the kernels' table, where the run had that part
        a = axes[0][0]
        rows = [r for r in res["kernels"]["rows"] if r["model"] == "llama-8b" and r["M"] == 1]
        for i, f in enumerate(fmts):
            a.bar([j + 0.2 * i for j in range(len(rows))], [100 * r["fraction_of_copy"][f] for r in rows], 0.2, label=f)
        a.set_xticks([j + 0.3 for j in range(len(rows))], [r["layer"] for r in rows])
        a.set_ylabel("% of copy bandwidth")
        a.set_title("8B-sized layers, one row")
        a.legend()
    b = axes[0][-1]
    fmts = tuple(next(iter(res["decode"].values())))  # as the run had them (later runs add the head's)
    for i, shape in enumerate(res["decode"]):
        d = res["decode"][shape]
        x = [j + 0.4 * i for j in range(len(fmts))]
        b.bar(x, [d[f]["speedup_vs_bf16"] for f in fmts], 0.38, color=f"C{i}", label=f"{shape}, served")
        b.bar(x, [d[f].get("step_speedup_vs_bf16", 0) for f in fmts], 0.38, color="none", edgecolor="k",
              hatch="//", lw=0.6, label="hatched: the step on the device" if i == 0 else None)
        for j, f in enumerate(fmts):
            if (shape, f) in DECODE_GOALS:
                b.plot([x[j] - 0.19, x[j] + 0.19], [DECODE_GOALS[shape, f]] * 2, color="r", lw=2,
                       label="goal" if (i, j) == (1, 1) else None)
    b.axhline(1, color="gray", lw=0.8)
    b.set_xticks([j + 0.2 for j in range(len(fmts))], [f.replace("+", "\n+") for f in fmts])
    b.set_ylabel("tokens/s relative to bf16")
    b.set_title("batch-1 decode")
    b.legend(fontsize=8)
    fig.suptitle(f"{res['gpu']}, torch {res['torch']}, triton {res['triton']}, {res['date']}")
    fig.tight_layout()
    fig.savefig(Path(path).with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    commands(run=lambda out, *parts: main(out, list(parts)), plot=plot)
