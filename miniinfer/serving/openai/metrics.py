"""Hand-written, not from a notebook: the server's /metrics in Prometheus' text format (chapter 08 runs it).

Hand-written module (chapter 08)."""

from __future__ import annotations

from miniinfer.serving.openai.door import Counted


def metrics(server: Counted) -> str:
    """Prometheus text exposition of the engine's state and the server's counts."""
    engine, s, lines = server.engine, server.engine.stats, []
    for name, kind, value, help in [
        ("requests_running", "gauge", s.running, "Requests in the running batch."),
        ("requests_waiting", "gauge", s.waiting, "Requests waiting to be admitted."),
        ("requests_swapped", "gauge", s.swapped, "Preempted requests whose KV is in CPU memory."),
        ("kv_blocks_used", "gauge", s.blocks_used, "KV cache blocks in use."),
        ("kv_blocks_total", "gauge", s.blocks_total, "KV cache blocks in the pool."),
        ("prompt_tokens_total", "counter", server.prompt_tokens, "Prompt tokens of accepted requests."),
        ("generation_tokens_total", "counter", engine.generated_tokens, "Tokens generated."),
        ("generation_tokens_per_second", "gauge", round(engine.tokens_per_second(), 3),
         "Tokens generated per second over the last 10 s."),
        ("engine_steps_total", "counter", engine.totals["steps"], "Engine steps."),
        ("engine_step_seconds_total", "counter", round(engine.totals["step_seconds"], 6),
         "Seconds the engine spent in steps."),
        ("engine_wait_seconds_total", "counter", round(engine.totals["wait_seconds"], 6),
         "Seconds the engine's output thread waited to hand outputs to this server (it reads too slowly)."),
        ("spec_decode_proposed_tokens_total", "counter", s.spec_proposed, "Speculative guesses verified."),
        ("spec_decode_accepted_tokens_total", "counter", s.spec_accepted, "Speculative guesses kept."),
        ("spec_decode_verifying_steps_total", "counter", s.spec_verified,
         "Request-steps that verified guesses (each yields the kept ones and one token more)."),
    ]:
        lines += [f"# HELP miniinfer_{name} {help}", f"# TYPE miniinfer_{name} {kind}", f"miniinfer_{name} {value}"]
    return "\n".join(lines) + "\n"
