"""Loaded by every Python process started with this folder on PYTHONPATH and MI_TRACE set (by
`tools/bench_serve.py saturation ... --trace`): appends timestamped events to MI_TRACE/trace.<pid>.txt, one line each.
  engine process:  E start end running waiting new_tokens  (one engine step)
                   C time command                           (a command taken between steps)
  HTTP process:    H time                                   (a request body handed to Server.run)
                   R time new_tokens steps                  (one batch of outputs received)
  client process:  Q time / D time                          (a request sent / its stream ended)"""
import os

if os.environ.get("MI_TRACE"):
    import threading
    import time

    import miniinfer.engine.async_engine as ae
    import miniinfer.engine.core_client as clients
    import miniinfer.serving.bench as bench
    import miniinfer.serving.server as server

    file, lock = open(os.path.join(os.environ["MI_TRACE"], f"trace.{os.getpid()}.txt"), "w", buffering=1), \
        threading.Lock()

    def log(line: str) -> None:  # from several threads of one process (the HTTP loop, the receiver)
        with lock:
            file.write(line)
    run_engine, receive, run, one_request = clients.run_engine, ae.AsyncLLMEngine._receive, server.Server.run, \
        bench.one_request

    def traced_run_engine(engine, next_command, emit):
        step = engine.step

        def traced_step():
            t = time.time()
            outputs = step()
            s = engine.scheduler
            log(f"E {t:.6f} {time.time():.6f} {len(s.running)} {len(s.waiting)} "
                      f"{sum(len(o.new_token_ids) for o in outputs)}\n")
            return outputs

        def traced_next_command(block):
            command = next_command(block)
            if command is not None:
                log(f"C {time.time():.6f} {type(command).__name__}\n")
            return command

        engine.step = traced_step
        return run_engine(engine, traced_next_command, emit)

    def traced_receive(self, outputs, stats):
        receive(self, outputs, stats)
        log(f"R {time.time():.6f} {stats.new_tokens if stats else 0} {stats.steps if stats else 0}\n")

    async def traced_run(self, raw, endpoint):
        log(f"H {time.time():.6f}\n")
        return await run(self, raw, endpoint)

    async def traced_one_request(*args, **kwargs):
        log(f"Q {time.time():.6f}\n")
        result = await one_request(*args, **kwargs)
        log(f"D {time.time():.6f}\n")
        return result

    clients.run_engine, ae.AsyncLLMEngine._receive = traced_run_engine, traced_receive  # where the clients call it
    server.Server.run, bench.one_request = traced_run, traced_one_request
