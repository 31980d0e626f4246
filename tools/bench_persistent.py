"""Chapter 17 GPU benchmark: the batch-1 decode step as one persistent kernel against the CUDA graph of
the model's many kernels, in one run, on the Llama-3.2-1B, Qwen3-0.6B and an 8B-sized Llama shape
(random bf16 weights), each against its weight-read floor. Hand-written tool.

    python tools/bench_persistent.py compare OUT.json [SHAPE...]   (default: llama qwen3 llama8b)
    python tools/bench_persistent.py sweep OUT.json [SHAPE]   (after compare: a shape's step traced, and swept)
    python tools/bench_persistent.py plot OUT.json    (OUT.png: each shape's share of its floor, the traced step)
    python tools/bench_persistent.py ab OUT.json BEFORE.py [SHAPE...]   (this kernel against another version of
        miniinfer/kernels/persistent.py, e.g. `git show REV:miniinfer/kernels/persistent.py > BEFORE.py`)

Per shape: served tokens/s and the step on the device for both kernels (`bench_engine.served_and_step`),
the logits of one step through both, and the greedy tokens of one request through both. `sweep`: a
shape's step (the Llama shape's by default) traced (each task's start, end of wait and end on each SM, for
the lesson's schedule picture), then with other tiles, warps and splits, its prefetch off, further ahead or
into L1.
`ab`: the two kernels' steps at a context of 512 in turns on the same pool, and each op's span and task
time in a middle layer of each one's trace: what a change to the kernel gained, measured in one run.
"""

import collections
import gc
import json
from pathlib import Path

import torch
from bench_engine import engine_for, greedy, llama_8b, models, served_and_step
from benchlib import Results, commands, gpu_ms, load_file
from copy_bandwidth import copy_bandwidth

from miniinfer.kernels.persistent import LM, OPS, QKV, PersistentDecode

PROMPT = list(range(100, 132))


def model_of(shape: str):
    return llama_8b() if shape == "llama8b" else models(shape)[1]


def one_step(engine, step) -> torch.Tensor:
    """The logits of the batch-1 graph's last step again, through step(graphs) on the same inputs."""
    g = engine.executor.runner.graphs
    out = step(g)
    torch.cuda.synchronize()
    return out.float().clone()


def compare_shape(shape: str, gbps: float, save) -> dict:
    """save(res) as each part ends: a run cut short keeps what it measured."""
    model = model_of(shape)
    weight_bytes = sum(p.numel() for p in model.parameters()) * 2
    res: dict = {"floor_tokens_per_s": gbps * 1e9 / weight_bytes, "floor_us": weight_bytes / gbps / 1e3,
                 "weight_bytes": weight_bytes}
    tokens, engine = {}, None
    for kernel in ("graphs", "persistent"):
        engine = None  # the last engine's pool goes before the next one sizes its own
        r = served_and_step(model, decode_kernel=kernel)
        r["fraction_of_floor"] = r["tokens_per_s"] / res["floor_tokens_per_s"]
        r["step_of_floor"] = res["floor_us"] / r["step_us"]
        engine = engine_for(model, max_num_seqs=8, decode_kernel=kernel)
        tokens[kernel] = [t for out in engine.stream(PROMPT, greedy(128)) for t in out.new_token_ids]
        res[kernel] = r
        save(res)
        print(f"{shape} {kernel}: {r['tokens_per_s']:.0f} tok/s ({100 * r['fraction_of_floor']:.0f}% of floor), "
              f"step {r['step_us']:.0f} us ({100 * r['step_of_floor']:.0f}%)", flush=True)
    # One step's logits both ways, on the inputs the persistent engine's graph holds now.
    cache = engine.executor.runner.cache
    persistent = PersistentDecode(model, cache.k, cache.v, cache.block_size)
    a = one_step(engine, lambda g: persistent.step(g.ids[:1], g.positions[:1], g.slots[:1], g.seq_lens[:1],
                                                   g.tables[:1])[0])
    b = one_step(engine, lambda g: (g._use(1), model(g.ids[None, :1], g.positions[None, :1], attn=cache)[0, 0])[1])
    res["logits"] = {"max_abs_diff": (a - b).abs().max().item(), "logit_std": b.std().item(),
                     "argmax_same": a.argmax().item() == b.argmax().item()}
    same = next((i for i, (x, y) in enumerate(zip(tokens["graphs"], tokens["persistent"])) if x != y), 128)
    res["greedy_tokens_equal_first"] = same
    print(f"{shape}: logits {res['logits']}, greedy tokens equal for the first {same} of 128", flush=True)
    return save(res)


