"""Small-batch matmuls of decode on the GPU: our GEMV (kernels/gemv.py) against cuBLAS, one weight at
a time and a decoder layer's chain of kernels, each replayed from a CUDA graph. Hand-written tool.

Every timed call reads a different copy of the weight (copies totalling more than 4x the L2 cache),
as a decode step does: a weight read twice in a row would come from L2 and flatter the kernel.

Parts (any, in one run; results merge into the JSON):
    sweep   each layer shape of four models x rows 1, 2, 4 (gate/up gated, as the engine runs it): cuBLAS
            (F.linear) and every config of our GEMV, each the median of three rounds, the best recorded as
            the tuning table, and gemv_config's choice (rule_us); sweep:MODEL:MODEL@ROWS for some of them
    fused   the norm + qkv and norm + gate/up + SiLU pairs: two kernels (ours Triton norm or SiLU +
            cuBLAS) against one fused GEMV (its configs swept as well)
    chain   a layer's matmuls at one row, layer after layer: chapter 04's kernels and cuBLAS, the GEMVs
            with programmatic dependent launch (each launched while the one before drains), and without;
            and the GEMVs with the add and norm before them apart, in chapter 04's kernel
    int_sweep[:int4]  the int8/int4 GEMV's tiles at one row on the 1B and 8B layers (chapter 10's gemv_config)
    int_ab:BEFORE.py  the same layers at one row: the int GEMV against another copy of kernels/quant.py
            (an earlier commit's, `git show REV:miniinfer/kernels/quant.py > BEFORE.py`) and cuBLAS's bf16
    fp8_sweep  the fp8 GEMV's tiles at 1 and 2 rows on the same layers (chapter 10's fp8_config), beside
            torch._scaled_mm after our activation quantization and bf16 cuBLAS; its outputs checked
            against _scaled_mm's
    formats[:MODEL] the weight formats at 1-16 rows on the same layers: bf16 (cuBLAS, our GEMV), int8 and int4
            (our GEMV, our tiled kernel, what int_matmul picks), fp8 (torch._scaled_mm after our
            activation quantization), gemlite's A16W8 and A16W4, torchao's int4 weight-only; and at
            one row the int GEMV with SiLU-and-multiply inside against it apart; formats@1,16,64: other
            row counts, without the peers
    python tools/bench_gemv.py run docs/benchmarks/gemv_h100.json sweep fused
    python tools/bench_gemv.py run docs/benchmarks/gemv_tiles_h200.json sweep:llama_8b:llama_8b_tp2@1
    argmax  the greedy token of logits [B, vocab] (Llama-3's 128,256 and Qwen3's 151,936; B 1, 16, 256, bf16):
            torch.argmax against chapter 06's chunked argmax (kernels/argmax.py), checked equal
    python tools/bench_gemv.py plot docs/benchmarks/gemv_formats_h100.json docs/benchmarks/quant_decode_h100.json
        (the formats beside batch-1 decode per format from tools/bench_quant.py decode, as a PNG)
    python tools/bench_gemv.py plot_norm docs/benchmarks/gemv_norm_h200.json  (the norm inside or apart)
"""

import contextlib
import functools
import itertools
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_quant import DECODE_GOALS, fp8_matmul
from benchlib import Results, commands, graph_ms, load_file
from copy_bandwidth import copy_bandwidth

import miniinfer as mi
from miniinfer.kernels import norm_rope
from miniinfer.kernels import quant as kq
from miniinfer.kernels.argmax import chunked_argmax
from miniinfer.kernels.gemv import gemv
from miniinfer.layers import quantization as quant

DT = torch.bfloat16
EPS = 1e-6
# (hidden, intermediate, q heads, kv heads, head dim, vocab)
MODELS = {"llama_1b": (2048, 8192, 32, 8, 64, 128256), "qwen3_0_6b": (1024, 3072, 16, 8, 128, 151936),
          "llama_8b": (4096, 14336, 32, 8, 128, 128256),
          "llama_8b_tp2": (4096, 7168, 16, 4, 128, 64128)}  # one of two tensor-parallel ranks' (chapter 11)
ROWS = (1, 2, 4)


def layers(model: str) -> dict[str, tuple[int, int]]:
    """Each matmul of a decoder layer (and the LM head) as (N, K)."""
    H, inter, hq, hk, D, vocab = MODELS[model]
    return {"qkv": ((hq + 2 * hk) * D, H), "o": (H, hq * D), "gate_up": (2 * inter, H), "down": (H, inter),
            "lm_head": (vocab, H)}


