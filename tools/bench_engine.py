"""Chapter 06 GPU benchmark: the continuous-batching engine on the course's end-to-end workload
(256 requests, prompt and output lengths uniform in 100..1024, random bf16 weights), against our
chapter-02 static batching, transformers' `generate_batch` and static-batch `generate`, and the floor.

Hand-written tool. Parts (any of them, in one run, in the order given; results merge into the JSON),
each on the Llama-3.2-1B shape, or on the Qwen3-0.6B shape when written qwen3:PART:
    ours       LLMEngine, with a per-step trace and a late arrival's time to first token
    ours_sync  the same with overlap off (the host schedules only after reading the step's tokens)
    overlap    decode steps at full batch with overlap off and on, under torch.profiler: the device's
               idle time per step (host time not hidden), and four steps' host and device lanes
    static     chapter 02's static batching (batches of 64, each to its longest request)
    hf         transformers generate_batch (all 256)
    hf_static  transformers static-batch generate (the first 64)
    batch1     one request: decode tokens/s against the weight-read floor
    timeline1  one batch-1 decode step's kernels on the device (the CUDA graph replayed under torch.profiler):
               each kernel's time and class, the matmuls' weight bytes at the copy bandwidth, the gaps
    hf_batch1  transformers generate at batch 1 with its static cache, compiled and eager
    profile    host and device time of decode steps
    structured_overlap  the overlap's lanes (as `overlap`, overlap on) plain and with every other
               request held to a JSON schema: the host fills the grammars' masks while the device runs
               (xgrammar's batch call on several threads, and a row at a time as before)
    lanes1     the overlap's lanes (as `overlap`, overlap on) with one request: a batch-1 step's host and device
    logprobs_profile  the overlap's lanes (overlap on) with every request asking for top-5 log-probabilities
    sampling   chapter 12's costs in one run: the workload plain, with every other request held to a JSON
               schema (xgrammar's masks; the course tokenizer's 4,096 tokens inside the shape's vocabulary),
               and with every request asking for its tokens' top-5 log-probabilities
    python tools/bench_engine.py run docs/benchmarks/engine_h200.json ours qwen3:ours ...
    python tools/bench_engine.py plot docs/benchmarks/engine_h200.json
    python tools/bench_engine.py plot_layers docs/benchmarks/decode_batch1_h200.json  (timeline1's middle layers)
"""

import contextlib
import functools
import gc
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers
from bench_static_decode import LLAMA_3_2_1B
from benchlib import Results, commands, gpu_ms
from copy_bandwidth import copy_bandwidth

import miniinfer as mi

DT = torch.bfloat16
QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  rms_norm_eps=1e-6, tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                                "rope_theta": 1000000.0})
SHAPES = {"llama": ("LlamaConfig", "LlamaForCausalLM", LLAMA_3_2_1B),
          "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", QWEN3_0_6B)}
MAX_MODEL_LEN = 2048
LLAMA_3_1_8B = dict(LLAMA_3_2_1B, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, head_dim=128,
                    tie_word_embeddings=False)


def models(shape: str):
    """transformers and miniinfer models of one shape, with the same random bf16 weights."""
    cfg_cls, model_cls, kwargs = SHAPES[shape]
    # The course tokenizer's end token (the structured parts' grammars read its vocabulary): the
    # configs' default end token 2 is '"' there, which a JSON grammar could then never write.
    ends = dict(eos_token_id=mi.load_tokenizer().eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kwargs, **ends)).to(DT).eval()
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        ours = mi.load_model(folder, device="cuda", dtype=DT)
    return hf, ours


