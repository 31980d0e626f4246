"""Chapter 11's all-reduce on two GPUs: NCCL through torch.distributed, launched eagerly and replayed
from a CUDA graph, by message size (bf16, 8 KB to 1 GB), with the copy bandwidth of the same GPUs; and
the course's one-shot all-reduce (`miniinfer.kernels.allreduce`) at every size it serves, eagerly and in
a graph, checked against NCCL on random data, with PyTorch's own one-shot beside it where it runs.

    python tools/bench_allreduce.py run docs/benchmarks/allreduce_one_shot_2gpu_h200.json
    python tools/bench_allreduce.py plot docs/benchmarks/allreduce_one_shot_2gpu_h200.json   (its PNG)

Per size: `eager_us` (calls back to back, as a model's layers make them, timed with CUDA events),
`graph_us` (the same calls captured in one graph and replayed; the decode path's case) and each one's
bus bandwidth (a ring moves 2 (n-1)/n of the message per GPU). `alpha_us` is the graph latency of
the smallest message: the fixed cost a decode step pays per all-reduce. `one_shot_eager_us`,
`one_shot_graph_us`: the course's kernel; `one_shot_max_diff`: its largest difference from NCCL's sum
over 20 random messages in bf16, eagerly and replayed (`_float32`: in float32, where the sums must be
equal); `torch_one_shot_graph_us`: `torch.ops.symm_mem.one_shot_all_reduce` in a graph.

`row_gemv`: a step of one row's row-parallel projections of the 8B shape on two GPUs (o: 4096 x 2048 a
rank, down: 4096 x 7168), in a graph: chapter 06's GEMV alone (`gemv_us`, no sum: the floor) and the
GEMV then the one-shot (`gemv_one_shot_us`), launched early behind it: what a sum adds to a projection.
"""

from __future__ import annotations

import faulthandler
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from benchlib import commands, header

from miniinfer.kernels.allreduce import OneShotAllReduce  # noqa: E402
from miniinfer.kernels.gemv import gemv  # noqa: E402

SIZES = [8 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 4 << 20, 16 << 20,
         64 << 20, 256 << 20, 1 << 30]
CALLS = 20  # all-reduces per timing (a graph holds as many)


