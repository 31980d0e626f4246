"""Greedy parity on the GPU: the engine (float32, Triton kernels, CUDA graphs, prefix caching and
chunked prefill on) against transformers' generate on the same random checkpoints (the tests'
Llama, Qwen2 and Qwen3 shapes), 48 requests over shared prefixes, each served twice (the second
round hits the cache), with overlap on (the default) and off; then six of them alone (batch 1, every
decode step through chapter 06's one-row GEMVs). Then the course model quantized (int8, int4, fp8;
float32 and bf16): each request served among the others (chapter 10's batched kernels) against the
same request alone (the one-row GEMVs) and against chapter 04's ops (the plain matmuls, no GEMV).
`moe`: the same parity on the tests' mixtures of experts (Qwen3-MoE, Qwen2-MoE, Mixtral; chapter 13's
fused kernels and CUDA graphs), overlap on; `mla` on the tests' DeepSeek-V2 and -V3 (chapter 14).
`tp` (two GPUs, chapter 11): the tests' three shapes and the course model served with
tensor_parallel_size 1 and 2 (the sums at the norms, in the layers by the one-shot, by NCCL alone) against
transformers, float32, prefix caching and chunked prefill on and a pool small enough that requests are
preempted; then six requests alone.
`scale_out` (chapter 16): the tests' three shapes served by two replicas sharing the one GPU (each its own
process and pool), under the prefix rule and round robin, and by two pipeline stages sharing it (over gloo),
against transformers.

    python tools/gpu_parity.py all OUT.json    (the dense shapes, then the quantized course model)
    python tools/gpu_parity.py quantized OUT.json    (or moe, mla: that part only)
    python tools/gpu_parity.py tp OUT.json [tp2 tp2_layers tp2_nccl]    (the settings named, else all three)
    python tools/gpu_parity.py scale_out OUT.json [llama qwen2 qwen3]    (the shapes named, else all three)
    python tools/gpu_parity.py persistent OUT.json    (chapter 17's kernel for a batch of one, and the graphs)
"""

import dataclasses
import tempfile
from pathlib import Path

import torch
import transformers
from bench_tp import SETTINGS  # tools/, this file's folder: the same settings as the 8B runs
from benchlib import Results, commands

import miniinfer as mi  # noqa: E402
from miniinfer.course.parity import (
    MLA_SHAPES,
    MOE_SHAPES,
    SHAPES,
    hf_greedy,
    make_hf_model,
    make_mla_model,
    make_moe_model,
    run_steps,
    shared_workload,
)


def parity(kind: str, overlap: bool, n: int = 48, **engine_kw: object) -> dict:
    hf = make_moe_model(kind) if kind in MOE_SHAPES else make_mla_model(kind) if kind in MLA_SHAPES else \
        make_hf_model(kind)
    prompts, params = shared_workload(n)
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        hf = hf.cuda()
        expected = [hf_greedy(hf, p, sp.max_tokens) for p, sp in zip(prompts, params)]
        engine = mi.LLMEngine(mi.EngineConfig(model=folder, device="cuda", dtype=torch.float32, block_size=16,
                                              num_blocks=512, max_num_seqs=16, max_num_batched_tokens=64,
                                              enable_prefix_caching=True, enable_chunked_prefill=True,
                                              overlap=overlap, **engine_kw))
        rounds = [engine.generate(prompts, params, use_tqdm=False) for _ in range(2)]
        # and a few alone: every decode step one row, through chapter 06's GEMVs
        alone = [engine.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts[:6], params[:6])]
        free = engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    same = [sum(o.token_ids == e for o, e in zip(outs, expected)) for outs in rounds]
    cached = [sum(o.num_cached_tokens for o in outs) for outs in rounds]
    same_alone = sum(o.token_ids == e for o, e in zip(alone, expected))
    print(f"{kind}, overlap {overlap} {engine_kw}: {same} of {n} equal to transformers; alone {same_alone} of "
          f"{len(alone)}; cached tokens {cached}; all blocks back {free}", flush=True)
    return {"requests": n, "same_per_round": same, "same_alone": [same_alone, len(alone)],
            "cached_tokens_per_round": cached, "all_blocks_back": free}