def copies(N: int, K: int, bytes_at_least: int = 1 << 30) -> list[torch.Tensor]:
    n = max(2, -(-bytes_at_least // (N * K * 2)))
    return [torch.randn(N, K, device="cuda", dtype=DT) * 0.02 for _ in range(min(n, 64))]


def graph_us(fns: list) -> float:
    """Microseconds per call of fns (each once, in order) replayed from a CUDA graph: the best of 3."""
    return graph_ms(fns, rep=20, runs=3) * 1e3


CONFIGS = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w) for n, k, w in
           itertools.product((1, 2, 4, 8, 16), (256, 512, 1024, 2048), (4, 8)) if n * k <= 8192]


def tiles(call, ws: list, rounds: int = 3) -> tuple[dict, float, dict]:
    """Every config of CONFIGS timed with call(w, cfg) over every copy w, in `rounds` rounds of rotated
    order, each config's median of its rounds: a minimum over 30-odd single timings would pick the luckiest
    of them (an earlier sweep put gemv_config's own tile 10% behind itself) -> (the best config, its us,
    every config's us by its JSON)."""
    times: dict[str, list[float]] = {}
    for r in range(rounds):
        shift = r * len(CONFIGS) // rounds  # each round starts a third of the way further along
        for cfg in CONFIGS[shift:] + CONFIGS[:shift]:
            times.setdefault(json.dumps(cfg, sort_keys=True), []).append(
                graph_us([lambda w=w: call(w, cfg) for w in ws]))
    med = {k: statistics.median(v) for k, v in times.items()}
    best = min(med, key=med.__getitem__)
    return json.loads(best), med[best], med


def sweep(gbps: float, models: tuple[str, ...], rows: tuple[int, ...]) -> dict:
    """Each layer as the engine runs it (gate/up gated: silu(gate) * up inside) against cuBLAS (F.linear,
    then chapter 04's SiLU-and-multiply for gate/up), every tile of our GEMV, and gemv_config's (rule_us)."""
    res = {}
    for model in models:
        for name, (N, K) in layers(model).items():
            ws = copies(N, K)
            gated = name == "gate_up"
            for M in rows:
                x = torch.randn(M, K, device="cuda", dtype=DT)

                def cublas(w):
                    y = F.linear(x, w)
                    return mi.kernels.silu_and_mul(y) if gated else y

                def ours(w, cfg=None):
                    return gemv(x, w, gated=gated, config=cfg)[0]

                ref = cublas(ws[0])
                for cfg in CONFIGS:
                    if not torch.allclose(ours(ws[0], cfg).float(), ref.float(), atol=0.05, rtol=0.05):
                        raise AssertionError(f"{model} {name} {M} {cfg}: wrong")
                best, best_us, every = tiles(ours, ws)
                row = {"model": model, "layer": name, "N": N, "K": K, "gated": gated, "rows": M,
                       "cublas_us": graph_us([lambda w=w: cublas(w) for w in ws]), "ours_us": best_us,
                       "best_config": best, "rule_us": graph_us([lambda w=w: ours(w) for w in ws]), "configs_us": every}
                row["ours_GBps"] = N * K * 2 / (row["ours_us"] * 1e-6) / 1e9
                row["cublas_GBps"] = N * K * 2 / (row["cublas_us"] * 1e-6) / 1e9
                row["ours_of_copy"] = row["ours_GBps"] / gbps
                row["cublas_of_copy"] = row["cublas_GBps"] / gbps
                print(json.dumps({k: v for k, v in row.items() if k != "configs_us"}), flush=True)
                res[f"{model}/{name}/{M}"] = row
            del ws
            torch.cuda.empty_cache()
    return res


def fused(gbps: float) -> dict:
    """norm + matmul (+ SiLU) as two or three kernels against one, with the sweep's best configs."""
    res = {}
    for model in MODELS:
        H = MODELS[model][0]
        for name, (N, K) in layers(model).items():
            if name not in ("qkv", "gate_up", "lm_head"):
                continue
            ws = copies(N, K)
            nw = torch.randn(K, device="cuda", dtype=DT)
            gated = name == "gate_up"
            for M in ROWS:
                h, x = (torch.randn(M, H, device="cuda", dtype=DT) for _ in range(2))

                def unfused(w):
                    y = F.linear(mi.kernels.fused_add_rms_norm(h, x, nw, EPS)[0], w)
                    return mi.kernels.silu_and_mul(y) if gated else y
                ref = unfused(ws[0])
                def call(w, cfg):
                    return gemv(h, w, residual=x, norm=(nw, EPS), gated=gated, config=cfg)[0]
                for cfg in CONFIGS:
                    assert torch.allclose(call(ws[0], cfg).float(), ref.float(), atol=0.05, rtol=0.05), (model, name, M)
                best, best_us, _ = tiles(call, ws)
                row = {"model": model, "layer": name, "rows": M, "config": best,
                       "unfused_us": graph_us([lambda w=w: unfused(w) for w in ws]), "fused_us": best_us,
                       "rule_us": graph_us([lambda w=w: gemv(h, w, residual=x, norm=(nw, EPS), gated=gated)[0]
                                            for w in ws]),
                       "floor_us": N * K * 2 / gbps / 1e3}
                print(json.dumps(row), flush=True)
                res[f"{model}/{name}/{M}"] = row
            del ws
            torch.cuda.empty_cache()
    return res