def traced(persistent: PersistentDecode, args: tuple) -> dict:
    """One step with every task's start, end of wait and end (us from the first start), by program."""
    trace = torch.zeros(persistent.programs, persistent.width, 3, dtype=torch.int64, device="cuda")
    for _ in range(3):
        persistent.step(*args, trace=trace)
    torch.cuda.synchronize()
    ops, ns = persistent.tasks[..., 0].cpu(), trace.cpu()
    us = ((ns - ns[ns > 0].min()).clamp(min=0).double() / 1e3).tolist()
    return {"ops": OPS, "programs": [[[int(ops[p, i])] + [round(x, 2) for x in us[p][i]] for i in range(n)]
                                     for p, n in enumerate(persistent.counts.tolist())]}


def at_512(model):
    """A pool of its own, prefilled by the model with 511 tokens, and the step's arguments for the 512th."""
    from miniinfer.worker.paged_cache import PagedKVCache
    cache = PagedKVCache(model.cfg, 40, 16, device="cuda", dtype=model.dtype)
    table = list(range(40))
    with torch.no_grad():
        cache.run(model, [list(range(100, 611))], [table], [0])
    return cache, tuple(torch.tensor(v, dtype=torch.int32, device="cuda") for v in ([7], [511], [511], [512], table))


def spans(trace: dict, layer: int) -> dict:
    """Each op's span in a layer of a trace (first task's end of wait to last task's end) and its mean task
    time, in us: a program's layer is counted up each time it turns from another op to QKV."""
    first, last, ran = {}, {}, collections.defaultdict(list)
    for tasks in trace["programs"]:
        at, before = 0, -1
        for op, _, go, end in tasks:
            at += op == QKV and before != QKV
            before = op
            if at == layer + 1 and op != LM:
                first[op], last[op] = min(first.get(op, go), go), max(last.get(op, end), end)
                ran[op].append(end - go)
    return {OPS[op]: {"span_us": last[op] - first[op], "task_us": sum(r) / len(r)} for op, r in ran.items()}