def llama_8b():
    """An 8B-sized Llama (Llama-3.1-8B's shape) with random bf16 weights, built on the GPU: no
    checkpoint, which would take minutes to write and read. No transformers model beside it."""
    cfg = mi.ModelConfig.from_hf(LLAMA_3_1_8B)
    torch.manual_seed(0)
    torch.set_default_dtype(DT)
    try:
        with torch.device("cuda"):
            model = mi.Transformer(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    return model.to("cuda").use_ops("fused")  # .to: the rotary frequencies, made on the CPU in float32


def workload(n: int = 256):
    """The protocol of docs/benchmarks/README.md: lengths from benchmark_lengths, prompt tokens uniform in 0..10000."""
    random.seed(0)
    lengths = mi.benchmark_lengths(n)
    prompts = [[random.randint(0, 10000) for _ in range(p)] for p, _ in lengths]
    return prompts, [o for _, o in lengths]


def greedy(n: int) -> mi.SamplingParams:
    return mi.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def engine_for(model, tokenizer=None, **kw) -> mi.LLMEngine:
    gc.collect()  # the previous part's engine: its pool and graphs go before this one sizes its pool
    torch.cuda.empty_cache()
    return mi.LLMEngine(mi.EngineConfig(**{"device": "cuda", "dtype": DT, "max_model_len": MAX_MODEL_LEN, **kw}),
                        model=model, tokenizer=tokenizer)


def run_engine(engine: mi.LLMEngine, prompts, outs, late: list[int] | None = None, params=None) -> dict:
    """Serve the workload step by step, recording each step; `late` arrives after 2 s. params(i, n):
    request i's SamplingParams for n tokens (default: greedy)."""
    for i, (p, o) in enumerate(zip(prompts, outs)):
        engine.add_request(p, params(i, o) if params else greedy(o))
    trace, late_id, late_t0, ttft = [], None, None, None
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter() - t0
        s = engine.stats
        trace.append((round(now, 5), len(s.scheduled), sum(s.scheduled.values()), len(s.preempted), s.kind))
        if late and late_id is None and now > 2.0:
            late_id, late_t0 = engine.add_request(late, greedy(16)), now
        if late_id is not None and ttft is None and any(o.request_id == late_id for o in outputs):
            ttft = now - late_t0
    seconds = time.perf_counter() - t0
    res = {"seconds": seconds, "output_tokens_per_s": sum(outs) / seconds,
           "total_tokens_per_s": (sum(outs) + sum(map(len, prompts))) / seconds,
           "num_blocks": engine.block_manager.num_blocks, "steps": len(trace),
           "preemptions": sum(t[3] for t in trace), "trace": trace}
    if late:
        res["late_arrival"] = {"prompt_tokens": len(late), "arrives_at_s": late_t0, "ttft_s": ttft,
                               "running_when_it_arrived": next(t[1] for t in trace if t[0] >= late_t0)}
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return res


def phases(trace: list) -> dict:
    """The workload's steps and seconds by kind of step, from `run_engine`'s trace (each step's end, rows,
    tokens, preempted, the engine's kind of step): steps with prompt tokens, decode steps that verified
    guesses (chapter 09: more tokens than rows), then the other decode steps by rows. A step's seconds
    are the host's, from the step before it ended: the GPU's work of a step overlaps the host's of the next."""
    kinds: dict[str, dict] = {}
    last = 0.0
    for end, rows, tokens, _, step_kind in trace:
        name = ("prefill" if step_kind == "prefill" else "verify" if tokens > rows else
                "decode_128_rows_up" if rows >= 128 else "decode_16_127_rows" if rows >= 16 else "decode_1_15_rows")
        kind = kinds.setdefault(name, {"steps": 0, "seconds": 0.0})
        kind["steps"] += 1
        kind["seconds"] += end - last
        last = end
    return kinds


def ours(model, prompts, outs, overlap: bool = True) -> dict:
    engine = engine_for(model, overlap=overlap)
    engine.generate(prompts[:8], greedy(8), use_tqdm=False)  # warm-up: Triton compiles its prefill kernels
    res = run_engine(engine, prompts, outs, late=prompts[0][:512])
    print(f"ours (overlap {overlap}): {res['output_tokens_per_s']:.0f} output tok/s, {res['steps']} steps, "
          f"{res['num_blocks']} blocks, late TTFT {res['late_arrival']['ttft_s']}", flush=True)
    return res


def lanes(model, prompts, overlap: bool, steps: int = 40, params=None, **engine_kw: object) -> dict:
    """Decode steps of the prompts' requests under torch.profiler: per step, the wall time and the time
    the device was busy (the union of its kernels) and idle; and the host's launch / collect / update
    spans and the device's busy spans of four steps, for the picture. params(i, n): request i's
    sampling (default greedy); with grammars, the host's mask filling and its wait for the last
    step's tokens are lanes of their own. engine_kw: EngineConfig fields (chapter 09's speculation)."""
    from torch.profiler import DeviceType, ProfilerActivity, record_function

    from miniinfer.worker.structured_output import Structured
    params = params or (lambda i, n: greedy(n))
    engine = engine_for(model, mi.load_tokenizer(), overlap=overlap, **engine_kw)
    engine.generate(prompts[:8], [params(i, 8) for i in range(len(prompts[:8]))], use_tqdm=False)
    for i, p in enumerate(prompts):
        engine.add_request(p, params(i, 1024 - 100))
    # to the first step where all decode (or verify guesses)
    while len(engine.stats.scheduled) != len(prompts) or engine.stats.kind != "decode":
        engine.step()
    for _ in range(10):
        engine.step()
    torch.cuda.synchronize()  # the profiler slows the host down: the step's wall time is taken without it
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) / steps * 1e3
    launch, collect = engine._launch, engine.executor.collect

    def traced(fn, label):
        @functools.wraps(fn)
        def call(*a, **k):
            with record_function(label):
                return fn(*a, **k)
        return call
    engine._launch, engine.executor.collect = traced(launch, "host: schedule + launch"), traced(collect, "host: wait")
    # join: the wait for the grammar's thread (the last step's tokens accepted, this one's masks filled)
    grammar = {"apply": "host: grammar masks", "join": "host: wait for the grammar's thread"}
    for name, label in grammar.items():  # on the class: the runner's processor calls them through self
        setattr(Structured, name, traced(getattr(Structured, name), label))
    torch.cuda.synchronize()
    try:
        with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                with record_function("step"):
                    engine.step()
            torch.cuda.synchronize()
    finally:
        for name in grammar:
            setattr(Structured, name, getattr(Structured, name).__wrapped__)
    for rid in list(engine.requests):
        engine.abort(rid)
    events = prof.events()
    # these appear on the device's lane too
    labels = ("step", "host: schedule + launch", "host: wait", *grammar.values())
    on_device = [e for e in events if e.device_type == DeviceType.CUDA and e.name not in labels]
    kernels = sorted((e.time_range.start, e.time_range.end) for e in on_device)
    busy: list[list[float]] = []
    for a, b in kernels:  # the union of the kernels' spans
        if busy and a <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], b)
        else:
            busy.append([a, b])
    step_spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == "step")
    window = (step_spans[5][0], step_spans[-5][0])  # steady steps, away from the edges
    n = len(step_spans) - 10

    def busy_in(a: float, b: float) -> float:
        return sum(max(0.0, min(e, b) - max(s, a)) for s, e in busy)
    span = window[1] - window[0]
    res = {"overlap": overlap, "batch": len(prompts), "steps": n, "step_ms": span / n / 1e3,
           "device_busy_ms": busy_in(*window) / n / 1e3}
    res["device_idle_ms"] = res["step_ms"] - res["device_busy_ms"]
    # Unprofiled: what the device waits for the host in a step, its busy time being the profiled one.
    res["step_ms_unprofiled"] = wall_ms
    res["host_not_hidden_ms"] = max(0.0, wall_ms - res["device_busy_ms"])
    by_name: dict[str, list[float]] = {}  # kernels and copies of the steady steps: count and time per step
    for e in on_device:
        if window[0] <= e.time_range.start < window[1]:
            by_name.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    res["device_ops_per_step"] = sum(map(len, by_name.values())) / n
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]
    res["top_device_ops"] = [{"name": k[:100], "per_step": len(v) / n, "ms_per_step": sum(v) / n / 1e3}
                             for k, v in top]
    a, b = step_spans[20][0], step_spans[24][0]  # four steps for the picture, times in ms from a
    host = [(e.name, (e.time_range.start - a) / 1e3, (e.time_range.end - a) / 1e3) for e in events
            if e.name in labels[1:] and e.device_type == DeviceType.CPU and a <= e.time_range.start < b]
    res["lanes"] = {"host": host, "device": [((s - a) / 1e3, (e - a) / 1e3) for s, e in busy if a <= s < b]}
    print(f"overlap {overlap}: step {res['step_ms']:.2f} ms ({wall_ms:.2f} unprofiled), device busy "
          f"{res['device_busy_ms']:.2f} ms, idle {res['device_idle_ms']:.3f} ms, {res['device_ops_per_step']:.0f} "
          "device ops per step", flush=True)
    for op in res["top_device_ops"]:
        print(f"  {op['ms_per_step']:.3f} ms {op['per_step']:.0f}x {op['name']}", flush=True)
    return res


