"""Chapter 11 on two GPUs: tensor parallelism's decode on an 8B-sized Llama (Llama-3.1-8B's shape, random
bf16 weights, written once to /dev/shm as a checkpoint, since each rank loads its own part), served with
tensor_parallel_size 1 and 2, the ranks' sums made in three ways (`EngineConfig.all_reduce`).

    python tools/bench_tp.py run OUT.json [LAYERS [SETTING ...]]   (default: all 32 layers, tp1 tp2 tp2_layers tp2_nccl)
    python tools/bench_tp.py plot OUT.json             (OUT.png: the times, and three steps of both ranks)
    python tools/bench_tp.py plot_rank docs/benchmarks/tp_rank_1gpu_h200.json   (one GPU: a rank's shape alone)

Per setting, in a process of its own (each loads the model and frees its GPUs when done):
    batch1    one request of 32 prompt tokens, 256 greedy tokens: the median time between tokens
    host      during batch1, the engine's time per step inside the executor's launch (the step's plain
              data pickled and written to each rank) and collect (waiting for the tokens), and the
              pickled step's bytes; the same for the workload's steps
    workload  the course's 256 requests (prompt and output lengths uniform in 100..1024), output tokens/s;
              its steps and seconds by phase (steps with prompt tokens, decode steps by rows), and a two-GPU
              setting's speed-up over tp1 in each (`tp2_speedup_by_phase`: where a ratio is won or lost)
    timeline  20 batch-1 decode steps under torch.profiler in the engine and in every rank: each
              process's host work (launch, collect) and each GPU's kernels on one clock; per step,
              the GPU's busy time and that of its all-reduces (and of the logits' all-gather)
    workload_timeline  the same for 10 steps of the workload, 150 steps in
Settings: tp1; tp2 (the default: the sums at the norms, by the one-shot's row kernel where it serves);
tp2_layers (the sums in the layers, by the one-shot where it serves, NCCL above: the default until 2026-11-28,
the runs before name it tp2); tp2_nccl (in the layers, NCCL alone); and rank (one GPU serving one of two ranks'
shape alone, no sums: `python tools/bench_tp.py run OUT.json 32 tp1 rank`).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# Another copy of the package (an earlier commit's, from d017ff0 on, to measure it against this one)
# comes first on PYTHONPATH: PYTHONPATH=/path/to/that/copy python tools/bench_tp.py ...
from bench_engine import LLAMA_3_1_8B, greedy, phases, run_engine, workload
from benchlib import commands, header
from copy_bandwidth import copy_bandwidth

import miniinfer as mi
from miniinfer.worker.components import build_components
from miniinfer.worker.model_runner import ModelRunner

FOLDER = Path("/dev/shm/miniinfer-llama8b")
SETTINGS = {"tp1": (1, "auto"), "tp2_nccl": (2, "nccl"), "tp2": (2, "auto"), "tp2_layers": (2, "one_shot"),
            "rank": (1, "auto")}
# `rank` (one GPU, not in the default run): a model of one of two ranks' shape, half the heads, channels and
# vocabulary rows, served alone: what a rank's step costs without its sums and its gather.
RANK = dict(num_attention_heads=16, num_key_value_heads=4, intermediate_size=7168, vocab_size=64128)
# The checkpoint's config.json: Llama-3.1-8B's shape (`bench_engine.LLAMA_3_1_8B`) as a Hugging Face config.
CHECKPOINT = dict(LLAMA_3_1_8B, torch_dtype="bfloat16", architectures=["LlamaForCausalLM"], model_type="llama",
                  hidden_act="silu", bos_token_id=None, eos_token_id=128001)


def checkpoint(name: str) -> tuple[Path, dict]:
    """The folder and config.json of a setting's model: the 8B shape, or one rank's (`rank`)."""
    if name == "rank":
        return FOLDER.with_name(FOLDER.name + "-rank"), dict(CHECKPOINT, **RANK)
    return FOLDER, CHECKPOINT


def write_checkpoint(layers: int, name: str = "tp1") -> None:
    """Random bf16 weights of the setting's shape (std 0.02, norms 1) in shards of four layers."""
    from safetensors.torch import save_file
    folder, c = checkpoint(name)
    config = folder / "config.json"
    if config.exists() and json.loads(config.read_text())["num_hidden_layers"] == layers:
        return
    folder.mkdir(exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    h, i, kv = c["hidden_size"], c["intermediate_size"], c["num_key_value_heads"] * c["head_dim"]
    q = c["num_attention_heads"] * c["head_dim"]

    def rand(*shape):
        return (torch.randn(shape, generator=gen, device="cuda") * 0.02).to(torch.bfloat16).cpu()

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)
    shards: list[dict] = [{"model.embed_tokens.weight": rand(c["vocab_size"], h)}]
    for n in range(layers):
        if n % 4 == 0:
            shards.append({})
        p = f"model.layers.{n}."
        shards[-1].update({p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
                           p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
                           p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
                           p + "mlp.down_proj.weight": rand(h, i), p + "input_layernorm.weight": ones(h),
                           p + "post_attention_layernorm.weight": ones(h)})
    shards.append({"model.norm.weight": ones(h), "lm_head.weight": rand(c["vocab_size"], h)})
    weight_map = {}
    for k, shard in enumerate(shards):
        file = f"model-{k:05d}.safetensors"
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config.write_text(json.dumps(dict(c, num_hidden_layers=layers)))


