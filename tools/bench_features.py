"""Every feature at the plain path's speed? The feature matrix, measured in one run (chapters 06-12).

Hand-written tool. Parts (any of them, in one run, in the order given; results merge into the JSON):
    matrix[:ROW,ROW]  the end-to-end workload of docs/benchmarks/README.md on the Llama-3.2-1B shape (256
             requests, random bf16 weights), plain and with one feature on at a time: each row's output
             tokens/s and its ratio to plain in the same run (ROWS below says what each row turns on),
             and the garbage collector's passes and time while it ran
    batch1   one request on the Llama-3.2-1B shape, per weight format (bf16, int8, int4, fp8): served
             tokens/s against the rate its step allows (1 / the batch-1 CUDA graph's replay on the device)
    moe      the same for the mixture of experts (Qwen3-30B-A3B cut to 8 layers, tools/bench_moe.py)
    mla      the same for latent attention (DeepSeek-V2-Lite's shape cut to 8 layers, tools/bench_mla.py)
    grammar  128 masks of the JSON row filled at once, by thread count; the processors this machine gives
    scoring  top-5 log-probabilities of 256 rows: chapter 12's fused kernel against PyTorch's ops
    sampling  temperature 0.8 with top-p 0.95 (and with top-k 50 as well) over 256 rows and over one row of
             Llama-3's 128,256 bf16 logits: chapter 06's fused sampling kernel against its sorts, tokens compared
    host:ROW,ROW[@N]  decode steps of 256 requests (or N) for rows of the matrix: the host's time per step in each
             phase of it (schedule, prepare, forward, sample and its processors, collect, update, outputs),
             waits for the device included, and the step's wall time
    cpuhost:ROW,ROW[@N]  the same on this machine's CPU, the model one layer of width 32: the engine's host work
             alone (no GPU needed)
    lanes:ROW[@N]  the host and device lanes of decode steps (bench_engine.py's `lanes`) of 256 requests (or N)
             for a row of the matrix: `lanes:ngram@64` profiles steps that verify guesses
    lanes1:FORMAT  the batch-1 step's host and device lanes (bench_engine.py's `lanes`) for a weight format,
             or for the mixture of experts (lanes1:moe)
    replay256  per weight format, the decode step of 256 requests on the device alone (its CUDA graph
             replayed back to back, each request one token of context: the matmuls, which the format
             changes): whether a format's row of the matrix loses on the device or on the host
    pyprof256:ROW[@N]  the same for 40 decode steps of 256 requests (or N, as `host` runs them) for a row
    pyprof1:FORMAT  the host's Python functions in 256 batch-1 decode steps (cProfile), for a weight format or
             the mixture of experts: the most costly by their own time and by time inside them, per step
    python tools/bench_features.py run docs/benchmarks/features_h200.json matrix batch1 moe mla
    python tools/bench_features.py plot docs/benchmarks/features_h200.json
"""

import copy
import gc
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from bench_engine import (
    HALF_JSON,
    TOP5,
    engine_for,
    greedy,
    lanes,
    models,
    phases,
    run_engine,
    served_and_step,
    workload,
)
from benchlib import Results, commands, gpu_ms
from copy_bandwidth import copy_bandwidth

import miniinfer as mi
from miniinfer.layers import quantization as quant

Params = Callable[[int, int], mi.SamplingParams]  # (request index, its output length) -> its sampling


def sampled(i: int, n: int) -> mi.SamplingParams:
    return mi.SamplingParams(temperature=0.8, top_p=0.95, max_tokens=n, ignore_eos=True, seed=i)


def penalized(i: int, n: int) -> mi.SamplingParams:
    return mi.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, presence_penalty=0.5,
                             frequency_penalty=0.5, repetition_penalty=1.1)


def echo(i: int, n: int) -> mi.SamplingParams:
    """lm-evaluation-harness's loglikelihood requests: every prompt token's log-probability."""
    return mi.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, prompt_logprobs=1)


def all_json(i: int, n: int) -> mi.SamplingParams:
    return HALF_JSON(1, n)


def half_regex(i: int, n: int) -> mi.SamplingParams:
    """Every other request held to words of lowercase letters and spaces (free text a random model stays in)."""
    return mi.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                             structured_output=mi.StructuredOutput(regex="[a-z ]+") if i % 2 else None)