def ab(out: str, before: str, *shapes: str) -> None:
    """This kernel (`after`) against the one in the file `before`, each shape's steps timed in turns (two
    rounds of each) on one pool at a context of 512, with the spans of a middle layer of each one's trace."""
    old = load_file(before)
    results = Results(out)
    for shape in shapes or ("llama", "qwen3"):
        model = model_of(shape)
        cache, args = at_512(model)
        steps = {"before": old.PersistentDecode(model, cache.k, cache.v, 16),
                 "after": PersistentDecode(model, cache.k, cache.v, 16)}
        res: dict = {"before": before, "context": 512, "step_us": {k: [] for k in steps}}
        for _ in range(2):
            for name, p in steps.items():
                res["step_us"][name].append(gpu_ms(lambda: p.step(*args), rep=200) * 1e3)
        a, b = (steps[k].step(*args).float().clone() for k in steps)
        res["logits_max_abs_diff"] = (a - b).abs().max().item()
        res["spans"] = {k: spans(traced(p, args), model.cfg.num_layers // 2) for k, p in steps.items()}
        print(shape, {k: [round(u) for u in v] for k, v in res["step_us"].items()}, flush=True)
        results.save(f"{shape}_ab", res)
        del steps, cache, model
        gc.collect()
        torch.cuda.empty_cache()


def sweep(out: str, shape: str = "llama") -> None:
    """The shape's persistent step at a context of 512 (a pool of its own, prefilled by the model): one
    step traced, then with the prefetch off, further ahead or into L1, other tiles, warps and attention splits."""
    model = model_of(shape)
    results = Results(out)
    cache, args = at_512(model)
    floor_us = results.data[shape]["floor_us"]
    res: dict = {"context": 512}
    try:  # the sweep is measured even if the traced variant fails to build
        res["trace"] = traced(PersistentDecode(model, cache.k, cache.v, 16), args)
    except Exception as err:  # noqa: BLE001
        res["trace_error"] = repr(err)
        print("trace:", repr(err), flush=True)
    results.save(f"{shape}_sweep", res)
    res["sweep"] = points = []
    for tile, warps, prefetch, splits, into in (
            (32768, 8, 1, None, "L2"), (32768, 8, 1, 1, "L2"), (32768, 8, 1, 4, "L2"), (32768, 8, 1, 32, "L2"),
            (32768, 8, 0, None, "L2"), (32768, 8, 2, None, "L2"), (32768, 8, 3, None, "L2"),
            (32768, 8, 1, None, "L1"), (32768, 8, 2, None, "L1"),
            (65536, 8, 1, None, "L2"), (16384, 8, 1, None, "L2"), (32768, 4, 1, None, "L2")):
        p = PersistentDecode(model, cache.k, cache.v, 16, tile=tile, num_warps=warps, splits=splits)
        p.config.update(PREFETCH=prefetch, INTO=into)
        us = gpu_ms(lambda: p.step(*args), rep=300) * 1e3
        points.append({"tile": tile, "warps": warps, "prefetch": prefetch, "into": into, "splits": p.shape.splits,
                       "step_us": us, "step_of_floor": floor_us / us})
        print(points[-1], flush=True)
        results.save(f"{shape}_sweep", res)


def compare(out: str, *shapes: str) -> None:
    gbps = copy_bandwidth()
    results = Results(out, copy_GBps=gbps)
    for shape in shapes or ("llama", "qwen3", "llama8b"):
        compare_shape(shape, gbps, results.saver(shape))
        gc.collect()  # the shape's engines hold cycles: their pools go before the next model is built
        torch.cuda.empty_cache()


COLORS = ("#3182bd", "#e6550d", "#9ecae1", "#31a354", "#a1d99b", "#756bb1")  # by op, in OPS' order


def plot(path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    res = json.loads(Path(path).read_text())
    shapes = [s for s in ("llama", "qwen3", "llama8b") if s in res]
    fig, (bars, lanes) = plt.subplots(1, 2, figsize=(13, 4), gridspec_kw={"width_ratios": [1, 2.6]})
    for k, (kernel, color) in enumerate((("graphs", "#bdbdbd"), ("persistent", "#3182bd"))):
        for j, what in enumerate(("fraction_of_floor", "step_of_floor")):
            x = [i * 3 + k + 0.4 * j for i in range(len(shapes))]
            bars.bar(x, [res[s][kernel][what] for s in shapes], width=0.4, color=color,
                     alpha=1.0 if j == 0 else 0.55, label=f"{kernel}, {'served' if j == 0 else 'step on the device'}")
    bars.set_xticks([i * 3 + 0.9 for i in range(len(shapes))], shapes)
    bars.set(ylabel="share of the weight-read floor", ylim=(0, 1), title=f"batch 1, {res['gpu']}")
    bars.legend(fontsize=7)
    for p, tasks in enumerate(res.get("llama_sweep", {}).get("trace", {}).get("programs", [])):
        for op, color in enumerate(COLORS):
            lanes.broken_barh([(b, e - b) for o, _, b, e in tasks if o == op], (p, 0.9), color=color, lw=0)
        lanes.broken_barh([(a, b - a) for _, a, b, _ in tasks if b - a > 0.5], (p, 0.9), color="#d9d9d9", lw=0)
    lanes.set(xlabel="us from the step's first task", ylabel="program (SM)",
              title="one persistent step of the Llama-3.2-1B shape, traced (grey: waiting on a counter)")
    lanes.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in (*COLORS, "#d9d9d9")],
                 labels=[*OPS, "waiting"], ncol=7, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    plt.tight_layout()
    plt.savefig(Path(path).with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    commands(compare=compare, sweep=sweep, plot=plot, ab=ab)
