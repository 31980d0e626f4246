"""Chapter 11's all-reduce on two GPUs: NCCL through torch.distributed, launched eagerly and replayed
from a CUDA graph, by message size (bf16, 8 KB to 1 GB), with the copy bandwidth of the same GPUs.

    python tools/bench_allreduce.py docs/benchmarks/allreduce_2gpu_h100.json

Per size: `eager_us` (calls back to back, as a model's layers make them, timed with CUDA events),
`graph_us` (the same calls captured in one graph and replayed; the decode path's case) and each one's
bus bandwidth (a ring moves 2 (n-1)/n of the message per GPU). `alpha_us` is the graph latency of
the smallest message: the fixed cost a decode step pays per all-reduce.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = [8 << 10, 16 << 10, 32 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30]
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


def _rank(rank: int, world: int, store: str, out: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
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
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dist.all_reduce(y)  # NCCL's first call on a stream must not be in the capture
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            for _ in range(CALLS):
                dist.all_reduce(y)
        graph_s = _timed(graph.replay)
        bus = 2 * (world - 1) / world * size
        rows.append({"bytes": size, "eager_us": eager_s * 1e6, "graph_us": graph_s * 1e6,
                     "eager_bus_GBps": bus / eager_s / 1e9, "graph_bus_GBps": bus / graph_s / 1e9})
        if rank == 0:
            print(f"{size:>11,} B: eager {eager_s * 1e6:8.1f} us, graph {graph_s * 1e6:8.1f} us, "
                  f"bus {bus / graph_s / 1e9:6.1f} GB/s", flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier()
    torch.cuda.synchronize()
    os._exit(0)  # destroy_process_group can wait forever on communicators its graphs captured


def main(path: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from copy_bandwidth import copy_bandwidth
    world = 2
    assert torch.cuda.device_count() >= world, "needs two GPUs"
    gbps = copy_bandwidth()
    with tempfile.TemporaryDirectory() as tmp:
        rows_file = os.path.join(tmp, "rows.json")
        mp.spawn(_rank, args=(world, os.path.join(tmp, "store"), rows_file), nprocs=world)
        rows = json.loads(Path(rows_file).read_text())
    res = {"what": __doc__.strip(), "gpu": torch.cuda.get_device_name(), "gpus": world,
           "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
           "date": datetime.date.today().isoformat(), "copy_GBps": gbps,
           "alpha_us": rows[0]["graph_us"], "alpha_eager_us": rows[0]["eager_us"],
           "bus_GBps_1GB": rows[-1]["graph_bus_GBps"], "sizes": rows}
    Path(path).write_text(json.dumps(res, indent=1) + "\n")
    print(f"alpha {res['alpha_us']:.1f} us in a graph ({res['alpha_eager_us']:.1f} eager), "
          f"{res['bus_GBps_1GB']:.0f} GB/s bus at 1 GB, copy {gbps:.0f} GB/s")


if __name__ == "__main__":
    main(sys.argv[1])