def static(model, prompts, outs, batch: int = 64) -> dict:
    """Chapter 02: batches of 64 in arrival order, each decoding to its longest request; a request's
    tokens past its own length are wasted work, not output."""
    gen = mi.StaticBatchGenerator(model, batch, MAX_MODEL_LEN)
    gen.generate(prompts[:batch], greedy(4))  # warm-up and graph capture
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        gen.generate(prompts[i:i + batch], greedy(max(outs[i:i + batch])))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    print(f"static: {sum(outs) / seconds:.0f} output tok/s", flush=True)
    return {"seconds": seconds, "output_tokens_per_s": sum(outs) / seconds, "batch": batch}


def hf_generate_batch(hf, prompts, outs) -> dict:
    """transformers continuous batching; its API takes one max_new_tokens: the mean, for all."""
    new = round(statistics.mean(outs))
    cfg = transformers.GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    hf.generate_batch(prompts[:8], generation_config=cfg)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    results = hf.generate_batch(prompts, generation_config=cfg)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    tokens = sum(len(r.generated_tokens) for r in results.values())
    print(f"hf generate_batch: {tokens / seconds:.0f} output tok/s", flush=True)
    return {"seconds": seconds, "output_tokens_per_s": tokens / seconds, "max_new_tokens_each": new,
            "output_tokens": tokens}


