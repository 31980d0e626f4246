"""Where a server run at saturation loses time against the in-process engine: a timeline of one run
from timestamps in the client processes, the HTTP process and the engine process (Chapter 08, issue 23).

Hand-written tool. The server (`bench_serve.py`'s Llama-3.2-1B-shaped checkpoint and workload) and the
client processes run with `tools/serve_trace` on PYTHONPATH, which logs each request sent, each body
parsed, each command and step of the engine, each batch of outputs received.
    python tools/trace_serve.py docs/benchmarks/serve_trace_h200.json 3
"""

import asyncio
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench_engine import workload
from bench_serve import CLIENTS, checkpoint, start_server
from miniinfer.bench import run_bench


def read_traces(folder: Path) -> dict[str, list[tuple]]:
    events: dict[str, list[tuple]] = {k: [] for k in "ECRHQD"}
    for path in folder.glob("trace.*.txt"):
        for line in path.read_text().splitlines():
            kind, *fields = line.split()
            events[kind].append(tuple(fields))
    return events


def timeline(events: dict[str, list[tuple]], t0: float, t1: float) -> dict:
    """One run's figures, in seconds from the moment every client process starts sending."""
    def within(kind):
        return sorted(e for e in events[kind] if t0 <= float(e[0]) <= t1)

    steps = [(float(s), float(e), int(r), int(w)) for s, e, r, w, _ in within("E")]
    adds = [float(t) for t, c in within("C") if c == "AddRequest"]
    sent, parsed, done = ([float(e[0]) for e in within(k)] for k in "QHD")
    start = sent[0]
    gaps = [b[0] - a[1] for a, b in zip(steps, steps[1:])]
    return {
        "requests": len(sent),
        "sent_s": [sent[0] - start, sent[-1] - start],  # first and last request sent by a client
        "parsed_s": [parsed[0] - start, parsed[-1] - start],  # first and last body handed to Server.run
        "at_engine_s": [adds[0] - start, adds[-1] - start],  # first and last AddRequest taken by the engine
        "first_step_s": steps[0][0] - start, "last_step_end_s": steps[-1][1] - start,
        "last_stream_end_s": done[-1] - start,
        "steps": len(steps), "step_busy_s": sum(e - s for s, e, _, _ in steps),
        "idle_between_steps_s": sum(gaps), "max_running": max(r for _, _, r, _ in steps),
    }


def main(out_path: str, runs: int) -> None:
    out = Path(out_path)
    prompts, outs = workload()
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "python": sys.version.split()[0],
           "date": datetime.date.today().isoformat(), "client_processes": CLIENTS,
           "model": "Llama-3.2-1B shape, random bf16 weights, word-level tokenizer over 128,256 ids",
           "workload": {"requests": len(prompts), "output_tokens": sum(outs)}, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        folder, traces = Path(tmp) / "llama", Path(tmp) / "traces"
        traces.mkdir()
        checkpoint(folder)
        os.environ["MI_TRACE"] = str(traces)  # the server and the client processes inherit it
        os.environ["PYTHONPATH"] = f"{Path(__file__).parent / 'serve_trace'}:{os.environ.get('PYTHONPATH', '')}"
        proc = start_server(folder, 8000, out.with_suffix(".server.log"))
        url = "http://127.0.0.1:8000"
        try:
            asyncio.run(run_bench(url, list(zip(prompts[:8], [8] * 8)), progress=False, processes=CLIENTS))
            marks = []
            for _ in range(runs):
                t0 = time.time()
                r = asyncio.run(run_bench(url, list(zip(prompts, outs)), progress=False, processes=CLIENTS))
                marks.append((t0, time.time(), r["output_throughput"], r["duration_s"]))
                time.sleep(1)
        finally:
            proc.terminate()
            proc.wait(60)
        events = read_traces(traces)
    for t0, t1, throughput, duration in marks:
        res["runs"].append({"output_tokens_per_s": throughput, "duration_s": duration, **timeline(events, t0, t1)})
        print(res["runs"][-1], flush=True)
    out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