class TracedRunner(ModelRunner):
    """The runner, its launch and collect marked for the profiler, which `trace` starts and stops (sent
    to every rank by value, as a notebook's runner is)."""
    profiler: torch.profiler.profile | None = None

    def launch(self, out):
        with torch.profiler.record_function("launch"):
            return super().launch(out)

    def collect(self, launched):
        with torch.profiler.record_function("collect"):
            return super().collect(launched)

    def trace(self, path: str | None) -> None:
        """Start the profiler (path None), or stop it and write its Chrome trace to path."""
        if path is None:
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                               torch.profiler.ProfilerActivity.CUDA])
            self.profiler.__enter__()
        else:
            assert self.profiler is not None
            self.profiler.__exit__(None, None, None)
            self.profiler.export_chrome_trace(path.format(torch.cuda.current_device()))  # a rank's GPU is its rank


class HostMeter:
    """The engine-side seconds of each executor launch and collect, and each launched step's pickle."""

    def __init__(self, executor):
        self.launch_s: list[float] = []
        self.collect_s: list[float] = []
        self.outs: list = []
        launch, collect = executor.launch, executor.collect

        def timed_launch(out):
            t = time.perf_counter()
            with torch.profiler.record_function("executor.launch"):
                res = launch(out)
            self.launch_s.append(time.perf_counter() - t)
            self.outs.append(out)
            return res

        def timed_collect(launched):
            t = time.perf_counter()
            with torch.profiler.record_function("executor.collect"):
                res = collect(launched)
            self.collect_s.append(time.perf_counter() - t)
            return res
        executor.launch, executor.collect = timed_launch, timed_collect

    def summary(self) -> dict:
        sizes, pickle_s = [], []
        for out in self.outs[-200:]:
            t = time.perf_counter()
            sizes.append(len(pickle.dumps(("launch", (out,)))))
            pickle_s.append(time.perf_counter() - t)
        res = {"steps": len(self.launch_s), "launch_us": 1e6 * statistics.median(self.launch_s),
               "collect_us": 1e6 * statistics.median(self.collect_s), "step_bytes": statistics.median(sizes),
               "pickle_us": 1e6 * statistics.median(pickle_s)}
        self.launch_s, self.collect_s, self.outs = [], [], []
        return res


def ranks_trace(engine, path: str | None) -> None:
    if engine.config.tensor_parallel_size > 1:
        engine.executor._call("trace", None if path is None else f"{path}.rank{{}}")
    else:
        engine.executor.runner.trace(None if path is None else f"{path}.rank0")