# name -> (what the row turns on, EngineConfig fields, its sampling, a weight format or None)
ROWS: dict[str, tuple[str, dict, Params | None, str | None]] = {
    "plain": ("greedy, every request its own length", {}, None, None),
    "seeded": ("temperature 0.8, top-p 0.95, a seed per request", {}, sampled, None),
    "n4": ("the first 64 prompts 4 times each (OpenAI's n=4), sampled and seeded", {}, sampled, None),
    "penalties": ("presence 0.5, frequency 0.5, repetition 1.1 on every request", {}, penalized, None),
    "logprobs_top5": ("top-5 log-probabilities of every token, every request", {}, TOP5, None),
    "prompt_logprobs": ("every prompt token's log-probability (echo), every request", {}, echo, None),
    "json_half": ("every other request held to a JSON schema", {}, HALF_JSON, None),
    "json_all": ("every request held to a JSON schema", {}, all_json, None),
    "regex_half": ("every other request held to a regex", {}, half_regex, None),
    "ngram": ("n-gram speculation, 4 guesses a step", {"speculative_method": "ngram"}, None, None),
    "int8": ("int8 weights", {}, None, "int8"),
    "int4": ("int4 weights (groups of 128)", {}, None, "int4"),
    "fp8": ("fp8 weights (W8A8)", {}, None, "fp8"),
    "fp8_kv": ("the FP8 KV cache", {"kv_cache_dtype": "fp8"}, None, None),
    "prefix_caching": ("prefix caching on (the random prompts share nothing)", {"enable_prefix_caching": True},
                       None, None),
    "chunked_prefill": ("chunked prefill on", {"enable_chunked_prefill": True}, None, None),
}
# Rows run again: the top-5 row with Python's cyclic garbage collector off, to show its share, and with
# every object alive before it frozen (gc.freeze: out of the collector's passes).
AGAIN = {"logprobs_top5_gc_off": "logprobs_top5", "logprobs_top5_frozen": "logprobs_top5"}


def paired(rows: list[str]) -> list[str]:
    """Plain before every row and after the last. One lend's host drifts by 0.1-0.3x of plain within a
    call (features_trim_h100.json: three rows of equal work at 0.56-0.86x); each row is read against the
    plain runs on either side of it, not one plain run for the whole call."""
    order = ["plain"]
    for row in rows:
        if row != "plain":
            order += [row, "plain"]
    return order


def against_plain(res: dict) -> None:
    """Each row's of_plain: its rate over the mean of the nearest plain runs before and after it (in
    run order; those there are); a plain run's over the mean of all of them."""
    names = list(res)
    plains = [i for i, k in enumerate(names) if k.split("#")[0] == "plain"]
    rate = lambda i: res[names[i]]["output_tokens_per_s"]
    everyone = sum(map(rate, plains)) / len(plains) if plains else None
    for i, k in enumerate(names):
        near = [j for j in plains if j < i][-1:] + [j for j in plains if j > i][:1]
        ref = everyone if i in plains or not near else sum(map(rate, near)) / len(near)
        if ref:
            res[k]["of_plain"] = rate(i) / ref


def row_phases(trace: list) -> dict:
    """A row's seconds in steps with prompt tokens, in decode steps that verified guesses and in the
    other decode steps, and its steps of each kind (bench_engine.phases)."""
    kinds = phases(trace)
    decode = [v for k, v in kinds.items() if k.startswith("decode")]
    return {"prefill_s": kinds.get("prefill", {}).get("seconds", 0.0),
            "verify_s": kinds.get("verify", {}).get("seconds", 0.0),
            "decode_s": sum(v["seconds"] for v in decode), "steps_by_kind": kinds}


def with_weights(base, fmt: str | None):
    """base itself in bf16 (None, "" or "bf16"), else a copy of it with its weights quantized to fmt."""
    if fmt in (None, "", "bf16"):
        return base
    model = copy.deepcopy(base)
    quant.quantize_model(model, fmt)
    return model


