"""The checks of problem set 06 (continuous batching): each answer against the reference, on random inputs.

Hand-written module (chapter 06)."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from miniinfer.core.sampling_params import top_p_filter
from miniinfer.course.checks.harness import (
    as_tensor,
    blocks_back,
    check,
    check_tokens,
    device,
    engine_with,
    exercise,
    named,
    randint,
    random_block_size,
    show,
    your_answers,
)
from miniinfer.course.checks.speed import faster_of, speed_item, wall_seconds


def _admit_ref(prompt_lens, free_blocks, block_size, seats, budget):
    n = 0
    for length in prompt_lens:
        need = -(-length // block_size)
        if n == seats or length > budget or need > free_blocks:
            break
        free_blocks, budget, n = free_blocks - need, budget - length, n + 1
    return n


@exercise("06", 1, "admit")
def check_admit(fn: Callable) -> None:
    """fn(prompt_lens, free_blocks, block_size, seats, budget) -> how many waiting sequences, in
    queue order, are admitted (each: a seat, its prompt within the token budget, blocks for it)."""
    def inputs(gen, case):
        n = randint(gen, 0, 8)
        return ([randint(gen, 1, 60) for _ in range(n)], randint(gen, 0, 40), random_block_size(gen, case, 16),
                randint(gen, 0, 8), randint(gen, 1, 200))
    check("admit", as_tensor(fn), as_tensor(_admit_ref), inputs, cases=40)


def _schedule_decodes_ref(lens, free_blocks, block_size):
    queue, decode, preempted = list(range(len(lens))), [], []
    while queue:
        i = queue.pop(0)
        needs_block = lens[i] % block_size == 0
        while needs_block and free_blocks == 0:
            victim = queue.pop() if queue else i
            preempted.append(victim)
            free_blocks += -(-lens[victim] // block_size)
            if victim == i:
                break
        else:
            free_blocks -= needs_block
            decode.append(i)
    return decode, preempted


@exercise("06", 2, "schedule_decodes")
def check_schedule_decodes(fn: Callable) -> None:
    """fn(lens, free_blocks, block_size) -> (decoding indices, preempted indices in order): running
    sequences (most urgent first, lens[i] tokens each in the pool) each decode a token, preempting
    the least urgent one (recompute) whenever a needed block is not free."""
    def inputs(gen, case):
        bs = random_block_size(gen, case, 5)
        return [randint(gen, 1, 4 * bs) for _ in range(randint(gen, 0, 9))], randint(gen, 0, 3), bs
    check("schedule_decodes", as_tensor(fn), as_tensor(_schedule_decodes_ref), inputs, cases=60)


def _preempt_for_ref(head, head_blocks, running, running_blocks, free_blocks):
    n = 0
    while n < len(running) and head_blocks > free_blocks and tuple(head) < tuple(running[-1 - n]):
        free_blocks += running_blocks[-1 - n]
        n += 1
    return n


@exercise("06", 3, "preempt_for")
def check_preempt_for(fn: Callable) -> None:
    """fn(head, head_blocks, running, running_blocks, free_blocks) -> how many of the least urgent
    running sequences (keys (priority, arrival), most urgent first) the waiting head preempts."""
    def inputs(gen, case):
        n = randint(gen, 0, 7)
        keys = sorted((randint(gen, 0, 3), a) for a in torch.randperm(20, generator=gen)[:n + 1].tolist())
        head = keys.pop(randint(gen, 0, n))
        return (head, randint(gen, 1, 12), keys, [randint(gen, 1, 6) for _ in keys], randint(gen, 0, 6))
    check("preempt_for", as_tensor(fn), as_tensor(_preempt_for_ref), inputs, cases=60)


def _sample_rows_ref(logits, temperature, top_p, noise):
    scaled = logits / temperature.clamp(min=1e-5)[:, None]
    probs = top_p_filter(scaled, top_p[:, None]).softmax(-1)
    return torch.where(temperature > 0, (probs / noise).argmax(-1), logits.argmax(-1))


@exercise("06", 4, "sample_rows")
def check_sample_rows(fn: Callable) -> None:
    """fn(logits [B, V], temperature [B], top_p [B], noise [B, V]) -> tokens [B] int64: each row by
    its own parameters (temperature 0: argmax), top-p, then argmax(probs / noise)."""
    def inputs(gen, case):
        B, V = randint(gen, 1, 7), randint(gen, 2, 300)
        temperature = torch.rand(B, generator=gen) * 1.5
        temperature[torch.rand(B, generator=gen) < 0.3] = 0
        top_p = torch.rand(B, generator=gen) * 0.9 + 0.1
        top_p[torch.rand(B, generator=gen) < 0.3] = 1.0
        noise = -torch.rand(B, V, generator=gen).clamp(min=1e-7).log()
        return torch.randn(B, V, generator=gen) * 3, temperature, top_p, noise
    check("sample_rows", fn, _sample_rows_ref, inputs, cases=20)


def _varlen_ref(tokens, tables, num_cached, block_size):
    from miniinfer.worker.kv_cache import VarlenBatch
    b = VarlenBatch.build(tokens, tables, num_cached, block_size)
    return tuple(t.long() for t in (b.positions, b.slot_mapping, b.query_start_loc, b.seq_lens))


@exercise("06", 5, "varlen_metadata")
def check_varlen_metadata(fn: Callable) -> None:
    """fn(tokens, block_tables, num_cached, block_size) -> (positions [N], slot_mapping [N],
    query_start_loc [B+1], seq_lens [B]) as int64 tensors."""
    def inputs(gen, case):
        bs, B = random_block_size(gen, case, 5), randint(gen, 1, 6)
        cached = [randint(gen, 0, 12) for _ in range(B)]
        tokens = [[randint(gen, 0, 99) for _ in range(randint(gen, 1, 9))] for _ in range(B)]
        pool = torch.randperm(200, generator=gen).tolist()
        tables = [[pool.pop() for _ in range(-(-(c + len(t)) // bs))] for c, t in zip(cached, tokens)]
        return tokens, tables, cached, bs
    check("varlen_metadata", lambda *a: tuple(torch.as_tensor(x).long() for x in fn(*a)), _varlen_ref,
          inputs, cases=20)


PROMPTS = ["def add(a, b):\n", "class Stack:\n", "import os\n\n\ndef", "for i in range(10):\n"]


@exercise("06", 6, "YourRunner")
def check_engine_runner(runner: type) -> None:
    """The last part: the engine on runner (a ModelRunner whose batch metadata and sampler are the
    student's) serves four requests, two greedy and two sampled with seeds, in blocks of 3 with prompts
    in pieces of a 12-token budget: the package engine's tokens, and every block back."""
    __tracebackhide__ = True

    import miniinfer as mi
    model, tok = mi.load_model(), mi.load_tokenizer()
    config = mi.EngineConfig(num_blocks=96, block_size=3, max_num_seqs=4, max_num_batched_tokens=12,
                             enable_chunked_prefill=True)
    params = [mi.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              mi.SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=1, ignore_eos=True),
              mi.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              mi.SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12, seed=2, ignore_eos=True)]
    with your_answers("06"):
        engine = engine_with(config, model, tok, runner=runner)
        got = [o.token_ids for o in engine.generate(PROMPTS, params, use_tqdm=False)]
    show(tok, [tok(text).input_ids + g for text, g in zip(PROMPTS, got)])
    package = mi.LLMEngine(config, model=model, tokenizer=tok)
    hows = [("greedy" if p.temperature == 0 else f"temperature {p.temperature}, top_p {p.top_p}, seed {p.seed}")
            for p in params]
    check_tokens([named(PROMPTS, how)[i] for i, how in enumerate(hows)],
                 [o.token_ids for o in package.generate(PROMPTS, params, use_tqdm=False)], got)
    blocks_back(engine.block_manager, f"{len(PROMPTS)} requests in blocks of 3")
    print(f"passed: the package engine's tokens on {len(PROMPTS)} requests (2 greedy, 2 sampled), every block back")