def hf_static(hf, prompts, outs, batch: int = 64) -> dict:
    """transformers static batching: the first 64 requests, left-padded, the mean length for all."""
    new = round(statistics.mean(outs[:batch]))
    width = max(map(len, prompts[:batch]))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts[:batch]], device="cuda")
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts[:batch]], device="cuda")
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    hf.generate(ids[:2], attention_mask=mask[:2], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    hf.generate(ids, attention_mask=mask, **kw)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    print(f"hf static: {batch * new / seconds:.0f} output tok/s", flush=True)
    return {"seconds": seconds, "output_tokens_per_s": batch * new / seconds, "requests": batch,
            "max_new_tokens_each": new}


def matmul_tflops() -> float:
    a, b = torch.randn(8192, 8192, device="cuda", dtype=DT), torch.randn(8192, 8192, device="cuda", dtype=DT)
    return 2 * 8192 ** 3 / (gpu_ms(lambda: a @ b, rep=300) * 1e-3) / 1e12


def floor(model, prompts, outs, gbps: float, tflops: float) -> dict:
    """The time no engine can beat on this GPU: every prompt prefilled at the matmul peak (2 FLOPs
    per parameter per token), then every step with all unfinished requests together, each step
    reading all weights once and each request's K/V once at the copy bandwidth."""
    cfg = model.cfg
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = params * 2
    kv_token = cfg.cache_bytes_per_token(2)
    prefill_s = 2 * params * sum(map(len, prompts)) / (tflops * 1e12)
    decode_s = 0.0
    for step in range(max(outs)):
        ctx = sum(len(p) + step for p, o in zip(prompts, outs) if o > step)
        decode_s += (weight_bytes + kv_token * ctx) / (gbps * 1e9)
    s = prefill_s + decode_s
    return {"seconds": s, "output_tokens_per_s": sum(outs) / s, "prefill_s": prefill_s, "decode_s": decode_s,
            "weight_bytes": weight_bytes, "batch1_tokens_per_s": gbps * 1e9 / weight_bytes}


def served_and_step(model, batch: int = 1, **engine_kw: object) -> dict:
    """`batch` requests at once: served tokens/s (the best of three runs' median gap between steps, times
    the batch) against the rate its step allows (the batch's CUDA graph replayed on the device, no host
    in it)."""
    engine = engine_for(model, max_num_seqs=max(8, batch), **engine_kw)
    prompts = [list(range(100 + i, 132 + i)) for i in range(batch)]

    def median_gap(n: int) -> float:
        for p in prompts:
            engine.add_request(p, greedy(n))
        times = []
        while engine.has_unfinished_requests():
            engine.step()
            times.append(time.perf_counter())
        return sorted(b - a for a, b in zip(times, times[1:]))[len(times) // 2]

    median_gap(16)  # warm-up: compiles, captures
    itls = [median_gap(256) for _ in range(3)]
    graph = engine.executor.runner.graphs.graphs[batch]
    step_us = gpu_ms(graph.replay, rep=200) * 1e3
    res = {"batch": batch, "tokens_per_s": batch / min(itls), "itl_us": [t * 1e6 for t in itls], "step_us": step_us,
           "step_tokens_per_s": batch * 1e6 / step_us}
    res["of_step"] = res["tokens_per_s"] / res["step_tokens_per_s"]
    return res


def batch1(model, gbps: float) -> dict:
    res = served_and_step(model)
    weight_bytes = sum(p.numel() for p in model.parameters()) * 2
    res["floor_tokens_per_s"] = gbps * 1e9 / weight_bytes
    res["fraction_of_floor"] = res["tokens_per_s"] / res["floor_tokens_per_s"]
    print(f"batch 1: {res['tokens_per_s']:.0f} tok/s, {100 * res['fraction_of_floor']:.0f}% of floor; its step "
          f"allows {res['step_tokens_per_s']:.0f} ({res['of_step']:.2f})", flush=True)
    return res


# The engine's own kernels by name; any other is cuBLAS's (the matmuls), or PyTorch's small ops.
KERNEL_CLASSES = {"_rms_norm_kernel": "RMSNorm", "_rope_kernel": "RoPE", "_store_kv_kernel": "K/V store",
                  "_decode_kernel": "attention", "_merge_kernel": "attention", "_silu_mul_kernel": "SiLU-and-multiply",
                  "splitKreduce": "matmul's split-K sum", "index": "embedding", "elementwise": "other small ops",
                  "Memset": "other small ops", "Memcpy": "other small ops"}


def kernel_class(name: str) -> str:
    return next((c for k, c in KERNEL_CLASSES.items() if k in name), "matmul")


def timeline1(model, gbps: float, replays: int = 20) -> dict:
    """Where a batch-1 decode step's device time goes: the batch-1 CUDA graph replayed under
    torch.profiler, each kernel's span and class; the matmuls' weight bytes (in the model's order: per
    layer qkv, o, gate/up, down, then the LM head) and their time at the copy bandwidth; the gaps."""
    from torch.profiler import DeviceType, ProfilerActivity
    engine = engine_for(model, max_num_seqs=8)
    list(engine.stream(list(range(100, 132)), greedy(16)))  # the graphs captured; their inputs a real step's
    graph = engine.executor.runner.graphs.graphs[1]
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()  # the replays apart, so that each one's kernels are its own
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == DeviceType.CUDA)
    per = len(kernels) // replays
    steps = [kernels[i * per:(i + 1) * per] for i in range(replays)]
    step = sorted(steps, key=lambda k: k[-1][1] - k[0][0])[replays // 2]  # the median replay
    t0 = step[0][0]
    cfg = model.cfg
    D, H, I = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    layer = [H * (cfg.num_heads + 2 * cfg.num_kv_heads) * D, cfg.num_heads * D * H, H * 2 * I, I * H]
    weights = [2 * n for n in layer * cfg.num_layers + [cfg.vocab_size * H]]  # bf16 bytes of each matmul
    rows = [{"name": n[:90], "class": kernel_class(n), "start_us": a - t0, "us": b - a} for a, b, n in step]
    matmuls = [r for r in rows if r["class"] == "matmul"]
    if len(matmuls) == len(weights):
        for r, w in zip(matmuls, weights):
            r["weight_bytes"], r["bytes_us"] = w, w / gbps / 1e3
    span = step[-1][1] - t0
    busy = sum(r["us"] for r in rows)
    by_class: dict[str, dict] = {}
    for r in rows:
        c = by_class.setdefault(r["class"], {"kernels": 0, "us": 0.0, "bytes_us": 0.0})
        c["kernels"] += 1
        c["us"] += r["us"]
        c["bytes_us"] += r.get("bytes_us", 0.0)
    weight_bytes = sum(p.numel() for p in model.parameters()) * 2
    # Outside the layers: the embedding, the small ops (RoPE's cos and sin, copies), the final norm, the LM head.
    outside = 2 + sum(by_class.get(c, {"kernels": 0})["kernels"] for c in ("embedding", "other small ops"))
    res = {"kernels": len(rows), "kernels_per_layer": (len(rows) - outside) / cfg.num_layers, "step_us": span,
           "busy_us": busy, "gaps_us": span - busy, "floor_us": weight_bytes / gbps / 1e3,
           "matched_matmuls": len(matmuls) == len(weights), "by_class": by_class, "rows": rows}
    res["fraction_of_floor"] = res["floor_us"] / span
    res["layer"] = layer_adds(res, cfg.num_layers // 2)
    print(f"timeline1: {len(rows)} kernels, step {span:.0f} us (busy {busy:.0f}, gaps {span - busy:.0f}), "
          f"floor {res['floor_us']:.0f} us ({100 * res['fraction_of_floor']:.0f}%)", flush=True)
    for c, v in sorted(by_class.items(), key=lambda kv: -kv[1]["us"]):
        print(f"  {c:>22}: {v['kernels']:4d} kernels {v['us']:7.1f} us (bytes at copy bandwidth "
              f"{v['bytes_us']:6.1f} us)", flush=True)
    return res


def layer_adds(t: dict, layer: int) -> list[dict]:
    """One decoder layer's kernels in a timeline1 step (from its qkv GEMV to the next layer's), each
    with the time it adds to the step: its end past the latest end before it. With PDL the spans
    overlap (a kernel starts before the one it waits for ends); the ends do not. For steps with one
    kernel before RoPE in a layer (the GEMV path)."""
    rows = t["rows"]
    rope = [i for i, r in enumerate(rows) if r["class"] == "RoPE"]
    first, last = rope[layer] - 1, rope[layer + 1] - 1
    before = max(r["start_us"] + r["us"] for r in rows[:first])
    out = []
    for r in rows[first:last]:
        end = r["start_us"] + r["us"]
        out.append({"name": r["name"], "class": r["class"], "adds_us": max(0.0, end - before),
                    "bytes_us": r.get("bytes_us", 0.0)})
        before = max(before, end)
    return out


def plot_layers(path: str, shapes: tuple[str, ...] = ("llama", "qwen3", "llama8b")) -> None:
    """A middle layer of each shape's batch-1 step, kernel by kernel (timeline1's `layer`: the time each
    adds, and its weights' time at copy bandwidth), as a PNG beside the JSON."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.loads(Path(path).read_text())
    names = {"_gemv_kernel": "GEMV", "_rope_kernel": "RoPE", "_store_kv_kernel": "K/V store",
             "_decode_kernel": "attention", "_merge_kernel": "merge"}
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 3.2))
    for ax, shape in zip(axes, shapes):
        rows = res[shape]["timeline1"]["layer"]
        gemvs = iter(("qkv", "o", "gate/up + SiLU", "down"))
        labels = [next(gemvs) if r["name"] == "_gemv_kernel" else names.get(r["name"], r["name"][:12]) for r in rows]
        y = range(len(rows))
        ax.barh(y, [r["adds_us"] for r in rows], color="#3182bd", label="adds to the step")
        ax.barh(y, [r["bytes_us"] for r in rows], color="none", edgecolor="k", hatch="//", lw=0.6,
                label="its weights at copy bandwidth")
        ax.set_yticks(list(y), labels, fontsize=8)
        ax.invert_yaxis()
        total, weights = sum(r["adds_us"] for r in rows), sum(r["bytes_us"] for r in rows)
        ax.set_title(f"{shape}: a layer {total:.1f} us, its weights {weights:.1f} us", fontsize=9)
        ax.set_xlabel("us", fontsize=8)
    axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"One decoder layer of a batch-1 decode step ({res['gpu']}, copy {res['copy_GBps']:,.0f} GB/s)",
                 fontsize=10)
    plt.tight_layout()
    plt.savefig(Path(path).with_suffix(".png"), dpi=110)


def hf_batch1(hf) -> dict:
    """transformers' generate of 256 tokens after a 32-token prompt with its static cache, with
    torch.compile (its default for that cache on a GPU) and without; tokens/s over the whole call."""
    ids = torch.tensor([list(range(100, 132))], device="cuda")
    res = {}
    for name, disable in (("compiled", False), ("eager", True)):
        def run():
            return hf.generate(ids, max_new_tokens=256, min_new_tokens=256, do_sample=False,
                               cache_implementation="static", disable_compile=disable)
        run()  # warm-up: compiles
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize()
        res[name] = {"tokens_per_s": 256 / (time.perf_counter() - t0)}
        print(f"transformers batch 1, static cache, {name}: {res[name]['tokens_per_s']:.0f} tok/s", flush=True)
    return res


def profile(model, prompts, outs) -> dict:
    """Where a full decode step's time goes: the scheduler, building the batch on the host,
    the graph replay (with its input copies), sampling, and the engine's bookkeeping after."""
    engine = engine_for(model)
    engine.generate(prompts[:8], greedy(8), use_tqdm=False)
    for p in prompts:
        engine.add_request(p, greedy(1024 - 100))
    runner, scheduler, rows = engine.executor.runner, engine.scheduler, []
    while len(rows) < 100:
        t0 = time.perf_counter()
        out = scheduler.schedule()
        t1 = time.perf_counter()
        runner.update_states(out)
        runner.move_blocks(out)
        step = runner.prepare(out)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        logits = runner.forward(step)
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        result = runner.collect(runner.sample(step, logits))
        t4 = time.perf_counter()
        for seq in scheduler.update_from_output(out, result.sampled, result.reports):  # the engine's bookkeeping
            mi.RequestOutput.of(seq)
        if out.num_batched_tokens == len(out.num_new_tokens):  # decode steps only
            rows.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3, time.perf_counter() - t4, len(out.num_new_tokens)))
    for rid in list(engine.requests):
        engine.abort(rid)
    replay = {}
    for b in (1, runner.graphs.buckets[-1]):  # the device time alone: back-to-back replays
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            runner.graphs.graphs[b].replay()
        end.record()
        torch.cuda.synchronize()
        replay[b] = start.elapsed_time(end) / 50
    keys = ["schedule_ms", "build_batch_ms", "graph_replay_ms", "sample_ms", "bookkeeping_ms"]
    res = {"batch": statistics.median(r[-1] for r in rows), "decode_steps": len(rows),
           **{k: 1e3 * statistics.median(r[i] for r in rows) for i, k in enumerate(keys)},
           "device_ms_per_replay_by_batch": replay}
    print("profile:", res, flush=True)
    return res


# Free strings, so that a random model stays inside the grammar to its last token (ignore_eos keeps
# every request to its length, as in the plain run, and the grammar's end is where its mask ends).
SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "items": {
    "type": "array", "items": {"type": "string"}}}, "required": ["name", "items"]})