class CollectorClock:
    """The garbage collector's passes while a row runs, by generation: their count and time (ms), and
    how many objects it tracks when the row starts (what a full pass walks)."""

    def __init__(self):
        self.ms, self.passes, self.t0 = [0.0, 0.0, 0.0], [0, 0, 0], 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.t0 = time.perf_counter()
        else:
            self.ms[info["generation"]] += (time.perf_counter() - self.t0) * 1e3
            self.passes[info["generation"]] += 1

    def __enter__(self):
        self.tracked = len(gc.get_objects())
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)

    def report(self) -> dict:
        return {"gc_tracked_objects": self.tracked, "gc_ms_by_generation": self.ms,
                "gc_passes_by_generation": self.passes}


def matrix(base, prompts, outs, save, names: list[str]) -> dict:
    """The workload once per row (names: every row between plain runs, or those given, in that order; a
    row named again is run again as NAME#2, ...), each on a fresh engine after a warm-up of 8 requests."""
    res: dict = {}
    for row in names or paired([*ROWS, *AGAIN]):
        name = row if row not in res else f"{row}#{sum(k.split('#')[0] == row for k in res) + 1}"
        what, config, params, fmt = ROWS[AGAIN.get(row, row)]
        model = with_weights(base, fmt)
        p, o = (prompts[:64] * 4, outs[:64] * 4) if name == "n4" else (prompts, outs)
        engine = engine_for(model, mi.load_tokenizer(), **config)  # the tokenizer: the grammars read it
        warm = params or (lambda i, n: greedy(n))
        engine.generate(p[:8], [warm(i, 8) for i in range(8)], use_tqdm=False)  # compiles, captures, grammars
        if row == "logprobs_top5_gc_off":
            what += ", the garbage collector off"
            gc.disable()
        if row == "logprobs_top5_frozen":
            what += ", what was alive before it frozen"
            gc.collect()
            gc.freeze()
        try:
            with CollectorClock() as collector:
                r = run_engine(engine, p, o, params=params)
        finally:
            gc.enable()
            gc.unfreeze()
        r.update(row_phases(r.pop("trace")), **collector.report())
        res[name] = {"what": what, **config, **({"weights": fmt} if fmt else {}), **r}
        print(f"matrix {name}: {r['output_tokens_per_s']:,.0f} output tok/s ({r['seconds']:.1f} s: prompts "
              f"{r['prefill_s']:.1f}, decode {r['decode_s']:.1f}, verifying {r['verify_s']:.1f}; {r['steps']} steps; "
              f"the collector "
              f"{sum(collector.ms):.0f} ms in {collector.passes} passes)", flush=True)
        del engine, model
        gc.collect()
        torch.cuda.empty_cache()
        save(res)
    against_plain(res)
    for name, r in res.items():
        if "of_plain" in r:
            print(f"  {name}: {r['of_plain']:.2f}x plain", flush=True)
    return res


def batch1_of(name: str, model) -> dict:
    r = served_and_step(model)
    print(f"batch1 {name}: served {r['tokens_per_s']:,.0f} tok/s, its step allows {r['step_tokens_per_s']:,.0f} "
          f"({r['step_us']:.0f} us): {r['of_step']:.2f}", flush=True)
    return r


def batch1(base) -> dict:
    res = {}
    for fmt in ("bf16", "int8", "int4", "fp8"):
        model = with_weights(base, fmt)
        res[fmt] = batch1_of(fmt, model)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    return res


def moe() -> dict:
    from bench_moe import models as moe_models
    return batch1_of("moe", moe_models()[1])


def mla() -> dict:
    from bench_mla import V2_LITE, checkpoint
    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
        checkpoint("deepseek_v2", V2_LITE, folder)  # transformers' copy freed before ours loads
        model = mi.load_model(folder, device="cuda", dtype=torch.bfloat16)
    return batch1_of("mla", model)