@speed_item("06", 6, "YourRunner")
def speed_engine_runner(runner: Any):
    """The engine on runner against the same runner on the course's reference answers (the package's
    batch builder for varlen_metadata, the reference sampler for sample_rows), on one fixed workload:
    greedy requests (the four prompts in turn) of the course model in blocks of 16, 32 of 48 tokens on
    the GPU, 8 of 32 on a CPU."""

    import miniinfer as mi
    pieces: dict = getattr(runner.prepare, "__globals__", {})  # the notebook's, where the runner finds the answers
    reference = {"varlen_metadata": _varlen_ref, "sample_rows": _sample_rows_ref}
    if not all(name in pieces for name in reference):
        raise AssertionError("YourRunner must call varlen_metadata and sample_rows, as the given code does")
    requests, tokens = (32, 48) if torch.cuda.is_available() else (8, 32)
    model, tok = mi.load_model(device=device()), mi.load_tokenizer()
    config = mi.EngineConfig(num_blocks=256, block_size=16, max_num_seqs=requests)
    params = mi.SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    prompts = PROMPTS * (requests // len(PROMPTS))
    engines = [engine_with(config, model, tok, runner=runner) for _ in range(2)]

    def on_reference():
        yours = {name: pieces[name] for name in reference}
        pieces.update(reference)
        try:
            return engines[1].generate(prompts, params, use_tqdm=False)
        finally:
            pieces.update(yours)
    runs: list[Callable] = [functools.partial(engines[0].generate, prompts, params, use_tqdm=False), on_reference]
    with your_answers("06"):
        got, expected = ([o.token_ids for o in run()] for run in runs)  # a first round each: graphs, caches
        check_tokens(named(prompts, "greedy, the timed workload (a wrong answer is not timed)"), expected, got)
        yours, theirs = faster_of(runs[0], runs[1], wall_seconds, rounds=3)
    return theirs / yours, (f"{requests * tokens / yours:,.0f} against {requests * tokens / theirs:,.0f} output "
                            f"tokens/s, {requests} requests x {tokens} tokens")