def TOP5(i: int, n: int) -> mi.SamplingParams:
    """Every request with its tokens' top-5 log-probabilities."""
    return mi.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=5)


def HALF_JSON(i: int, n: int) -> mi.SamplingParams:
    """Every other request held to SCHEMA."""
    return mi.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                             structured_output=mi.StructuredOutput(json=SCHEMA) if i % 2 else None)


@contextlib.contextmanager
def one_by_one():
    """The grammars' masks filled a row at a time on one thread, as before xgrammar's batch call."""
    from miniinfer.worker import structured_output as so
    batched = so.fill_masks

    def fill(live, bitmask, filler):
        for n, matcher in live:
            matcher.fill_next_token_bitmask(bitmask, n)
    so.fill_masks = fill
    try:
        yield
    finally:
        so.fill_masks = batched


def sampling(model, prompts, outs) -> dict:
    """The workload three ways in one run: plain, half of it held to SCHEMA, all of it with top-5 logprobs."""
    ways = {"plain": lambda i, n: greedy(n), "half_json": HALF_JSON, "logprobs_top5": TOP5}
    res = {}
    for name, params in ways.items():
        engine = engine_for(model, mi.load_tokenizer())  # the door checks grammars with it, as the runner does
        engine.generate(prompts[:8], [params(i, 8) for i in range(8)], use_tqdm=False)  # warm-up, grammar compiled
        r = run_engine(engine, prompts, outs, params=params)
        del engine  # its pool goes before the next one sizes its own
        res[name] = {k: v for k, v in r.items() if k != "trace"}
        print(f"sampling {name}: {r['output_tokens_per_s']:.0f} output tok/s", flush=True)
    for name in ("half_json", "logprobs_top5"):
        res[name]["of_plain"] = res[name]["output_tokens_per_s"] / res["plain"]["output_tokens_per_s"]
    return res