def setting(name: str, out: str, tmp: str) -> None:
    """One setting's parts, in this process; its results to out."""
    tp, how = SETTINGS[name]
    how_kw = {"all_reduce": how} if "all_reduce" in mi.EngineConfig.__dataclass_fields__ else {}
    config = mi.EngineConfig(model=str(checkpoint(name)[0]), device="cuda", dtype=torch.bfloat16, max_model_len=2048,
                             tensor_parallel_size=tp, **how_kw)
    engine = mi.LLMEngine(config, components=dataclasses.replace(build_components(config), runner=TracedRunner))
    meter, res = HostMeter(engine.executor), {"setting": name, "tensor_parallel_size": tp, "all_reduce": how}
    prompt = list(range(100, 132))
    list(engine.stream(prompt, greedy(16)))  # warm-up
    meter.summary()
    times = [time.perf_counter() for _ in engine.stream(prompt, greedy(256))]
    res["batch1_itl_ms"] = 1e3 * statistics.median(b - a for a, b in zip(times, times[1:]))
    res["batch1_tokens_per_s"] = 1e3 / res["batch1_itl_ms"]
    res["host_batch1"] = meter.summary()
    print(f"{name}: batch 1 {res['batch1_itl_ms']:.2f} ms/token; host {res['host_batch1']}", flush=True)

    run = run_engine(engine, *workload(256))  # every block back: it checks
    res["workload"] = {**{k: run[k] for k in ("seconds", "output_tokens_per_s", "num_blocks", "steps")},
                       "phases": phases(run["trace"]), "host": meter.summary()}
    print(f"{name}: workload {res['workload']['output_tokens_per_s']:.0f} output tok/s", flush=True)
    Path(out).write_text(json.dumps(res))

    # The timelines: 20 decode steps of one request, then 10 steps of the workload once its first requests
    # are past their prompts, profiled in the engine and in every rank.
    for key, requests, warm, steps in (("timeline", ([prompt], [60]), 20, 20),
                                       ("workload_timeline", workload(256), 150, 10)):
        rids = [engine.add_request(p, greedy(o)) for p, o in zip(*requests)]
        for _ in range(warm):
            engine.step()
        ranks_trace(engine, None)
        if tp > 1:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(steps):
                    engine.step()
            prof.export_chrome_trace(f"{tmp}/{name}.engine")
        else:  # one profiler a process: the runner's sees the engine's side too
            for _ in range(steps):
                engine.step()
        ranks_trace(engine, f"{tmp}/{name}")
        for rid in rids:
            engine.abort(rid)
        while engine.has_unfinished_requests():
            engine.step()
        try:
            res[key] = timeline(f"{tmp}/{name}", tp)
        except Exception as err:  # noqa: BLE001 - the figures above stand without it
            res[key] = {"failed": f"{type(err).__name__}: {err}"}
    engine.close()
    Path(out).write_text(json.dumps(res))


KINDS = (("all-gather", ("AllGather",)),  # the LM head's logits, before "nccl" makes it an all-reduce
         ("all-reduce", ("one_shot", "nccl", "AllReduce", "allreduce")),
         ("attention", ("_decode_kernel", "_merge_kernel")),
         ("matmul", ("gemm", "gemv", "sm90", "cutlass", "splitK", "nvjet", "Kernel2")))


def kind(name: str) -> str:
    return next((k for k, keys in KINDS if any(key in name for key in keys)), "other")


def busy(events: list[tuple[float, float]]) -> float:
    """The time in which at least one of the (start, duration) events runs: kernels launched early
    (PDL) overlap the one before."""
    total, end = 0.0, float("-inf")
    for start, dur in sorted(events):
        total += max(0.0, start + dur - max(start, end))
        end = max(end, start + dur)
    return total