def quantized(fmt: str, dtype: torch.dtype, n: int = 12) -> dict:
    prompts, params = shared_workload(n, vocab=4096)
    engine = mi.LLMEngine(mi.EngineConfig(device="cuda", dtype=dtype, quantization=fmt, num_blocks=256,
                                          max_num_seqs=16))
    together = [o.token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
    alone = [engine.generate([p], sp, use_tqdm=False)[0].token_ids for p, sp in zip(prompts, params)]
    free = engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    model = engine.executor.runner.model
    plain = [mi.generate_cached(model.use_ops("triton"), p, sp) for p, sp in zip(prompts, params)]
    res = {"requests": n, "alone_same_as_together": sum(a == t for a, t in zip(alone, together)),
           "chapter04_ops_same_as_together": sum(a == t for a, t in zip(plain, together)), "all_blocks_back": free}
    print(f"{fmt} {dtype}: {res}", flush=True)
    return res


def tp_parity(kind: str, settings: list[str], n: int = 48) -> dict:
    """Two rounds of the shared workload (the second hits the cache) through TP=1 and TP=2 engines whose
    12-block pool holds fewer than the 16 requests of a step: preemptions counted, outputs compared with
    transformers' and TP=1's."""
    prompts, params = shared_workload(n)
    res: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = str(Path(mi.__file__).parent / "assets" / "pycoder") if kind == "course" else tmp
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder) if kind == "course" else make_hf_model(kind)
        if kind != "course":
            hf.save_pretrained(folder)
        hf = hf.cuda().float()
        expected = [hf_greedy(hf, p, sp.max_tokens) for p, sp in zip(prompts, params)]
        for name in ["tp1", *settings]:
            tp, how = SETTINGS[name]
            engine = mi.LLMEngine(mi.EngineConfig(model=folder, device="cuda", dtype=torch.float32, block_size=16,
                                                  num_blocks=12, max_num_seqs=16, max_num_batched_tokens=64,
                                                  enable_prefix_caching=True, enable_chunked_prefill=True,
                                                  tensor_parallel_size=tp, all_reduce=how))
            same, preempted, outs = [], 0, []
            for _ in range(2):
                ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
                final, steps_preempted = run_steps(engine)
                preempted += steps_preempted
                outs.append([final[i].token_ids for i in ids])
                same.append(sum(o == e for o, e in zip(outs[-1], expected)))
            # and a few alone: every decode step one row (on two GPUs, each GEMV's row summed by the one-shot)
            alone = [engine.generate([p], sp, use_tqdm=False)[0].token_ids for p, sp in zip(prompts[:6], params[:6])]
            res[name] = {"same_per_round": same, "preemptions": preempted,
                         "same_alone": [sum(a == e for a, e in zip(alone, expected)), len(alone)],
                         "same_as_tp1_per_round": [sum(a == b for a, b in zip(mine, tp1)) for mine, tp1 in
                                                   zip(outs, res["tp1"]["outputs"])] if tp > 1 else None,
                         "all_blocks_back": engine.block_manager.num_free_blocks == engine.block_manager.num_blocks}
            engine.close()
            print(f"{kind} {name}: {res[name]}", flush=True)
            res[name]["outputs"] = outs
    for r in res.values():
        del r["outputs"]
    return {"requests": n, **res}


def scale_out_parity(kind: str, n: int = 48) -> dict:
    """Two rounds of the shared workload (the second finds its prefixes cached) through chapter 16's engines
    on one GPU, each part two processes sharing it: two replicas under two rules, and two pipeline stages.
    Outputs against transformers', the cache hits, every block back (on each replica)."""
    prompts, params = shared_workload(n)
    res: dict = {"requests": n}
    with tempfile.TemporaryDirectory() as folder:
        hf = make_hf_model(kind)
        hf.save_pretrained(folder)
        hf = hf.cuda()
        expected = [hf_greedy(hf, p, sp.max_tokens) for p, sp in zip(prompts, params)]
        base = mi.EngineConfig(model=folder, device="cuda", dtype=torch.float32, block_size=16, num_blocks=512,
                               max_num_seqs=16, max_num_batched_tokens=64, enable_prefix_caching=True,
                               enable_chunked_prefill=True)
        for part in ("prefix", "round_robin", "pipeline"):
            engine = (mi.LLMEngine(dataclasses.replace(base, pipeline_parallel_size=2)) if part == "pipeline" else
                      mi.ReplicatedEngine(dataclasses.replace(base, data_parallel_size=2, router=part)))
            rounds = [engine.generate(prompts, params, use_tqdm=False) for _ in range(2)]
            router = getattr(engine, "router", None)
            res[part] = {"same_per_round": [sum(o.token_ids == e for o, e in zip(outs, expected)) for outs in rounds],
                         "cached_tokens_per_round": [sum(o.num_cached_tokens for o in outs) for outs in rounds],
                         "all_blocks_back": all(s.blocks_used == 0 for s in router.stats.values()) if router else
                         engine.block_manager.num_free_blocks == engine.block_manager.num_blocks}
            if router is not None:
                res[part]["placed"] = router.placed
            engine.close()
            print(f"{kind} {part}: {res[part]}", flush=True)
    return res


def scale_out(out: str, *kinds: str) -> None:
    results = Results(out)
    for kind in kinds or SHAPES:
        results.save(kind, scale_out_parity(kind))


def dense_and_quantized(out: str) -> None:
    results = Results(out)
    for kind in SHAPES:
        for overlap in ("on", "off"):
            results.save(f"{kind}_overlap_{overlap}", parity(kind, overlap == "on"))
    quantized_rows(results)


def quantized_only(out: str) -> None:
    quantized_rows(Results(out))


def quantized_rows(results: Results) -> None:
    for fmt in ("int8", "int4", "fp8"):
        for dtype in (torch.float32, torch.bfloat16):
            results.save(f"{fmt}_{str(dtype)[6:]}", quantized(fmt, dtype))


def overlapped(out: str, kinds: list[str]) -> None:
    results = Results(out)
    for kind in kinds:
        results.save(f"{kind}_overlap_on", parity(kind, True))


def moe(out: str) -> None:
    overlapped(out, MOE_SHAPES)


def mla(out: str) -> None:
    overlapped(out, MLA_SHAPES)


def persistent(out: str) -> None:
    """Chapter 17: the dense shapes with a batch of one's step as the persistent kernel, and as the graph of
    the model's kernels (the requests alone, and the last of each round, take it)."""
    results = Results(out)
    for kind in SHAPES:
        for kernel in ("persistent", "graphs"):
            results.save(f"{kind}_{kernel}", parity(kind, True, decode_kernel=kernel))


def tensor_parallel(out: str, *settings: str) -> None:
    results = Results(out)
    for kind in ("course", *SHAPES):  # each saved as it ends: kept if a later shape is cut short
        results.save(kind, tp_parity(kind, list(settings) or ["tp2", "tp2_layers", "tp2_nccl"]))


if __name__ == "__main__":
    commands(all=dense_and_quantized, quantized=quantized_only, moe=moe, mla=mla, tp=tensor_parallel,
             scale_out=scale_out, persistent=persistent)