def main(out_path: str, parts: list[str]) -> None:
    """Run the parts in the order given; the JSON is rewritten after each, so a run cut short keeps
    what it finished."""
    results = Results(out_path, copy_GBps=copy_bandwidth())
    res = results.data
    gbps = res["copy_GBps"]
    res.setdefault("matmul_TFLOPs", matmul_tflops())
    prompts, outs = workload()
    res["workload"] = {"requests": len(prompts), "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(outs)}
    loaded = {}
    for spec in parts:
        shape, part = spec.split(":") if ":" in spec else ("llama", spec)
        part, _, ops = part.partition("@")
        if shape not in loaded:
            loaded.clear()  # one shape's models on the device at a time
            gc.collect()
            torch.cuda.empty_cache()
            loaded[shape] = (None, llama_8b()) if shape == "llama8b" else models(shape)
            res.setdefault(shape, {})["floor"] = floor(loaded[shape][1], prompts, outs, gbps, res["matmul_TFLOPs"])
        hf, model = loaded[shape]
        model.use_ops(ops or "fused")
        r = res[shape]
        if ops:  # the part with another ops backend (before/after a change of kernels): its own key
            r = r.setdefault(f"ops_{ops}", {})
        if part == "ours":
            r["ours"] = ours(model, prompts, outs)
        elif part == "ours_sync":
            r["ours_no_overlap"] = ours(model, prompts, outs, overlap=False)
        elif part == "overlap":
            r["overlap_profile"] = {k: lanes(model, prompts, k == "on") for k in ("off", "on")}
        elif part == "lanes1":
            r["lanes1"] = lanes(model, [prompts[0][:32]], True)
        elif part == "logprobs_profile":
            r["logprobs_profile"] = lanes(model, prompts, True, params=TOP5)
        elif part == "structured_overlap":
            r["structured_overlap"] = {"plain": lanes(model, prompts, True), "half_json": lanes(model, prompts, True,
                                                                                               params=HALF_JSON)}
            with one_by_one():
                r["structured_overlap"]["half_json_one_by_one"] = lanes(model, prompts, True, params=HALF_JSON)
        elif part == "profile":
            r["profile"] = profile(model, prompts, outs)
        elif part == "batch1":
            r["batch1"] = batch1(model, gbps)
        elif part == "timeline1":
            r["timeline1"] = timeline1(model, gbps)
        elif part == "hf_batch1":
            r["hf_batch1"] = hf_batch1(hf)
        elif part == "static":
            r["static_ch02"] = static(model, prompts, outs)
        elif part == "hf":
            r["hf_generate_batch"] = hf_generate_batch(hf, prompts, outs)
        elif part == "hf_static":
            r["hf_static"] = hf_static(hf, prompts, outs)
        elif part == "sampling":
            r["sampling"] = sampling(model, prompts, outs)
        else:
            raise ValueError(f"unknown part {part!r}")
        results.write()


def plot(out_path: str) -> None:
    import matplotlib.pyplot as plt

    res = json.loads(Path(out_path).read_text())
    fig, (ax1, ax3, ax2) = plt.subplots(1, 3, figsize=(16, 4), gridspec_kw={"width_ratios": [1, 0.7, 1.2]})
    names = {"floor": "floor", "ours": "miniinfer LLMEngine", "ours_no_overlap": "miniinfer, overlap off",
             "static_ch02": "ours, static batch (ch02)",
             "hf_generate_batch": "transformers generate_batch", "hf_static": "transformers static batch"}
    labels = {"llama": "Llama-3.2-1B shape", "qwen3": "Qwen3-0.6B shape"}
    names = {k: v for k, v in names.items() if any(k in res[s] for s in labels if s in res)}
    for i, shape in enumerate(s for s in labels if s in res):
        for j, key in enumerate(names):
            if key in res[shape]:
                v = res[shape][key]["output_tokens_per_s"]
                ax1.barh(j + 0.4 * i, v, height=0.4, color=f"C{i}", label=labels[shape] if j == 1 else None)
                ax1.text(v, j + 0.4 * i, f" {v:,.0f}", va="center", fontsize=8)
    ax1.set_yticks([j + 0.2 for j in range(len(names))], list(names.values()))
    ax1.invert_yaxis()
    ax1.set_xscale("log")
    ax1.set_xlabel("output tokens/s (log scale)")
    ax1.legend(fontsize=8)
    ax1.set_title(f"256 requests, {res['gpu']}", fontsize=10)
    batch1 = {"floor": lambda r: r["batch1"]["floor_tokens_per_s"], "miniinfer": lambda r: r["batch1"]["tokens_per_s"],
              "transformers static,\ncompiled": lambda r: r["hf_batch1"]["compiled"]["tokens_per_s"],
              "transformers static,\neager": lambda r: r["hf_batch1"]["eager"]["tokens_per_s"]}
    for i, shape in enumerate(s for s in labels if s in res):
        for j, get in enumerate(batch1.values()):
            try:
                v = get(res[shape])
            except KeyError:
                continue
            ax3.barh(j + 0.4 * i, v, height=0.4, color=f"C{i}")
            ax3.text(v, j + 0.4 * i, f" {v:,.0f}", va="center", fontsize=8)
    ax3.set_yticks([j + 0.2 for j in range(len(batch1))], list(batch1))
    ax3.invert_yaxis()
    ax3.set_xlabel("tokens/s")
    ax3.set_title("one request (batch 1)", fontsize=10)
    # Every sequence in a step, prefill or decode, produces one output token.
    t, running = zip(*((r[0], r[1]) for r in res["llama"]["ours"]["trace"]))
    ax2.plot(t, running, label="sequences in the step")
    ax2.set_xlabel("seconds")
    ax2.set_ylabel("sequences in the step")
    w = 20
    rate = ax2.twinx()
    rate.plot(t[w:], [sum(running[i - w + 1:i + 1]) / (t[i] - t[i - w]) for i in range(w, len(t))],
              color="C1", label=f"output tokens/s ({w}-step window)")
    rate.set_ylabel("output tokens/s")
    ax2.set_title("the engine over time (Llama-3.2-1B shape)", fontsize=10)
    lines = ax2.get_lines() + rate.get_lines()
    rate.legend(lines, [line.get_label() for line in lines], loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(Path(out_path).with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    commands(run=lambda out, *parts: main(out, list(parts)), plot=plot, plot_layers=plot_layers)