def _timed(fn, rounds: int = 7) -> float:
    """Median seconds per call of CALLS calls made by fn(), over rounds."""
    times = []
    for _ in range(rounds):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / CALLS)
    return sorted(times)[len(times) // 2]


def _graphed(fn):
    """fn's CALLS calls captured in one CUDA graph: its replay (the first call of NCCL on a stream made
    outside the capture)."""
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    return graph.replay


def _check_one_shot(one_shot: OneShotAllReduce, size: int, rank: int) -> float:
    """The largest difference between the one-shot's sum and NCCL's over 20 random messages, 10 summed
    eagerly and 10 by a graph's replays (new data in the same buffer each time)."""
    dtype = one_shot.dtype
    x = torch.empty(size // torch.finfo(dtype).bits * 8, device="cuda", dtype=dtype)
    one_shot(x.zero_())  # compiled for this dtype before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        one_shot(x)
    worst = 0.0
    gen = torch.Generator(device="cuda").manual_seed(1 + rank)
    for i in range(20):
        x.copy_(torch.randn(x.shape, device="cuda", generator=gen, dtype=dtype))
        want = x.clone()
        dist.all_reduce(want)
        graph.replay() if i % 2 else one_shot(x)
        worst = max(worst, (x.float() - want.float()).abs().max().item())
    return worst


def _rank(rank: int, world: int, store: str, out: str) -> None:
    faulthandler.dump_traceback_later(120, exit=True)  # a rank that hangs (a spinning kernel) says where
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    # one a dtype (each marks its buffer with its dtype's -0.0), serving past the crossover
    one_shot, one_shot_float32 = (OneShotAllReduce(dist.group.WORLD, torch.device("cuda", rank), dtype,
                                                   max_bytes=4 << 20) for dtype in (torch.bfloat16, torch.float32))
    rows = []
    for size in SIZES:
        x = torch.full((size // 2,), float(rank + 1), device="cuda", dtype=torch.bfloat16)
        y = x.clone()
        for _ in range(3):
            dist.all_reduce(y)
        y.copy_(x)
        dist.all_reduce(y)
        assert torch.all(y == world * (world + 1) / 2), "the all-reduce's sum is wrong"

        def eager():
            for _ in range(CALLS):
                dist.all_reduce(y)
        eager_s = _timed(eager)
        graph_s = _timed(_graphed(lambda: dist.all_reduce(y)))
        bus = 2 * (world - 1) / world * size
        row = {"bytes": size, "eager_us": eager_s * 1e6, "graph_us": graph_s * 1e6,
               "eager_bus_GBps": bus / eager_s / 1e9, "graph_bus_GBps": bus / graph_s / 1e9}
        if one_shot.serves(y):
            def one_shot_eager():
                for _ in range(CALLS):
                    one_shot(y)
            row["one_shot_eager_us"] = _timed(one_shot_eager) * 1e6
            row["one_shot_graph_us"] = _timed(_graphed(lambda: one_shot(y))) * 1e6
            row["one_shot_max_diff"] = _check_one_shot(one_shot, size, rank)
            row["one_shot_max_diff_float32"] = _check_one_shot(one_shot_float32, size, rank)
            row["torch_one_shot_graph_us"] = _torch_one_shot(size)
        rows.append(row)
        if rank == 0:
            print(f"{size:>11,} B: eager {eager_s * 1e6:8.1f} us, graph {graph_s * 1e6:8.1f} us, "
                  f"bus {bus / graph_s / 1e9:6.1f} GB/s; one-shot "
                  f"{row.get('one_shot_eager_us', 0):.1f} / {row.get('one_shot_graph_us', 0):.1f} us, "
                  f"diff {row.get('one_shot_max_diff')} / {row.get('one_shot_max_diff_float32')}, "
                  f"torch's {row.get('torch_one_shot_graph_us')}", flush=True)
    rows_gemv = [_row_gemv(one_shot, n, k, rank) for n, k in ((4096, 2048), (4096, 7168))]
    if rank == 0:
        Path(out).write_text(json.dumps({"sizes": rows, "row_gemv": rows_gemv}))
    dist.barrier()
    torch.cuda.synchronize()
    os._exit(0)  # destroy_process_group can wait forever on communicators its graphs captured


def _row_gemv(one_shot: OneShotAllReduce, n: int, k: int, rank: int) -> dict:
    """One row x [1, k] by this rank's weight [n, k] in graphs: the GEMV alone, and then the one-shot."""
    gen = torch.Generator(device="cuda").manual_seed(10 + rank)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    row = {"n": n, "k": k, "gemv_us": _timed(_graphed(lambda: gemv(x, weight))) * 1e6,
           "gemv_one_shot_us": _timed(_graphed(lambda: one_shot(gemv(x, weight)[0]))) * 1e6}
    if rank == 0:
        print(f"row GEMV {n} x {k}: alone {row['gemv_us']:.1f} us, + one-shot {row['gemv_one_shot_us']:.1f}",
              flush=True)
    return row


def _torch_one_shot(size: int) -> float | None:
    """us per call of PyTorch's one-shot all-reduce (its input in symmetric memory) in a graph, or None
    where this PyTorch lacks it or it fails."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
        x = symm_mem.empty(size // 2, dtype=torch.bfloat16, device="cuda").fill_(1)
        symm_mem.rendezvous(x, dist.group.WORLD.group_name)
        name = dist.group.WORLD.group_name
        replay = _graphed(lambda: torch.ops.symm_mem.one_shot_all_reduce(x, "sum", name))
        return _timed(replay) * 1e6
    except Exception as err:  # noqa: BLE001 - a peer's figure, not ours
        print(f"torch one_shot_all_reduce: {type(err).__name__}: {err}"[:300], flush=True)
        return None


def main(path: str) -> None:
    from copy_bandwidth import copy_bandwidth
    world = 2
    assert torch.cuda.device_count() >= world, "needs two GPUs"
    gbps = copy_bandwidth()
    with tempfile.TemporaryDirectory() as tmp:
        rows_file = os.path.join(tmp, "rows.json")
        mp.spawn(_rank, args=(world, os.path.join(tmp, "store"), rows_file), nprocs=world)
        rows, rows_gemv = json.loads(Path(rows_file).read_text()).values()
    res = {"what": __doc__.strip(), **header(gpus=world, nccl=".".join(map(str, torch.cuda.nccl.version()))),
           "copy_GBps": gbps,
           "alpha_us": rows[0]["graph_us"], "alpha_eager_us": rows[0]["eager_us"],
           "bus_GBps_1GB": rows[-1]["graph_bus_GBps"], "sizes": rows, "row_gemv": rows_gemv}
    Path(path).write_text(json.dumps(res, indent=1) + "\n")
    print(f"alpha {res['alpha_us']:.1f} us in a graph ({res['alpha_eager_us']:.1f} eager), "
          f"{res['bus_GBps_1GB']:.0f} GB/s bus at 1 GB, copy {gbps:.0f} GB/s")


def plot(path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    res = json.loads(Path(path).read_text())
    rows = res["sizes"]
    fig, ax = plt.subplots(figsize=(8, 4))
    for key, label, style in (("eager_us", "NCCL, eager", "o--"), ("graph_us", "NCCL, in a graph", "o-"),
                              ("one_shot_eager_us", "one-shot, eager", "s--"),
                              ("one_shot_graph_us", "one-shot, in a graph", "s-"),
                              ("torch_one_shot_graph_us", "PyTorch's one-shot, in a graph", "^:")):
        have = [r for r in rows if r.get(key) is not None]
        ax.plot([r["bytes"] for r in have], [r[key] for r in have], style, label=label)
    ax.set(xscale="log", yscale="log", xlabel="message bytes (bf16)", ylabel="us per all-reduce",
           title=f"all-reduce on two {res['gpu']}s, NCCL {res['nccl']}, torch {res['torch']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(Path(path).with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    commands(run=main, plot=plot)