@contextlib.contextmanager
def no_pdl():
    """The kernels launched without programmatic dependent launch."""
    saved, norm_rope.pdl = norm_rope.pdl, functools.cache(lambda device: False)
    try:
        yield
    finally:
        norm_rope.pdl = saved


def chain(gbps: float, layers_cap: int = 16) -> dict:
    """A decoder layer's matmuls at one row, layer after layer with their own weights (attention left
    out): chapter 04's kernels (add + norm, cuBLAS, SiLU) against chapter 06's GEMVs, with PDL and
    without."""
    out = {}
    for model, (H, _, hq, _, D, _) in MODELS.items():
        shapes = {k: v for k, v in layers(model).items() if k != "lm_head"}
        n_layers = min(layers_cap, -(-(1 << 30) // sum(N * K * 2 for N, K in shapes.values())))
        ws = [{k: torch.randn(N, K, device="cuda", dtype=DT) * 0.02 for k, (N, K) in shapes.items()}
              for _ in range(n_layers)]
        nw = torch.ones(H, device="cuda", dtype=DT)
        h, x = (torch.randn(1, H, device="cuda", dtype=DT) for _ in range(2))
        o_in = torch.randn(1, hq * D, device="cuda", dtype=DT)

        def today(w):
            y = F.linear(mi.kernels.fused_add_rms_norm(h, x, nw, EPS)[0], w["qkv"])
            F.linear(o_in, w["o"])
            y = mi.kernels.silu_and_mul(F.linear(mi.kernels.fused_add_rms_norm(h, x, nw, EPS)[0], w["gate_up"]))
            return F.linear(y, w["down"])

        def ours(w):
            gemv(h, w["qkv"], residual=x, norm=(nw, EPS))
            gemv(o_in, w["o"])
            y, _ = gemv(h, w["gate_up"], residual=x, norm=(nw, EPS), gated=True)
            return gemv(y, w["down"])[0]

        def apart(w):
            gemv(mi.kernels.fused_add_rms_norm(h, x, nw, EPS)[0], w["qkv"])
            gemv(o_in, w["o"])
            y, _ = gemv(mi.kernels.fused_add_rms_norm(h, x, nw, EPS)[0], w["gate_up"], gated=True)
            return gemv(y, w["down"])[0]

        torch.testing.assert_close(ours(ws[0]), today(ws[0]), atol=0.05, rtol=0.05)
        torch.testing.assert_close(apart(ws[0]), today(ws[0]), atol=0.05, rtol=0.05)
        row = {"layers": n_layers, "floor_us": sum(N * K * 2 for N, K in shapes.values()) / gbps / 1e3}
        for name, fn in (("today", today), ("gemv", ours), ("gemv_norm_apart", apart)):
            row[f"{name}_us"] = graph_us([lambda w=w: fn(w) for w in ws])
        with no_pdl():
            row["gemv_without_pdl_us"] = graph_us([lambda w=w: ours(w) for w in ws])
        print(model, json.dumps(row), flush=True)
        out[model] = row
        del ws
        torch.cuda.empty_cache()
    return out


INT_FORMATS = {"int8": (8, None), "int4": (4, 128)}
INT_MODELS = ("llama_1b", "llama_8b")
INT_CONFIGS = [dict(BLOCK_N=n, WORDS=w, num_warps=nw) for n, w, nw in
               itertools.product((8, 16, 32, 64), (64, 128, 256, 512, 1024), (4, 8)) if 1024 <= n * w <= 8192]


def how_many(nbytes: int) -> int:
    """Copies of a weight of nbytes that a timed loop cycles through: 256 MB, over 4x the L2 cache."""
    return max(2, min(64, -(-(1 << 28) // nbytes)))


def int_copies(N: int, K: int, bits: int, group: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(packed, scale) in IntLinear's layout, copied until the copies exceed 4x the L2 cache."""
    codes, scale = quant.quantize_int(torch.randn(N, K, device="cuda", dtype=DT) * 0.02, bits, group)
    one = (quant.pack(codes, bits).t().contiguous(), scale.t().contiguous())
    return [one] + [(one[0].clone(), one[1].clone()) for _ in range(how_many(one[0].numel() * 4) - 1)]


def int_layers(formats: tuple[str, ...] = tuple(INT_FORMATS)):
    """(format, bits, group, model, layer, N, K) of the int formats on the 1B and 8B layers, the LM head aside."""
    for fmt, (bits, group) in ((f, INT_FORMATS[f]) for f in formats):
        for model in INT_MODELS:
            for name, (N, K) in layers(model).items():
                if name != "lm_head":
                    yield fmt, bits, group, model, name, N, K


def int_sweep(gbps: float, formats: tuple[str, ...]) -> dict:
    res = {}
    for fmt, bits, group, model, name, N, K in int_layers(formats):
        ws = int_copies(N, K, bits, group)
        x = torch.randn(1, K, device="cuda", dtype=DT)
        times = sorted((graph_us([lambda w=w, c=c: kq.int_gemv(x, *w, bits, config=c) for w in ws]), i)
                       for i, c in enumerate(INT_CONFIGS))
        nbytes = ws[0][0].numel() * 4 + ws[0][1].numel() * 2
        row = {"N": N, "K": K, "best_us": times[0][0], "best_config": INT_CONFIGS[times[0][1]],
               "rule_us": graph_us([lambda w=w: kq.int_gemv(x, *w, bits) for w in ws]),
               "top5": [(t, INT_CONFIGS[i]) for t, i in times[:5]], "copy_us": nbytes / gbps / 1e3}
        print(f"int_sweep {fmt} {model} {name}: best {row['best_us']:.1f} us {row['best_config']}, "
              f"rule {row['rule_us']:.1f}, copy {row['copy_us']:.1f}", flush=True)
        res[f"{fmt}/{model}/{name}"] = row
        del ws
    return res


def int_ab(gbps: float, before: str) -> dict:
    """The int GEMV at one row against another copy of kernels/quant.py (BEFORE: an earlier commit's), each
    with its own gemv_config, and cuBLAS's bf16, on the 1B and 8B layers: us and the share of the copy
    bandwidth its bytes reach, interleaved in three rounds (the median of each)."""
    old = load_file(before)
    res = {}
    for fmt, bits, group, model, name, N, K in int_layers():
        ws, bf = int_copies(N, K, bits, group), copies(N, K)
        x = torch.randn(1, K, device="cuda", dtype=DT)
        runs = {"before": lambda w: old.int_gemv(x, *w, bits), "after": lambda w: kq.int_gemv(x, *w, bits)}
        for out in (runs["before"](ws[0]), runs["after"](ws[0])):  # both against the dequantized matmul
            ref = x.float() @ quant.dequantize(ws[0][0].t(), ws[0][1].t().float(), bits).T
            assert torch.allclose(out.float(), ref, rtol=2 ** -7, atol=1e-3), (fmt, model, name)
        times: dict[str, list[float]] = {}
        for _ in range(3):
            for key, run in runs.items():
                times.setdefault(key, []).append(graph_us([lambda w=w, run=run: run(w) for w in ws]))
            times.setdefault("bf16_cublas", []).append(graph_us([lambda w=w: F.linear(x, w) for w in bf]))
        nbytes = ws[0][0].numel() * 4 + ws[0][1].numel() * 2
        row = {key: statistics.median(t) for key, t in times.items()}
        row.update({f"{key}_of_copy": nbytes / gbps / 1e3 / row[key] for key in ("before", "after")},
                   N=N, K=K, config=kq.gemv_config(N, K, bits, x.device))
        print(f"int_ab {fmt} {model} {name}: before {row['before']:.1f} us, after {row['after']:.1f} us "
              f"({row['after_of_copy']:.0%} of the copy), bf16 {row['bf16_cublas']:.1f}", flush=True)
        res[f"{fmt}/{model}/{name}"] = row
        del ws, bf
    return res


FP8_CONFIGS = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w) for n, k, w in
               itertools.product((1, 2, 4, 8, 16), (512, 1024, 2048, 4096), (4, 8)) if 1024 <= n * k <= 16384]


def fp8_subnormals() -> float:
    """The fp8 GEMV on weights that are all e4m3 subnormals, against _scaled_mm: it reads them as
    float32 subnormals, which a flush to zero would lose (a relative error of 1)."""
    N, K = 64, 1024
    magnitude = torch.randint(1, 8, (N, K), device="cuda", dtype=torch.uint8)  # exponent 0, mantissa 1..7
    w = (magnitude | (torch.randint(0, 2, (N, K), device="cuda", dtype=torch.uint8) << 7)).view(quant.FP8)
    scale = torch.ones(N, 1, device="cuda")
    x = torch.randn(1, K, device="cuda", dtype=DT)
    ref = fp8_matmul(x, w, scale.reshape(1, N))
    return ((kq.fp8_gemv(x, w, scale) - ref).abs().max() / ref.abs().max()).item()


def fp8_sweep(gbps: float) -> dict:
    res = {"subnormal_weights_max_rel_err": fp8_subnormals()}
    print(f"fp8 GEMV on subnormal weights: relative error {res['subnormal_weights_max_rel_err']:.1e}", flush=True)
    for model in INT_MODELS:
        for name, (N, K) in layers(model).items():
            if name == "lm_head":
                continue
            wq, w_scale = quant.quantize_fp8(torch.randn(N, K, device="cuda", dtype=DT) * 0.02)
            fp8 = [(wq.clone(), w_scale.clone()) for _ in range(how_many(N * K))]
            ws = copies(N, K)
            for M in (1, 2):
                x = torch.randn(M, K, device="cuda", dtype=DT)
                ref = fp8_matmul(x, wq, w_scale.reshape(1, N))
                err = (kq.fp8_gemv(x, wq, w_scale) - ref).abs().max().item() / ref.abs().max().item()
                times = sorted((graph_us([lambda w=w, c=c: kq.fp8_gemv(x, *w, config=c) for w in fp8]), i)
                               for i, c in enumerate(FP8_CONFIGS))
                row = {"N": N, "K": K, "rows": M, "max_rel_err_vs_scaled_mm": err, "best_us": times[0][0],
                       "best_config": FP8_CONFIGS[times[0][1]],
                       "rule_us": graph_us([lambda w=w: kq.fp8_gemv(x, *w) for w in fp8]),
                       "top5": [(t, FP8_CONFIGS[i]) for t, i in times[:5]],
                       "scaled_mm_us": graph_us([lambda q=q, s=s: fp8_matmul(x, q, s.reshape(1, N)) for q, s in fp8]),
                       "bf16_cublas_us": graph_us([lambda w=w: F.linear(x, w) for w in ws]),
                       "copy_us": (N * K + 4 * N) / gbps / 1e3}
                print(f"fp8_sweep {model} {name} {M}: best {row['best_us']:.1f} us {row['best_config']}, rule "
                      f"{row['rule_us']:.1f}, _scaled_mm {row['scaled_mm_us']:.1f}, bf16 {row['bf16_cublas_us']:.1f}, "
                      f"copy {row['copy_us']:.1f}, err {err:.1e}", flush=True)
                res[f"{model}/{name}/{M}"] = row
            del fp8, ws
            torch.cuda.empty_cache()
    return res


def _linear(w: torch.Tensor) -> torch.nn.Linear:
    layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="cuda", dtype=DT).requires_grad_(False)
    layer.weight.copy_(w)
    return layer


def peers() -> dict:
    """The maintained kernels a user would pick instead, each a factory (w [N, K] bf16) -> callable(x),
    or the reason it cannot run here."""
    out: dict = {}
    try:
        from gemlite.helper import A16W8_INT8, A16Wn

        def gemlite_w4(w):
            codes, scale = quant.quantize_int(w, 4, 128)  # ours, symmetric: zero point 8 on unsigned codes
            u = (codes.to(torch.int16) + 8).to(torch.uint8)
            layer = A16Wn(device="cuda", dtype=DT).from_weights(u, scale, torch.full_like(scale, 8), 4, 128)
            return layer

        out["gemlite_a16w4"] = gemlite_w4
        out["gemlite_a16w8"] = lambda w: A16W8_INT8(device="cuda", dtype=DT).from_linear(_linear(w))
    except Exception as e:  # noqa: BLE001 - what the table says instead of a figure
        out["gemlite"] = f"{type(e).__name__}: {e}"
    try:
        from torchao.quantization import Int4WeightOnlyConfig, quantize_

        def torchao_w4(w, packing="tile_packed_to_4d"):
            layer = _linear(w)
            quantize_(layer, Int4WeightOnlyConfig(group_size=128, int4_packing_format=packing))
            return layer

        out["torchao_int4_tinygemm"] = torchao_w4
        out["torchao_int4_plain"] = lambda w: torchao_w4(w, "plain")
    except Exception as e:  # noqa: BLE001
        out["torchao"] = f"{type(e).__name__}: {e}"
    return out


def formats(gbps: float, save, models: tuple[str, ...], res: dict,
            rows: tuple[int, ...] = (1, 2, 4, 8, 16)) -> dict:
    """Adds the rows of `models` to res (the JSON's earlier rows: a run per model fits a device call);
    with rows other than the default, without the peers (their builds take most of a call). A layer
    whose rows res already has is kept, so a run cut short by the device's limit resumes where it
    stopped (delete the JSON to measure again)."""
    res.setdefault("peers_unavailable", {})
    makers = peers() if rows == (1, 2, 4, 8, 16) else {}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for model in models:
        for name, (N, K) in layers(model).items():
            if name == "lm_head" or all(f"{model}/{name}/{M}" in res for M in rows):
                continue
            w = torch.randn(N, K, device="cuda", dtype=DT) * 0.02
            ws = copies(N, K)
            ints = {fmt: int_copies(N, K, bits, group) for fmt, (bits, group) in INT_FORMATS.items()}
            wq, w_scale = quant.quantize_fp8(w)
            fp8 = [(wq.clone(), w_scale.float().reshape(1, N)) for _ in range(how_many(N * K))]
            built = {}
            for peer, make in makers.items():
                if isinstance(make, str):
                    res["peers_unavailable"][peer] = make
                    continue
                try:
                    built[peer] = [make(w) for _ in range(how_many(N * K // (2 if "4" in peer else 1)))]
                except Exception as e:  # noqa: BLE001
                    res["peers_unavailable"][peer] = f"{type(e).__name__}: {str(e)[:300]}"
            for M in rows:
                x = torch.randn(M, K, device="cuda", dtype=DT)
                runs = {"bf16_cublas": [lambda w=w: F.linear(x, w) for w in ws],
                        "fp8_scaled_mm": [lambda q=q, s=s: fp8_matmul(x, q, s) for q, s in fp8]}
                if M <= 4:
                    runs["bf16_gemv"] = [lambda w=w: gemv(x, w) for w in ws]
                if M == 1:
                    runs["fp8_gemv"] = [lambda q=q, s=s: kq.fp8_gemv(x, q, s.reshape(N, 1)) for q, s in fp8]
                for fmt, (bits, group) in INT_FORMATS.items():
                    tiled = kq.int_config(M, N, K, bits, group or K, sms)
                    runs[f"{fmt}_gemv"] = [lambda w=w, b=bits: kq.int_gemv(x, *w, b) for w in ints[fmt]]
                    runs[f"{fmt}_tiled"] = [lambda w=w, b=bits, c=tiled: kq.int_matmul(x, *w, b, None, c)
                                            for w in ints[fmt]]
                    runs[f"{fmt}_picked"] = [lambda w=w, b=bits: kq.int_matmul(x, *w, b) for w in ints[fmt]]
                for peer, layers_ in built.items():
                    runs[peer] = [lambda m=m: m(x) for m in layers_]
                row = {"model": model, "layer": name, "N": N, "K": K, "rows": M, "us": {}}
                for key, fns in runs.items():
                    try:
                        row["us"][key] = graph_us(fns)
                    except Exception as e:  # noqa: BLE001
                        res["peers_unavailable"][f"{key}@{M}"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(model, name, M, json.dumps({k: round(v, 1) for k, v in row["us"].items()}), flush=True)
                res[f"{model}/{name}/{M}"] = row
            if name == "gate_up" and makers:  # one row: SiLU-and-multiply in the GEMV's epilogue or a kernel after it
                h = torch.randn(1, K, device="cuda", dtype=DT)
                for fmt, (bits, _) in INT_FORMATS.items():
                    def apart(wq, b=bits):
                        return mi.kernels.silu_and_mul(kq.int_gemv(h, *wq, b))

                    def inside(wq, b=bits):
                        return kq.int_gemv(h, *wq, b, gated=True)
                    torch.testing.assert_close(inside(ints[fmt][0]), apart(ints[fmt][0]), atol=0.05, rtol=0.05)
                    res[f"{model}/{name}/silu_{fmt}"] = {
                        "apart_us": graph_us([lambda w=w: apart(w) for w in ints[fmt]]),
                        "inside_us": graph_us([lambda w=w: inside(w) for w in ints[fmt]])}
                    print(model, name, fmt, res[f"{model}/{name}/silu_{fmt}"], flush=True)
            del ws, ints, fp8, built
            torch.cuda.empty_cache()
            save(res)  # layer by layer: a run cut short keeps what it measured
    return res


def argmax_part() -> dict:
    res = {}
    for vocab in (128256, 151936):
        for B in (1, 16, 256):
            xs = [torch.randn(B, vocab, device="cuda", dtype=DT) for _ in range(8)]
            for x in xs:
                assert torch.equal(chunked_argmax(x), x.argmax(-1))
            row = {"torch_us": graph_us([lambda x=x: x.argmax(-1) for x in xs]),
                   "chunked_us": graph_us([lambda x=x: chunked_argmax(x) for x in xs])}
            print("argmax", vocab, B, json.dumps(row), flush=True)
            res[f"{vocab}/{B}"] = row
    return res


def main(out: str, parts: list[str]) -> None:
    results = Results(out, copy_GBps=copy_bandwidth())
    res = results.data
    for part in parts:
        if part.startswith("sweep"):  # sweep, sweep:llama_8b:llama_8b_tp2 (those models), sweep@1 (one row)
            part, _, rows = part.partition("@")
            res.setdefault("sweep", {}).update(sweep(res["copy_GBps"], tuple(part.split(":")[1:]) or tuple(MODELS),
                                                     tuple(map(int, rows.split(","))) if rows else ROWS))
        elif part == "chain":
            res["chain"] = chain(res["copy_GBps"])
        elif part == "argmax":
            res[part] = argmax_part()
        elif part == "fused":
            res["fused"] = fused(res["copy_GBps"])
        elif part.startswith("int_sweep"):  # int_sweep, int_sweep:int4 (one format's rows, the others kept)
            res.setdefault("int_sweep", {}).update(int_sweep(res["copy_GBps"], tuple(part.split(":")[1:]) or
                                                             tuple(INT_FORMATS)))
        elif part == "fp8_sweep":
            res[part] = fp8_sweep(res["copy_GBps"])
        elif part.startswith("int_ab:"):  # int_ab:tools/quant_before.py
            res["int_ab"] = int_ab(res["copy_GBps"], part.split(":", 1)[1])
        elif part.startswith("formats"):  # formats, formats:llama_8b (one model's rows, the others kept), formats@1,64
            part, _, rows = part.partition("@")
            models = tuple(part.split(":")[1:]) or INT_MODELS
            res["formats"] = formats(res["copy_GBps"], results.saver("formats"), models, res.get("formats", {}),
                                     tuple(map(int, rows.split(","))) if rows else (1, 2, 4, 8, 16))
        else:
            raise SystemExit(f"unknown part {part!r}")
        results.write()


FORMAT_STYLE = {"bf16_cublas": ("bf16, cuBLAS", "#bdbdbd"), "fp8_scaled_mm": ("fp8, _scaled_mm", "#fdae6b"),
                "fp8_gemv": ("fp8, ours", "#e6550d"),
                "int8_picked": ("int8, ours", "#9ecae1"), "gemlite_a16w8": ("int8, gemlite", "#a1d99b"),
                "int4_picked": ("int4, ours", "#3182bd"), "gemlite_a16w4": ("int4, gemlite", "#31a354"),
                "torchao_int4_tinygemm": ("int4, torchao", "#756bb1")}


def plot(formats_path: str, decode_path: str) -> None:
    """Three panels beside the formats JSON: the 8B layers at one row against the copy bandwidth; int4
    against bf16 at 1-16 rows; batch-1 decode per format against bf16, with the issue's goals."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.loads(Path(formats_path).read_text())
    decode = json.loads(Path(decode_path).read_text())
    dec = decode["decode"]
    f, gbps = res["formats"], res["copy_GBps"]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.2), gridspec_kw={"width_ratios": [1.6, 1.2, 1]})
    names = ("qkv", "o", "gate_up", "down")
    width = 0.8 / len(FORMAT_STYLE)
    for i, (key, (label, color)) in enumerate(FORMAT_STYLE.items()):
        frac = []
        for name in names:
            r = f[f"llama_8b/{name}/1"]
            nbytes = r["N"] * r["K"] * 2  # bf16 bytes: the bar is the speed of the same layer, bf16 copy = 1
            frac.append(nbytes / gbps / 1e3 / r["us"][key])
        a.bar([j + i * width for j in range(len(names))], frac, width, label=label, color=color)
    a.axhline(1, color="k", lw=0.8)
    a.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], [f"8B {n}" for n in names])
    a.set(ylabel="bf16 bytes at copy speed / time", title="one row: each layer alone (1 = bf16 at the copy bandwidth)")
    a.legend(fontsize=7, ncol=2)
    for name, ls in zip(names, ("-", "--", ":", "-.")):
        for key in ("int4_picked", "gemlite_a16w4", "torchao_int4_tinygemm"):
            rows, color = (1, 2, 4, 8, 16), FORMAT_STYLE[key][1]
            b.plot(rows, [f[f"llama_8b/{name}/{m}"]["us"]["bf16_cublas"] / f[f"llama_8b/{name}/{m}"]["us"][key]
                          for m in rows], color=color, ls=ls, lw=1.2,
                   label=f"{FORMAT_STYLE[key][0]}" if name == "qkv" else None)
    b.axhline(1, color="k", lw=0.8)
    b.set(xscale="log", xticks=(1, 2, 4, 8, 16), xticklabels=("1", "2", "4", "8", "16"), xlabel="rows",
          ylabel="bf16 cuBLAS time / int4 time", title="8B layers (line style: qkv, o, gate_up, down)")
    b.legend(fontsize=7)
    fmts = [m for m in ("int8", "int4", "int4+int8-head", "fp8") if m in dec["llama-8b"]]
    for i, shape in enumerate(("llama-1b", "llama-8b")):
        xs = [j + 0.4 * i for j in range(len(fmts))]
        c.bar(xs, [dec[shape][m]["speedup_vs_bf16"] for m in fmts], 0.4, label=f"{shape}, served",
              color=("#9ecae1", "#3182bd")[i])
        c.scatter(xs, [dec[shape][m]["step_speedup_vs_bf16"] for m in fmts], color="k", s=12, zorder=3,
                  label="the step on the device" if i else None)
        for x, m in zip(xs, fmts):
            if (shape, m) in DECODE_GOALS:
                c.plot([x - 0.18, x + 0.18], [DECODE_GOALS[shape, m]] * 2, color="#e6550d", lw=2,
                       label="goal" if (shape, m) == ("llama-8b", "int8") else None)
    c.axhline(1, color="k", lw=0.8)
    c.set_xticks([j + 0.2 for j in range(len(fmts))], [m.replace("+", "\n+ ") for m in fmts], fontsize=8)
    c.set(ylabel="tokens/s relative to bf16", title="batch-1 decode, same run per shape")
    c.legend(fontsize=7)
    fig.suptitle(f"{res['gpu']}, copy {gbps:,.0f} GB/s, torch {res['torch']}, triton {res['triton']}, {res['date']}; "
                 f"decode: {decode['gpu']}, {decode['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(Path(formats_path).with_suffix(".png"), dpi=110)


def plot_norm(path: str) -> None:
    """gemv_norm_h200.json's picture: a layer's matmuls with the norm inside the GEMV and apart (the
    chain), and the batch-1 decode step on the device before and after the change, against the floor."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.loads(Path(path).read_text())
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 3.8), gridspec_kw={"width_ratios": [1.3, 1]})
    chain, shapes = res["chain"], ("llama_1b", "qwen3_0_6b", "llama_8b", "llama_8b_tp2")
    for i, (key, label, color) in enumerate((("today_us", "chapter 04's add + norm, cuBLAS, SiLU", "#bdbdbd"),
                                             ("gemv_us", "GEMVs, the add and norm inside", "#9ecae1"),
                                             ("gemv_norm_apart_us", "add + norm kernel, then GEMVs", "#3182bd"))):
        a.bar([j + (i - 1) * 0.27 for j in range(len(shapes))], [chain[s]["floor_us"] / chain[s][key] for s in shapes],
              0.27, color=color, label=label)
    a.set_xticks(range(len(shapes)), ["Llama-1B", "Qwen3-0.6B", "8B", "8B, one of 2 ranks"])
    a.set(ylim=(0, 1), ylabel="weights at copy bandwidth / time", title="a layer's four matmuls at one row, in a row")
    a.legend(fontsize=7, loc="lower right")
    dec, names = res["decode"], {"llama": "Llama-1B", "qwen3": "Qwen3-0.6B", "llama8b": "8B"}
    for i, (when, color) in enumerate((("before", "#9ecae1"), ("after", "#3182bd"))):
        b.bar([j + (i - 0.5) * 0.38 for j in range(3)],
              [dec[when][s]["timeline1"]["fraction_of_floor"] for s in names], 0.38, color=color,
              label={"before": "the norm inside at every width", "after": "apart past 2,048 wide"}[when])
    b.set_xticks(range(3), names.values())
    b.set(ylim=(0, 1), ylabel="floor / step", title="a batch-1 decode step on the device (graph replayed)")
    b.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"{res['gpu']}, copy {res['copy_GBps']:,.0f} GB/s, {res['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(Path(path).with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    commands(run=lambda out, *parts: main(out, list(parts)), plot=plot, plot_norm=plot_norm)
