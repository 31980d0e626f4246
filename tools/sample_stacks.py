"""Run a Python program under a sampling profiler that watches all of its threads.

Hand-written tool. Used by `bench_serve.py --profile` to see where the server's HTTP process spends
its time (the engine's own process is not sampled: it is a fresh interpreter).
    python tools/sample_stacks.py OUT.json -m miniinfer serve --model ...

Every 5 ms a thread of its own records the innermost Python frame of every other thread ("self")
and each distinct function on its stack ("total"), by thread name. A thread blocked in C shows the
Python line that called it (a selector's `select`, a queue's `get`), and so does a thread busy in
C code that holds the interpreter's lock (uvloop's): the CPU seconds each thread used (Linux's
/proc, read every 0.5 s: `cpu_timeline`) tell waiting from working. The counts go to OUT.json when the program
ends, SIGTERM included.
"""

import atexit
import collections
import itertools
import json
import os
import re
import runpy
import signal
import sys
import threading
import time

INTERVAL = 0.005  # seconds; each round costs the sampled process some of its GIL time


def where(frame) -> str:
    path = re.sub(r".*/(site-packages|python3\.\d+)/", "", frame.f_code.co_filename)
    return f"{path}:{frame.f_code.co_name}"


def cpu_seconds() -> dict[str, float]:
    """User + system CPU seconds of each live thread, by name (empty where /proc is missing)."""
    res = {}
    for t in threading.enumerate():
        try:
            fields = open(f"/proc/self/task/{t.native_id}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        res[t.name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return res


def main(out: str, argv: list[str]) -> None:
    samples: collections.Counter = collections.Counter()
    inner = collections.defaultdict(collections.Counter)
    anywhere = collections.defaultdict(collections.Counter)
    stop = threading.Event()
    cpu: dict[str, float] = {}
    timeline: list[tuple[float, dict[str, float]]] = []  # (seconds, CPU seconds by thread) every 0.5 s

    def sample() -> None:
        me = threading.get_ident()
        for rounds in itertools.count():
            if stop.wait(INTERVAL):
                return
            if rounds % 100 == 0:  # a thread's CPU time as last seen alive: some end before the program
                cpu.update(cpu_seconds())
                timeline.append((round(time.perf_counter() - t0, 3), dict(cpu)))
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                name = names.get(ident, str(ident))
                samples[name] += 1
                inner[name][where(frame)] += 1
                seen = set()
                while frame is not None:
                    seen.add(where(frame))
                    frame = frame.f_back
                anywhere[name].update(seen)

    def dump() -> None:
        if stop.is_set():
            return
        stop.set()
        sampler.join()  # its last round done: the counters no longer change
        cpu.update(cpu_seconds())
        res = {name: {"samples": n, "cpu_s": cpu.get(name), "self": inner[name].most_common(30),
                      "total": anywhere[name].most_common(40)} for name, n in samples.most_common()}
        with open(out, "w") as f:
            json.dump({"interval_s": INTERVAL, "wall_s": time.perf_counter() - t0, "threads": res,
                       "cpu_timeline": timeline}, f)

    t0 = time.perf_counter()
    atexit.register(dump)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # uvicorn installs its own while serving
    sampler = threading.Thread(target=sample, daemon=True, name="sampler")
    sampler.start()
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