def timeline(prefix: str, tp: int) -> dict:
    """The traces of the engine and each rank on one clock: per decode step (rank 0's launches), each
    GPU's busy, all-reduce and all-gather time; and the events of three steps, for the figure."""
    lanes: dict[str, list] = {}
    engine = f"{prefix}.engine" if tp > 1 else f"{prefix}.rank0"
    for who, path in [("engine", engine)] + [(f"rank{r}", f"{prefix}.rank{r}") for r in range(tp)]:
        trace = json.loads(Path(path).read_text())
        base = trace.get("baseTimeNanoseconds", 0) / 1e3
        for e in trace["traceEvents"]:
            if e.get("ph") != "X" or "dur" not in e:
                continue
            cat, name = e.get("cat", ""), e.get("name", "")
            if cat == "kernel" and who != "engine":
                lanes.setdefault(f"{who} GPU", []).append((base + e["ts"], e["dur"], kind(name), name[:60]))
            elif cat == "user_annotation" and name in (("executor.launch", "executor.collect") if who == "engine"
                                                       else ("launch", "collect")):
                lanes.setdefault(f"{who} host", []).append((base + e["ts"], e["dur"], name, name))
    for events in lanes.values():
        events.sort()
    starts = [e[0] for e in lanes["rank0 host"] if e[2] == "launch"]
    steps = []
    for a, b in zip(starts, starts[1:]):
        step = {"ms": (b - a) / 1e3}
        for r in range(tp):
            ks = [e for e in lanes.get(f"rank{r} GPU", []) if a <= e[0] < b]
            step[f"rank{r}_busy_ms"] = busy([(e[0], e[1]) for e in ks]) / 1e3
            step[f"rank{r}_all_reduce_ms"] = sum(e[1] for e in ks if e[2] == "all-reduce") / 1e3
            step[f"rank{r}_all_reduces"] = sum(e[2] == "all-reduce" for e in ks)
            step[f"rank{r}_all_gather_ms"] = sum(e[1] for e in ks if e[2] == "all-gather") / 1e3
        steps.append(step)
    t0, t1 = starts[len(starts) // 2], starts[min(len(starts) - 1, len(starts) // 2 + 3)]
    shown = {lane: [(round((e[0] - t0) / 1e3, 4), round(e[1] / 1e3, 4), e[2]) for e in events if t0 <= e[0] < t1]
             for lane, events in lanes.items()}
    med = {k: statistics.median(s[k] for s in steps) for k in steps[0]}
    return {"median_step": med, "steps": len(steps), "events": shown,
            "kernel_names": sorted({e[3] for ev in lanes.values() for e in ev
                                    if e[2] in ("all-reduce", "all-gather", "other")})[:40]}


def run(out: str, layers: int, settings: list[str]) -> None:
    for name in settings:
        write_checkpoint(layers, name)
    res = {"what": __doc__.strip(), **header(), "layers": layers,
           "weight_bytes": sum(p.stat().st_size for p in FOLDER.glob("*.safetensors")), "settings": {}}
    res["copy_GBps"] = copy_bandwidth()
    gc.collect()
    torch.cuda.empty_cache()
    tmp = tempfile.mkdtemp()  # the traces: large, read here
    for name in settings:
        part = f"{tmp}/{name}.json"
        try:
            subprocess.run([sys.executable, __file__, "one", name, part, tmp], check=False)
        finally:  # cut short (SIGINT), still what the setting wrote before its profiles
            if Path(part).exists():
                res["settings"][name] = json.loads(Path(part).read_text())
            Path(out).write_text(json.dumps(res, indent=1))
    s = res["settings"]
    for two in [k for k in s if k.startswith("tp2") and "workload" in s[k] and "workload" in s.get("tp1", {})]:
        res[f"{two}_latency_of_tp1"] = s[two]["batch1_itl_ms"] / s["tp1"]["batch1_itl_ms"]
        res[f"{two}_throughput_of_tp1"] = (s[two]["workload"]["output_tokens_per_s"]
                                           / s["tp1"]["workload"]["output_tokens_per_s"])
        base, other = s["tp1"]["workload"]["phases"], s[two]["workload"]["phases"]
        if {k: v["steps"] for k, v in base.items()} == {k: v["steps"] for k, v in other.items()}:  # one schedule
            res[f"{two}_speedup_by_phase"] = {k: base[k]["seconds"] / other[k]["seconds"] for k in base}
    res["floor_itl_ms"] = {"tp1": 1e3 * res["weight_bytes"] / (res["copy_GBps"] * 1e9),
                           "tp2": 1e3 * res["weight_bytes"] / 2 / (res["copy_GBps"] * 1e9)}
    if "tp1" in s and "rank" in s:
        res["rank_latency_of_tp1"] = s["rank"]["batch1_itl_ms"] / s["tp1"]["batch1_itl_ms"]
    Path(out).write_text(json.dumps(res, indent=1))
    print({k: v for k, v in res.items() if k.startswith(("tp2_", "floor"))}, flush=True)


COLOURS = {"matmul": "#3182bd", "attention": "#31a354", "all-reduce": "#de2d26", "all-gather": "#fb6a4a",
           "other": "#969696",
           "launch": "#fd8d3c", "collect": "#fdd0a2", "executor.launch": "#fd8d3c", "executor.collect": "#fdd0a2"}


def plot(path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    res = json.loads(Path(path).read_text())
    s = res["settings"]
    names = {k: v for k, v in {"tp1": "one GPU", "tp2_nccl": "two, NCCL", "tp2": "two, sums\nat the norms",
                               "tp2_layers": "two, one-shot\nin the layers"}.items() if k in s}
    fig = plt.figure(figsize=(12, 6.5))
    lat, thr, lanes_ax = fig.add_subplot(2, 2, 1), fig.add_subplot(2, 2, 2), fig.add_subplot(2, 1, 2)
    lat.bar(list(names.values()), [s[k]["batch1_itl_ms"] for k in names], color="#3182bd")
    for n, style in ((1, "-"), (2, "--")):
        lat.axhline(res["floor_itl_ms"][f"tp{n}"], color="0.3", ls=style, lw=1, label=f"floor, {n} GPU(s)")
    lat.axhline(0.6 * s["tp1"]["batch1_itl_ms"], color="#de2d26", lw=1, label="goal: 0.6x one GPU")
    lat.set(ylabel="ms per token", title="batch 1")
    thr.bar(list(names.values()), [s[k]["workload"]["output_tokens_per_s"] for k in names], color="#3182bd")
    goal = 1.7 * s["tp1"]["workload"]["output_tokens_per_s"]
    thr.axhline(goal, color="#de2d26", lw=1, label="goal: 1.7x")
    thr.set(ylabel="output tokens/s", title="256 requests", ylim=(0, 1.1 * goal))
    lat.legend(fontsize=7), thr.legend(fontsize=7)
    # one two-GPU setting's steps fit the figure: the one the chapter is after, the fastest at batch 1
    two = min((k for k in names if "events" in s[k].get("timeline", {})), key=lambda k: s[k]["batch1_itl_ms"])
    ev = s[two]["timeline"]["events"]
    lanes = ["engine host", "rank0 host", "rank0 GPU", "rank1 host", "rank1 GPU"]
    for y, lane in enumerate(reversed(lanes)):
        for start, dur, kind in ev[lane]:
            lanes_ax.broken_barh([(start, max(dur, 0.004))], (y - 0.35, 0.7), color=COLOURS[kind])
    lanes_ax.set_yticks(range(len(lanes)), list(reversed(lanes)))
    lanes_ax.set(xlabel="ms", title=f"three batch-1 steps on two GPUs, both ranks ({names[two]})".replace("\n", " "))
    fig.suptitle(f"an 8B-sized Llama ({res['layers']} layers) on {res['gpu']}s, commit {res.get('commit', '?')}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(Path(path).with_suffix(".png"), dpi=110)


def plot_rank(path: str) -> None:
    """tp_rank_1gpu_h200.json's picture: a batch-1 token on one GPU, a rank's shape alone on one GPU, two
    GPUs measured, against the 0.6x goal; and decode attention at 256 ragged contexts by splits."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    res = json.loads(Path(path).read_text())
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.6))
    inside, apart = res["norm_inside"], res["norm_apart"]
    bars = {"one GPU": [inside["tp1"][0]["batch1_itl_ms"], apart["tp1"]["batch1_itl_ms"]],
            "a rank alone": [inside["rank"][0]["batch1_itl_ms"], apart["rank"]["batch1_itl_ms"]]}
    for i, (label, color) in enumerate((("the norm inside the GEMV", "#9ecae1"), ("apart", "#3182bd"))):
        a.bar([j + (i - 0.5) * 0.38 for j in range(2)], [v[i] for v in bars.values()], 0.38, color=color, label=label)
        a.hlines(0.6 * bars["one GPU"][i], 0.6, 1.4, color=color, ls="--", lw=1)
    a.scatter([1], [res["tp2_measured_before"]["batch1_itl_ms"]], marker="x", color="#de2d26", zorder=3,
              label="two GPUs, measured (norm inside)")
    a.set_xticks(range(2), list(bars))
    a.set(ylabel="ms per token", title="batch 1, 8B shape (dashed: 0.6x one GPU)")
    a.legend(fontsize=7)
    for key, label in (("8_32", "8 KV heads (one GPU)"), ("4_16", "4 KV heads (a rank)")):
        row = res["attention"][f"{key}/ragged256"]
        splits = sorted(int(k[1:-3]) for k in row if k.startswith("s") and k.endswith("_us"))
        b.plot(splits, [row[f"s{n}_us"] for n in splits], "o-", label=label)
    b.set(xscale="log", xlabel="splits of each context", ylabel="us a step",
          title="decode attention, 256 ragged contexts")
    b.legend(fontsize=7)
    fig.suptitle(f"one {res['gpu']}, {res['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(Path(path).with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    every = ["tp1", "tp2", "tp2_layers", "tp2_nccl"]
    commands(plot=plot, plot_rank=plot_rank, one=setting,
             run=lambda out, layers="32", *settings: run(out, int(layers), list(settings) or every))