def grammar() -> dict:
    """The JSON row's masks alone: 128 matchers of its schema (the course tokenizer) filled in one batch,
    by xgrammar's thread count, and the processors this machine gives the engine (a container may get
    fewer than the host has)."""

    import xgrammar as xgr
    from bench_engine import SCHEMA

    from miniinfer.worker import structured_output as so
    tok = mi.load_tokenizer()
    compiled = so.compile_structure(mi.StructuredOutput(json=SCHEMA), so.grammar_compiler(tok, 128256))
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(128)]
    for m in matchers:
        m.accept_token(tok.encode('{"', add_special_tokens=False)[0])
    bitmask = torch.empty(128, -(-so.grammar_vocab(tok, 128256) // 32), dtype=torch.int32)
    res = {"os_cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "fill_128_us": {}}
    for threads in (1, 2, 4, 8, 16, "auto"):
        batch = xgr.BatchGrammarMatcher(max_threads=threads)
        fill = lambda: batch.batch_fill_next_token_bitmask(matchers, bitmask, list(range(128)))
        for _ in range(20):
            fill()
        t0 = time.perf_counter()
        for _ in range(200):
            fill()
        res["fill_128_us"][str(threads)] = (time.perf_counter() - t0) / 200 * 1e6
    print(f"grammar: {res}", flush=True)
    return res


def scoring() -> dict:
    """The top-5 scoring of 256 rows of Llama-3's 128,256 bf16 logits: chapter 12's fused kernel against
    top_logprobs (PyTorch's log-softmax, top-k and rank), results compared, then each timed (median)."""
    from miniinfer.kernels.logprobs import fused_top_logprobs
    from miniinfer.worker.sample.logprobs import top_logprobs
    torch.manual_seed(0)
    x = torch.randn(256, 128256, device="cuda").to(torch.bfloat16)
    tokens = torch.randint(0, 128256, (256,), device="cuda")
    (own, rank, top, ids), want = fused_top_logprobs(x, tokens, 5), top_logprobs(x, tokens, 5)
    # Tied logits (bf16 has few values near the top) may come in either order: each id is checked by
    # its own log-probability, which must be the reference's at its place.
    logprobs = x.float().log_softmax(-1)
    same = bool(torch.allclose(own, want[0], atol=1e-4) and torch.equal(rank, want[1])
                and torch.allclose(top, want[2], atol=1e-4)
                and torch.allclose(logprobs.gather(1, ids), want[2], atol=1e-4))
    res = {"rows": 256, "vocab": 128256, "k": 5, "same": same, "ids_in_the_same_order": bool(torch.equal(ids, want[3])),
           **{f"{name}_us": gpu_ms(lambda: fn(x, tokens, 5)) * 1e3
              for name, fn in (("fused", fused_top_logprobs), ("torch", top_logprobs))}}
    print(f"scoring: fused {res['fused_us']:.0f} us, torch {res['torch_us']:.0f} us, same {same}", flush=True)
    return res


def sampling() -> dict:
    """Seeded sampling of 256 rows and of one row of Llama-3's 128,256 bf16 logits: chapter 06's fused kernel
    against sampling_probs' sorts and the noise's argmax, tokens compared, then each timed (median)."""
    from miniinfer.worker.sample import sampler as S
    torch.manual_seed(0)
    res = {}
    for rows in (256, 1):
        x = (torch.randn(rows, 128256, device="cuda") * 3).to(torch.bfloat16)
        for name, top_k in (("top_p", 128256), ("top_p_top_k50", 50)):
            values = np.array([[0.8] * rows, [0.95] * rows, [top_k] * rows, list(range(rows))], dtype=np.float64)
            s = S.SamplingBatch.build(values, np.arange(rows), 128256, "cuda")
            keys = S.row_keys(s.seeds, s.steps)
            fused = lambda: S.FUSED_SAMPLE["triton"](x, s.temperature, s.top_k, s.top_p, keys, s.k_max,
                                                     S.GREEDY_BELOW)
            sort = lambda: S.argmax(S.sampling_probs(x, s) / S.exponential_noise(s.seeds, s.steps, 128256))
            r = {"same": int((fused() == sort()).sum()), "rows": rows,
                 **{f"{k}_us": gpu_ms(fn) * 1e3 for k, fn in
                    (("fused", fused), ("sort", sort))}}
            res[f"{name}_{rows}"] = r
            print(f"sampling {name} {rows} rows: fused {r['fused_us']:.0f} us, sorts {r['sort_us']:.0f} us, "
                  f"the same token in {r['same']} of {rows}", flush=True)
    return res


def grammar_filler(engine) -> dict:
    """The mask filler's cost a row (on one thread) and the threads it would give 128 rows, if the engine
    held a grammar."""
    from miniinfer.worker.structured_output import Structured
    fillers = [p.filler for p in engine.executor.runner.processors if isinstance(p, Structured)]
    return {"grammar_row_us": fillers[0].row_us, "grammar_threads": fillers[0].threads(128)} if fillers else {}


def host(base, names: list[str], requests: int = 256, **engine_kw: object) -> dict:
    """The host's time in each phase of 40 decode steps of `requests` requests (their prompts' first 200
    tokens, 400 tokens each), for rows of the matrix: each phase's time and calls per step, its waits for
    the device included; a phase inside another (the processors inside sample) is counted in both, and so
    is the grammar's thread, beside the engine's (its time is not the step's). engine_kw: the
    EngineConfig fields that differ (cpuhost's device and dtype)."""
    from miniinfer.core.scheduler import Scheduler
    from miniinfer.worker import speculative as spec
    from miniinfer.worker import structured_output as so
    from miniinfer.worker.cuda_graphs import DecodeGraphs
    from miniinfer.worker.model_runner import ModelRunner
    from miniinfer.worker.sample import logprobs, processors
    spent: dict[str, float] = {}
    calls: dict[str, int] = {}

    def timed(owner, attr: str, name: str):
        fn = getattr(owner, attr)

        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
                calls[name] = calls.get(name, 0) + 1
        # Put back as it was: the raw descriptor (a classmethod stays one), or nothing where it was inherited.
        return vars(owner).get(attr), wrapper
    hooks = [(Scheduler, "schedule", "schedule"), (Scheduler, "update_from_output", "update"),
             (ModelRunner, "prepare", "prepare"), (ModelRunner, "forward", "forward"),
             (ModelRunner, "sample", "sample"), (ModelRunner, "collect", "collect"),
             (mi.LLMEngine, "step", "step"), (mi.RequestOutput, "of", "outputs"),
             (so.Structured, "apply", "sample: grammar masks"),
             (so.Structured, "join", "sample: grammar masks: wait for their thread"),
             (so, "advance", "grammar's thread: wait, accept tokens, fill"),
             (so, "fill_masks", "grammar masks: fill (either thread)"), (logprobs.Scores, "score", "sample: scores"),
             (logprobs.Logprobs, "report", "collect: logprobs' report"),
             (processors.Penalties, "apply", "sample: penalties"),
             (processors.Penalties, "accept", "sample: penalties' counts"),
             # chapter 09's verifying steps: a graph replayed (else eager), the guesses checked, kept
             (spec.SpeculativeRunner, "start", "verify: start"), (spec.NgramProposer, "propose", "verify: propose"),
             (spec, "run_forward", "verify: forward"), (DecodeGraphs, "__call__", "graph replays"),
             (spec, "verify", "verify: accept or reject"), (spec.SpeculativeRunner, "keep", "verify: keep")]
    res = {}
    for name in names:
        what, engine = decoding(base, name, requests, **engine_kw)
        saved = [(owner, attr, timed(owner, attr, label)) for owner, attr, label in hooks]
        for owner, attr, (_, wrapper) in saved:
            setattr(owner, attr, wrapper)
        spent.clear()
        calls.clear()
        try:
            sync()
            t0 = time.perf_counter()
            for _ in range(40):
                engine.step()
            sync()
            wall = (time.perf_counter() - t0) / 40
        finally:
            for owner, attr, (raw, _) in saved:
                if raw is None:
                    delattr(owner, attr)
                else:
                    setattr(owner, attr, raw)
        res[name] = {"what": what, "requests": requests, "step_ms": wall * 1e3,
                     "phases_ms": {k: v / 40 * 1e3 for k, v in spent.items()},
                     "calls_per_step": {k: v / 40 for k, v in calls.items()}, **grammar_filler(engine)}
        print(f"host {name}: step {wall * 1e3:.2f} ms; " + ", ".join(
            f"{k} {v:.2f}" for k, v in res[name]["phases_ms"].items()), flush=True)
        done256(engine)
        del engine  # before the next row's engine sizes its pool
    return res


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def cpu_model():
    """A model too small to cost its CPU forward much (one layer, width 32) with a vocabulary the
    workload's prompts fit: what is left of a step on the CPU is the engine's host work."""
    from miniinfer.course.parity import make_hf_model
    hf = make_hf_model("llama", vocab_size=10240, hidden_size=32, intermediate_size=32, num_attention_heads=2,
                       num_key_value_heads=1, num_hidden_layers=1, max_position_embeddings=1024,
                       eos_token_id=mi.load_tokenizer().eos_token_id)
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        return mi.load_model(folder, dtype=torch.float32)


def decoding(base, name: str, requests: int = 256, **engine_kw: object) -> tuple[str, mi.LLMEngine]:
    """A fresh engine for a row of the matrix, `requests` requests (their prompts' first 200 tokens, 400
    tokens each) past their prompts and 10 decode steps into their outputs; the row's description."""
    what, config, params, fmt = ROWS[name]
    params = params or (lambda i, n: greedy(n))
    prompts, _ = workload()
    engine = engine_for(with_weights(base, fmt), mi.load_tokenizer(), **config, **engine_kw)
    engine.generate(prompts[:8], [params(i, 8) for i in range(8)], use_tqdm=False)
    for i in range(requests):
        engine.add_request(prompts[i][:200], params(i, 400))
    while len(engine.stats.scheduled) < requests or engine.stats.kind != "decode":
        engine.step()
    for _ in range(10):
        engine.step()
    return what, engine


def done256(engine: mi.LLMEngine) -> None:
    for rid in list(engine.requests):
        engine.abort(rid)


def replay256(base) -> dict:
    res = {}
    for fmt in ("bf16", "int8", "int4", "fp8"):
        engine = engine_for(with_weights(base, fmt))
        graphs = engine.executor.runner.graphs
        b = graphs.buckets[-1]
        res[fmt] = {"batch": b, "step_us": gpu_ms(graphs.graphs[b].replay, rep=200) * 1e3}
        print(f"replay256 {fmt}: {res[fmt]['step_us']:.0f} us a decode step of {b}", flush=True)
        del engine, graphs
        gc.collect()
        torch.cuda.empty_cache()
    for r in res.values():
        r["of_bf16"] = r["step_us"] / res["bf16"]["step_us"]
    return res


def pyprof1(model) -> dict:
    """cProfile over one stream of 256 tokens after a warm-up: where the host's time of a batch-1 step goes."""
    engine = engine_for(model, max_num_seqs=8)
    prompt = list(range(100, 132))
    list(engine.stream(prompt, greedy(16)))
    return profiled(lambda: list(engine.stream(prompt, greedy(256))), 256)


def pyprof256(base, name: str, requests: int = 256) -> dict:
    """cProfile over 40 decode steps of 256 requests (or `requests`) for a row of the matrix (as `host`
    runs them)."""
    _, engine = decoding(base, name, requests)
    try:
        return profiled(lambda: [engine.step() for _ in range(40)], 40)
    finally:
        done256(engine)


def profiled(run: Callable[[], object], steps: int) -> dict:
    """The host's Python functions while run() takes `steps` steps: the most costly by their own time
    and by time inside them, per step."""
    import cProfile
    import pstats
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    run()
    profiler.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive calls, own s, cumulative s, callers)
    rows = [{"fn": f"{Path(f).name}:{line}:{name}", "calls_per_step": calls / steps, "own_us": own / steps * 1e6,
             "cum_us": cum / steps * 1e6} for (f, line, name), (_, calls, own, cum, _) in stats.items()]
    res = {"step_us_profiled": wall / steps * 1e6,
           "by_own": sorted(rows, key=lambda r: -r["own_us"])[:40],
           "by_cumulative": sorted(rows, key=lambda r: -r["cum_us"])[:60]}
    print(f"profiled: {res['step_us_profiled']:.0f} us a step under the profiler; by own time:", flush=True)
    for r in res["by_own"][:25]:
        print(f"  {r['own_us']:7.1f} us {r['calls_per_step']:6.1f} calls  {r['fn']}", flush=True)
    return res


def main(out_path: str, parts: list[str]) -> None:
    save = Results(out_path, **({"copy_GBps": copy_bandwidth()} if torch.cuda.is_available() else {})).saver
    base = None
    for part in parts:
        part, _, fmt = part.partition(":")
        fmt, _, n = fmt.partition("@")
        requests = int(n or 256)
        dense = (part in ("matrix", "batch1", "host", "replay256", "pyprof256", "lanes")
                 or part in ("lanes1", "pyprof1") and fmt != "moe")
        if base is None and dense:
            base = models("llama")[1]
        if part == "matrix":
            prompts, outs = workload()
            save("matrix")(matrix(base, prompts, outs, save("matrix"), [r for r in fmt.split(",") if r]))
        elif part == "batch1":
            save("batch1")(batch1(base))
        elif part == "replay256":
            save("replay256")(replay256(base))
        elif part == "grammar":
            save("grammar")(grammar())
        elif part == "scoring":
            save("scoring")(scoring())
        elif part == "sampling":
            save("sampling")(sampling())
        elif part == "host":
            save("host" if requests == 256 else f"host{requests}")(host(base, fmt.split(","), requests))
        elif part == "cpuhost":
            save("cpuhost")(host(cpu_model(), fmt.split(","), requests, device="cpu", dtype=torch.float32))
        elif part == "lanes":
            _, config, params, weights = ROWS[fmt]
            save(f"lanes_{fmt}{requests}")(lanes(with_weights(base, weights), workload()[0][:requests], True,
                                                 params=params, **config))
        elif part == "moe":
            save("moe_batch1")(moe())
        elif part == "mla":
            save("mla_batch1")(mla())
        elif part == "lanes1" and fmt == "moe":
            from bench_moe import models as moe_models
            save("lanes1_moe")(lanes(moe_models()[1], [workload()[0][0][:32]], True))
        elif part == "pyprof1" and fmt == "moe":
            from bench_moe import models as moe_models
            save("pyprof1_moe")(pyprof1(moe_models()[1]))
        elif part == "pyprof256":
            save(f"pyprof{requests}_{fmt}")(pyprof256(base, fmt, requests))
        elif part == "pyprof1":
            save(f"pyprof1_{fmt or 'bf16'}")(pyprof1(with_weights(base, fmt)))
        elif part == "lanes1":
            model = with_weights(base, fmt)
            save(f"lanes1_{fmt or 'bf16'}")(lanes(model, [workload()[0][0][:32]], True))
            del model
        else:
            raise SystemExit(f"unknown part {part!r}")
        gc.collect()  # a part's engines hold most of the GPU (their KV pools): gone before the next part
        torch.cuda.empty_cache()


def plot(out_path: str) -> None:
    import matplotlib.pyplot as plt

    res = json.loads(Path(out_path).read_text())
    rows = {k: v for k, v in res.get("matrix", {}).items() if k.split("#")[0] != "plain"}
    ones = {k: res[v] for k, v in (("moe", "moe_batch1"), ("mla", "mla_batch1")) if v in res}
    b1 = {**res.get("batch1", {}), **ones}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 0.32 * max(len(rows), len(b1)) + 1.6),
                                   gridspec_kw={"width_ratios": [1.3, 1]})
    for ax, items, title in ((ax1, {k: v["of_plain"] for k, v in rows.items()},
                              "256 requests, Llama-3.2-1B shape: output tokens/s of plain"),
                             (ax2, {k: v["of_step"] for k, v in b1.items()},
                              "batch 1: served tokens/s of what its step allows")):
        names = list(items)
        colors = ["C2" if v >= 0.9 else "C3" for v in items.values()]
        ax.barh(range(len(names)), list(items.values()), color=colors)
        for j, v in enumerate(items.values()):
            ax.text(v, j, f" {v:.2f}", va="center", fontsize=8)
        ax.axvline(0.9, color="gray", ls="--", lw=1)
        ax.set_yticks(range(len(names)), names)
        ax.invert_yaxis()
        ax.set_xlim(0, 1.25)
        ax.set_title(title, fontsize=10)
    fig.suptitle(f"miniinfer's features at speed, {res['gpu']} ({res['date']}; dashed: the goal, 0.9)", fontsize=10)
    fig.tight_layout()
    fig.savefig(Path(out_path).with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    commands(run=lambda out, *parts: main(out, list(parts)), plot=plot)
