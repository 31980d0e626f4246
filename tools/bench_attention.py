"""Chapter 05 GPU benchmark: paged attention kernels against SDPA and gather-then-SDPA, then
`generate_paged` end to end with the chapter-03 (gather) and chapter-05 (varlen, Triton) backends.

Hand-written tool.
    python tools/bench_attention.py run docs/benchmarks/attention_h200.json [decode ragged prefill e2e]
    python tools/bench_attention.py tune decode|prefill                       # kernel configurations
    python tools/bench_attention.py check                                     # bf16 agreement on the GPU
    python tools/bench_attention.py plot docs/benchmarks/attention_h200.json  # redraw the PNGs
"""

import itertools
import json
import random
import tempfile
import time

import torch
import torch.nn.functional as F
import transformers
from bench_static_decode import LLAMA_3_2_1B
from benchlib import commands, gpu_ms, graph_ms
from copy_bandwidth import copy_bandwidth
from torch.nn.attention.bias import causal_lower_right

import miniinfer as mi
from miniinfer.course.parity import rel_err

DT = torch.bfloat16
HQ, HK, BLOCK = 32, 8, 16


def paged_pool(lens: list[int], D: int, seed: int = 0):
    """A pool holding sequences of lens[b] tokens in randomly ordered blocks, and their tables."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    per = [-(-n // BLOCK) for n in lens]
    k_cache = torch.randn(sum(per), BLOCK, HK, D, device="cuda", dtype=DT, generator=gen)
    v_cache = torch.randn(sum(per), BLOCK, HK, D, device="cuda", dtype=DT, generator=gen)
    order = torch.randperm(sum(per), device="cuda", generator=gen).to(torch.int32)
    tables = torch.zeros(len(lens), max(per), dtype=torch.int32, device="cuda")
    for b, start in enumerate(itertools.accumulate([0] + per[:-1])):
        tables[b, :per[b]] = order[start:start + per[b]]
    return k_cache, v_cache, tables


def decode_worlds(lens: list[int], D: int, hq: int = HQ) -> tuple[int, list[dict]]:
    """K/V bytes of one decode step over contexts of lens[b] tokens, and enough copies of its data
    (>= 256 MB in all, at most 64) that the L2 cache (60 MB) cannot hold them: below 4 MB a copy,
    the data partly comes from the L2 and the GB/s can exceed the memory's."""
    nbytes = 2 * sum(lens) * HK * D * 2
    worlds = []
    for i in range(max(1, min(64, -(-256 * 2**20 // nbytes)))):
        k_cache, v_cache, tables = paged_pool(lens, D, seed=i)
        q = torch.randn(len(lens), hq, D, device="cuda", dtype=DT)
        worlds.append(dict(k_cache=k_cache, v_cache=v_cache, tables=tables, q=q,
                           lens=torch.tensor(lens, device="cuda", dtype=torch.int32)))
    return nbytes, worlds


def decode_case(B: int, ctx: int, D: int) -> dict:
    """Decode attention of B sequences of ctx tokens, each implementation timed in a CUDA graph over
    the copies of decode_worlds."""
    nbytes, worlds = decode_worlds([ctx] * B, D)
    copies, scale = len(worlds), D ** -0.5

    def ours(w):
        return mi.kernels.paged_attention(w["q"], w["k_cache"], w["v_cache"], w["tables"], w["lens"], scale,
                                          max_len=ctx)

    def contiguous(w):
        return [mi.gather_kv(w[c], w["tables"], ctx).transpose(1, 2) for c in ("k_cache", "v_cache")]

    def gather_sdpa(w):
        k, v = contiguous(w)
        return F.scaled_dot_product_attention(w["q"][:, :, None], k, v, scale=scale, enable_gqa=True)[:, :, 0]

    def ch03(w):
        return mi.paged_attention_ref(w["q"], w["k_cache"], w["v_cache"], w["tables"], w["lens"], scale)

    times, notes = {}, {}
    ref = gather_sdpa(worlds[0])
    notes["rel_err_ours_vs_sdpa"] = rel_err(ours(worlds[0]), ref)
    impls = {"triton (ours)": ours, "gather, then SDPA": gather_sdpa}
    for name, fn in impls.items():
        try:
            times[name] = graph_ms([lambda w=w: fn(w) for w in worlds])
        except torch.OutOfMemoryError:
            notes[name] = "out of memory"
        torch.cuda.empty_cache()
    try:  # it reads the longest context back to the host: no CUDA graph, host time included
        times["chapter 03: gather, then einsum"] = gpu_ms(lambda: ch03(worlds[-1]))
        notes["chapter 03: gather, then einsum"] = "timed with do_bench (not graphable): host time included"
    except torch.OutOfMemoryError:
        notes["chapter 03: gather, then einsum"] = "out of memory"
    torch.cuda.empty_cache()
    try:  # SDPA on a contiguous copy of each world's cache (made before timing)
        for w in worlds:
            w["k"], w["v"] = (t.contiguous() for t in contiguous(w))
        times["SDPA, contiguous cache"] = graph_ms(
            [lambda w=w: F.scaled_dot_product_attention(w["q"][:, :, None], w["k"], w["v"], scale=scale,
                                                        enable_gqa=True) for w in worlds])
        if D == 64 and ctx in (2048, 32768):  # each shape compiles anew: a subset keeps the run short
            flex = [flex_decode(w, B, ctx, D, scale) for w in worlds]
            notes["rel_err_flex_vs_sdpa"] = rel_err(flex[0]()[:, :, 0], ref)
            times["FlexAttention, paged"] = graph_ms(flex)
    except torch.OutOfMemoryError:
        notes["SDPA, contiguous cache"] = "out of memory"
    except Exception as e:  # noqa: BLE001  (a peer that does not run here is recorded, not fatal)
        notes["FlexAttention, paged"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    del worlds
    torch.cuda.empty_cache()
    # What any kernel moving this many bytes can reach: a copy moving nbytes (half read, half written).
    pairs = [(torch.empty(nbytes // 8, device="cuda"), torch.empty(nbytes // 8, device="cuda")) for _ in range(copies)]
    copy_ms = graph_ms([lambda x=x, y=y: y.copy_(x) for x, y in pairs])
    del pairs
    return {"batch": B, "context": ctx, "head_dim": D, "kv_bytes": nbytes, "copies": copies, "ms": times,
            "GBps": {k: nbytes / (t * 1e-3) / 1e9 for k, t in times.items()},
            "copy_same_bytes_GBps": nbytes / (copy_ms * 1e-3) / 1e9,
            "config": mi.kernels.decode_config(B, HK, D, ctx,
                                               torch.cuda.get_device_properties(0).multi_processor_count),
            "notes": notes}


def ragged_cases() -> list[dict]:
    """Decode attention as the engine meets it on the course's workload: the running requests' ragged
    contexts (prompts of 100..1024 tokens plus the step) at three steps, for the Llama-1B and
    Qwen3-0.6B heads, each with decode_config's choice and a grid of tiles and warps."""
    lengths = mi.benchmark_lengths(256)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cases = []
    for name, hq, D in (("llama", 32, 64), ("qwen3", 16, 128)):
        for step in (10, 400, 800):
            ctx = [p + step for p, o in lengths if o > step]
            B = len(ctx)
            nbytes, worlds = decode_worlds(ctx, D, hq)
            auto = mi.kernels.decode_config(B, HK, D, 2048, sms)  # the engine's graphs use max_model_len

            def gbps(**cfg):
                t = graph_ms([lambda w=w: mi.kernels.paged_attention(w["q"], w["k_cache"], w["v_cache"], w["tables"],
                                                                     w["lens"], D ** -0.5, max_len=2048, **cfg)
                              for w in worlds])
                return nbytes / (t * 1e-3) / 1e9

            grid = [dict(num_splits=n, tile=t, num_warps=w, GBps=gbps(num_splits=n, tile=t, num_warps=w))
                    for n in (1, 2, 4) for t in (32, 64, 128) for w in (2, 4) if t * D <= 8192]
            cases.append({"heads": name, "query_heads": hq, "head_dim": D, "step": step, "batch": B,
                          "mean_context": sum(ctx) / B, "max_context": max(ctx), "kv_bytes": nbytes,
                          "config": auto, "GBps": gbps(), "grid": grid})
            best = max(grid, key=lambda g: g["GBps"])
            print(f"ragged {name} step {step} B={B}: decode_config {auto} {cases[-1]['GBps']:.0f} GB/s; best {best}",
                  flush=True)
            del worlds
            torch.cuda.empty_cache()
    return cases


_flex_compiled = None


def flex_decode(w: dict, B: int, ctx: int, D: int, scale: float):
    """FlexAttention's paged path (torch.nn.attention.experimental) over a copy of the world's K/V,
    in its own pool layout; its block mask's KV block size must equal the page size (16 here)."""
    global _flex_compiled
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _flex_compiled is None:
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    n_pages = w["k_cache"].shape[0]
    paged = PagedAttention(n_pages, BLOCK, B, device="cuda")
    for b in range(B):  # reserve() takes one sequence at a time
        paged.reserve(torch.tensor(b, device="cuda"), torch.tensor(ctx, device="cuda"))
    pool_k = torch.empty(1, HK, n_pages * BLOCK, D, device="cuda", dtype=DT)
    pool_v = torch.empty_like(pool_k)
    pos = torch.arange(ctx, device="cuda").expand(B, ctx)
    paged.assign(torch.arange(B, device="cuda"), pos, w["k"], w["v"], pool_k, pool_v)
    mask = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx < ctx, B, None, 1, ctx,
                             device="cuda", BLOCK_SIZE=(128, BLOCK))
    mask = paged.convert_logical_block_mask(mask)
    score_mod = paged.get_score_mod(None)
    q4 = w["q"][:, :, None]
    return lambda: _flex_compiled(q4, pool_k, pool_v, block_mask=mask, score_mod=score_mod, scale=scale,
                                  enable_gqa=True)


def prefill_inputs(B: int, T: int, cached: int, D: int):
    """Our kernel's arguments for B sequences of T new tokens after `cached` ones, and SDPA on the same
    data, contiguous, with the KV heads repeated for the query heads (its flash kernels' layout; the
    copy is made here, before any timing) and the causal diagonal at the bottom right."""
    ctx = T + cached
    k_cache, v_cache, tables = paged_pool([ctx] * B, D, seed=1)
    lens = torch.full((B,), ctx, device="cuda", dtype=torch.int32)
    qsl = torch.arange(0, (B + 1) * T, T, device="cuda", dtype=torch.int32)
    q = torch.randn(B * T, HQ, D, device="cuda", dtype=DT)
    args = (q, k_cache, v_cache, qsl, lens, tables, D ** -0.5, T)
    k, v = (mi.gather_kv(c, tables, ctx).repeat_interleave(HQ // HK, dim=2).transpose(1, 2).contiguous()
            for c in (k_cache, v_cache))
    q4 = q.view(B, T, HQ, D).transpose(1, 2).contiguous()
    mask = dict(attn_mask=causal_lower_right(T, ctx)) if cached else dict(is_causal=True)
    return args, lambda: F.scaled_dot_product_attention(q4, k, v, scale=D ** -0.5, **mask).transpose(1, 2)


def prefill_case(B: int, T: int, cached: int, D: int) -> dict:
    args, sdpa = prefill_inputs(B, T, cached, D)
    ours = lambda: mi.kernels.prefill_attention(*args)  # noqa: E731
    err = rel_err(ours().view(B, T, HQ, D), sdpa())
    times = {"triton (ours)": gpu_ms(ours), "SDPA, contiguous": gpu_ms(sdpa)}
    flops = 4 * D * HQ * B * sum(cached + i + 1 for i in range(T))
    return {"batch": B, "new_tokens": T, "cached": cached, "head_dim": D, "ms": times,
            "TFLOPs": {k: flops / (t * 1e-3) / 1e12 for k, t in times.items()},
            "ratio_to_sdpa": times["triton (ours)"] / times["SDPA, contiguous"], "rel_err_vs_sdpa": err}


def end_to_end(n: int = 64) -> dict:
    """generate_paged on the chapter-03 workload: the first n requests of the benchmark lengths,
    prompt tokens uniform in 0..10000; one SamplingParams, so every request gets the mean output
    length of the n (generate_paged takes one max_tokens)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**LLAMA_3_2_1B)
    with torch.device("cuda"):
        hf = transformers.LlamaForCausalLM(config).to(DT).eval()
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        del hf
        model = mi.load_model(folder, device="cuda", dtype=DT)
    random.seed(0)
    lengths = mi.benchmark_lengths()[:n]
    prompts = [[random.randint(0, 10000) for _ in range(p)] for p, _ in lengths]
    new = round(sum(o for _, o in lengths) / n)
    params = mi.SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    runs = {"generate_paged, gather backend (chapter 03)":
            lambda p, s: mi.generate_paged(model, p, s, backend="gather"),
            "generate_paged, varlen backend (chapter 05)":
            lambda p, s: mi.generate_paged(model, p, s, backend="varlen"),
            "static batch, CUDA graph (chapter 02)": lambda p, s: mi.generate_static_batch(model, p, s)}
    for fn in runs.values():  # warm-up: kernel compilation stays out of the timings
        fn(prompts[:2], mi.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    res, outs = {}, []
    for name, fn in runs.items():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs.append(fn(prompts, params))
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        res[name] = {"seconds": seconds, "output_tokens_per_s": n * new / seconds}
        print(f"{name:>45}: {n * new / seconds:8.0f} output tokens/s", flush=True)
    def common_prefix(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))

    # bf16 paths that round differently pick different tokens once two logits nearly tie (random
    # weights make near-ties common); from there the continuations differ.
    agree = {f"{a} vs {b}": {"first_token_equal": sum(x[0] == y[0] for x, y in zip(outs[i], outs[j])) / n,
                             "median_tokens_equal_before_first_difference": sorted(
                                 common_prefix(x, y) for x, y in zip(outs[i], outs[j]))[n // 2]}
             for (i, a), (j, b) in [((0, "gather"), (1, "varlen")), ((1, "varlen"), (2, "static")),
                                    ((0, "gather"), (2, "static"))]}
    print(agree, flush=True)
    return {"requests": n, "prompt_tokens": sum(p for p, _ in lengths), "max_tokens_each": new,
            "note": "one max_tokens (the mean output length of the n requests) for all: generate_paged takes one",
            "results": res, "greedy_agreement": agree}


def main(out_path: str, parts: list[str]) -> None:
    """Run the named parts (decode, prefill, e2e) and add them to the JSON at out_path."""
    try:
        with open(out_path) as f:
            res = json.load(f)
    except FileNotFoundError:
        res = {}
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    if "decode" in parts:
        res["decode"] = []
        for D in (64, 128):
            for B in (1, 16, 64, 256):
                for ctx in (512, 2048, 8192, 32768):
                    r = decode_case(B, ctx, D)
                    res["decode"].append(r)
                    print(f"D={D} B={B:>3} ctx={ctx:>5}: " + "  ".join(
                        f"{k.split(',')[0][:14]} {v / bw:4.0%}" for k, v in r["GBps"].items()) +
                          f"  copy, same bytes {r['copy_same_bytes_GBps'] / bw:4.0%}", flush=True)
        res["copy_GBps"] = bw  # the percentages are of this run's copy bandwidth
    if "ragged" in parts:
        res["ragged"] = ragged_cases()
    if "prefill" in parts:
        res["prefill"] = []
        for D in (64, 128):
            for B, T in ((4, 1024), (1, 8192)):
                for cached in (0, 512):
                    r = prefill_case(B, T, cached, D)
                    res["prefill"].append(r)
                    print(f"prefill D={D} {B}x{T} cached {cached}: ours {r['ms']['triton (ours)']:.3f} ms, "
                          f"SDPA {r['ms']['SDPA, contiguous']:.3f} ms ({r['ratio_to_sdpa']:.2f}x)", flush=True)
        torch.cuda.empty_cache()
    if "e2e" in parts:
        res["end_to_end"] = end_to_end()
    res.update(header(heads=f"{HQ} query / {HK} KV heads, block size {BLOCK}, bf16"))
    res.setdefault("copy_GBps", bw)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    plots(res, out_path)


def plots(res: dict, out_path: str) -> None:
    if "decode" in res:
        plot(res, out_path.removesuffix(".json") + ".png")
    if "prefill" in res and "end_to_end" in res:
        plot_prefill_e2e(res, out_path.removesuffix(".json") + "_prefill_e2e.png")


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bw = res["copy_GBps"]
    fig, axes = plt.subplots(2, 4, figsize=(16, 7), sharey=True)
    styles = {"triton (ours)": "o-", "SDPA, contiguous cache": "s--", "gather, then SDPA": "^:",
              "chapter 03: gather, then einsum": "x:", "FlexAttention, paged": "d-."}
    for i, D in enumerate((64, 128)):
        for j, B in enumerate((1, 16, 64, 256)):
            ax = axes[i, j]
            rows = [r for r in res["decode"] if r["head_dim"] == D and r["batch"] == B]
            for name, style in styles.items():
                pts = [(r["context"], r["GBps"][name] / bw * 100) for r in rows if name in r["GBps"]]
                if pts:
                    ax.plot(*zip(*pts), style, label=name)
            ax.set_xscale("log", base=2)
            ax.set_title(f"decode, head_dim {D}, batch {B}", fontsize=10)
            ax.axhline(100, color="black", lw=0.8)
            ax.set_xlabel("context (tokens)")
            if j == 0:
                ax.set_ylabel("% of copy bandwidth")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(f"Paged decode attention, K/V bytes read / time, {res['gpu']} "
                 f"(copy {bw:.0f} GB/s), {res['heads']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_prefill_e2e(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 3.6), gridspec_kw={"width_ratios": [3, 2]})
    rows = res["prefill"]
    labels = [f"D{r['head_dim']} {r['batch']}x{r['new_tokens']}" + (f"\n+{r['cached']} cached" if r["cached"] else "")
              for r in rows]
    x = range(len(rows))
    for off, name, color in ((-0.2, "triton (ours)", "tab:blue"), (0.2, "SDPA, contiguous", "tab:orange")):
        ax1.bar([i + off for i in x], [r["TFLOPs"][name] for r in rows], 0.4, label=name, color=color)
    for i, r in enumerate(rows):
        ax1.text(i, max(r["TFLOPs"].values()) + 5, f"{r['ratio_to_sdpa']:.2f}x", ha="center", fontsize=8)
    ax1.set_xticks(list(x), labels, fontsize=7)
    ax1.set_ylabel("TFLOP/s (causal)")
    ax1.set_title("prefill attention: time ratio ours / SDPA above the bars", fontsize=10)
    ax1.legend(fontsize=8)
    e2e = res["end_to_end"]
    names = list(e2e["results"])
    rates = [e2e["results"][n]["output_tokens_per_s"] for n in names]
    ax2.barh(names, rates, color=["tab:gray", "tab:blue", "tab:green"])
    for i, r in enumerate(rates):
        ax2.text(r, i, f" {r:,.0f}", va="center", fontsize=8)
    ax2.set_xlim(0, max(rates) * 1.25)
    ax2.set_xlabel("output tokens/s")
    ax2.set_title(f"Llama-3.2-1B shape, {e2e['requests']} requests x {e2e['max_tokens_each']} new tokens",
                  fontsize=10)
    fig.suptitle(f"{res['gpu']}, torch {res['torch']}, triton {res['triton']}, {res['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def tune(which: str) -> None:
    """Time kernel configurations at representative sizes (prints a table; nothing recorded): first
    tile x warps x stages at the automatic split, then the split at the best of those."""
    quick = lambda fn: gpu_ms(fn, warmup=10, rep=40)  # noqa: E731
    bw = copy_bandwidth()
    print(f"copy {bw:.0f} GB/s")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for D in (64, 128) if which == "decode" else ():
        for B, ctx in ((1, 32768), (1, 4096), (16, 2048), (16, 8192), (64, 2048), (256, 2048), (64, 8192)):
            nbytes, worlds = decode_worlds([ctx] * B, D)
            auto = mi.kernels.decode_config(B, HK, D, ctx, sms)["num_splits"]

            def pct(**cfg):
                try:
                    t = graph_ms([lambda w=w: mi.kernels.paged_attention(
                        w["q"], w["k_cache"], w["v_cache"], w["tables"], w["lens"], D ** -0.5, **cfg) for w in worlds])
                except Exception:  # noqa: BLE001  (a configuration out of resources)
                    return 0.0
                return nbytes / (t * 1e-3) / 1e9 / bw

            configs = sorted(((pct(num_splits=auto, tile=t, num_warps=w, num_stages=st), t, w, st)
                              for t in (32, 64, 128) for w in (2, 4, 8) for st in (2, 3)), reverse=True)
            default = pct(num_splits=auto)
            _, t, w, st = configs[0]
            splits = sorted((pct(num_splits=n, tile=t, num_warps=w, num_stages=st), n)
                            for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if n * t * 2 <= ctx)
            print(f"decode D={D} B={B} ctx={ctx}: default (split {auto}) {default:.1%}; best configs " +
                  ", ".join(f"{p:.1%} t{t} w{w} st{st}" for p, t, w, st in configs[:4]) +
                  " | splits: " + ", ".join(f"{n}:{p:.0%}" for p, n in sorted(splits, key=lambda x: x[1])), flush=True)
            del worlds
            torch.cuda.empty_cache()
    for D in (64, 128) if which == "prefill" else ():
        for B, T, cached in ((4, 1024, 0), (1, 8192, 0), (4, 1024, 512)):
            args, sdpa = prefill_inputs(B, T, cached, D)
            ref = sdpa()
            base = quick(sdpa)
            results = []
            for block_m in (64, 128):
                for block_n in (32, 64, 128):
                    for warps in (4, 8):
                        for stages in (1, 2, 3):
                            cfg = dict(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages)
                            try:
                                fn = lambda: mi.kernels.prefill_attention(*args, **cfg)  # noqa: E731
                                err = rel_err(fn().view(B, T, HQ, D), ref)
                                results.append((quick(fn) / base, cfg, err))
                            except Exception as e:  # noqa: BLE001  (out of resources)
                                print("  skip", cfg, type(e).__name__)
            results.sort(key=lambda x: x[0])
            print(f"prefill D={D} {B}x{T} cached {cached}: SDPA {base:.3f} ms; best: " +
                  "; ".join(f"{x:.2f}x {c}" for x, c, _ in results[:4]) +
                  f"; max err {max(e for *_, e in results):.1e}", flush=True)
            torch.cuda.empty_cache()


def check() -> None:
    """The kernels against the PyTorch references on random odd shapes, on the GPU, per dtype."""
    from miniinfer.course.parity import decode_errors, prefill_errors  # the tests' cases, compiled

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        print(f"{str(dtype):>15}: decode max rel err {max(decode_errors('cuda', dtype)):.1e}, "
              f"prefill {max(prefill_errors('cuda', dtype)):.1e}", flush=True)


if __name__ == "__main__":
    commands(run=lambda out, *parts: main(out, list(parts) or ["decode", "prefill", "e2e"]), tune=tune, check=check,
             plot=lambda path: plots(json.load(open(path)), path))
