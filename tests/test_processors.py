"""Chapter 12: penalties and filters per request, vectorized over a mixed batch, equal transformers'
logits processors and OpenAI's formulas; in the engine, greedy decoding with them equals
transformers' (or a plain loop's) under continuous batching; bad values are refused."""

import json
import random

import numpy as np
import pytest
import torch
from conftest import eos_is
from transformers.generation.logits_process import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

import miniinfer as mi
from miniinfer.course.parity import run_steps
from miniinfer.worker.sample.processors import min_p_mask, penalize


def random_history(gen, B, V):
    logits = torch.randn(B, V, generator=gen) * 3
    prompts = [torch.randint(0, V, (int(torch.randint(1, 20, (1,), generator=gen)),), generator=gen) for _ in range(B)]
    outputs = [torch.randint(0, V, (int(torch.randint(0, 30, (1,), generator=gen)),), generator=gen) for _ in range(B)]
    counts = torch.stack([torch.bincount(o, minlength=V) for o in outputs]).int()
    in_prompt = torch.zeros(B, V, dtype=torch.bool)
    for b, p in enumerate(prompts):
        in_prompt[b, p] = True
    return logits, prompts, outputs, counts, in_prompt


def test_penalties_equal_transformers_and_openai_row_by_row():
    """One batch, each row with its own penalties: repetition as transformers' processor (over
    prompt and output), presence and frequency as OpenAI documents them."""
    gen = torch.Generator().manual_seed(0)
    B, V = 9, 50
    logits, prompts, outputs, counts, in_prompt = random_history(gen, B, V)
    presence, frequency = torch.rand(B, generator=gen) * 4 - 2, torch.rand(B, generator=gen) * 4 - 2
    repetition = torch.rand(B, generator=gen) * 1.8 + 0.1
    presence[0], frequency[0], repetition[0] = 0.0, 0.0, 1.0  # a row without penalties is unchanged
    ours = penalize(logits, counts, in_prompt, presence, frequency, repetition)
    assert torch.equal(ours[0], logits[0])
    for b in range(B):
        history = torch.cat([prompts[b], outputs[b]])[None]
        theirs = RepetitionPenaltyLogitsProcessor(float(repetition[b]))(history, logits[b:b + 1].clone())[0]
        c = counts[b].float()
        theirs = theirs - c * frequency[b] - (c > 0).float() * presence[b]  # OpenAI's formula
        torch.testing.assert_close(ours[b], theirs)


def test_min_p_equals_transformers_at_each_rows_temperature():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(7, 40, generator=gen) * 4
    min_p, temperature = torch.rand(7, generator=gen), torch.rand(7, generator=gen) * 2 + 0.1
    ours = min_p_mask(logits, min_p, temperature)
    for b in range(7):
        theirs = MinPLogitsWarper(float(min_p[b]))(None, logits[b:b + 1] / temperature[b])[0]
        assert torch.equal(ours[b].isfinite(), theirs.isfinite())


def mixed_workload(seed: int = 0, vocab: int = 301, n: int = 10):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(2, 30))] for _ in range(n)]
    params = [mi.SamplingParams(temperature=0, max_tokens=rng.randint(4, 16), ignore_eos=True,
                                repetition_penalty=(1.0, 1.5, 0.7)[i % 3]) for i in range(n)]
    return prompts, params


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_repetition_penalty_in_a_mixed_batch_equals_transformers(hf_checkpoint, mode):
    """Requests with and without penalties in one continuous batch, 4 at a time, in a pool small
    enough that requests are preempted: a row's counts are rebuilt when its request comes back."""
    kind, folder, hf = hf_checkpoint
    prompts, params = mixed_workload()
    engine = mi.LLMEngine(mi.EngineConfig(model=folder, block_size=4, num_blocks=14, max_num_seqs=4,
                                          preemption_mode=mode))
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    final, preempted = run_steps(engine)
    assert preempted > 0
    for rid, p, sp in zip(ids, prompts, params):
        theirs = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=sp.max_tokens, min_new_tokens=sp.max_tokens, do_sample=False,
                             repetition_penalty=sp.repetition_penalty)[0, len(p):].tolist()
        assert final[rid].token_ids == theirs, (rid, sp.repetition_penalty)
    assert engine.block_manager.num_free_blocks == 14


def penalized_greedy(model, prompt, params):
    """The oracle for OpenAI's penalties: a whole forward per token, the formula applied by hand."""
    tokens, out = list(prompt), []
    for _ in range(params.max_tokens):
        logits = model(torch.tensor([tokens]))[0, -1]
        c = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).float()
        logits = logits - c * params.frequency_penalty - (c > 0).float() * params.presence_penalty
        out.append(int(logits.argmax()))
        tokens.append(out[-1])
    return out


def test_presence_and_frequency_penalties_in_the_engine(course_model):
    prompt = mi.load_tokenizer()("def add(a, b):\n    return a + b\n\n\ndef").input_ids
    params = [mi.SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, presence_penalty=pp,
                                frequency_penalty=fp) for pp, fp in ((0.0, 0.0), (1.5, 0.0), (0.0, 2.0), (-1.0, 0.5))]
    engine = mi.LLMEngine(mi.EngineConfig(num_blocks=64), model=course_model)
    outs = engine.generate([prompt] * len(params), params, use_tqdm=False)
    with torch.no_grad():
        expected = [penalized_greedy(course_model, prompt, sp) for sp in params]
    assert [o.token_ids for o in outs] == expected
    assert len({tuple(e) for e in expected}) == len(expected)  # each penalty changed the tokens


def test_logit_bias_min_tokens_and_stop_token_ids(course_model):
    engine = mi.LLMEngine(mi.EngineConfig(num_blocks=64), model=course_model)
    prompt = [5, 6, 7, 8]
    plain = engine.generate([prompt], mi.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)[0].token_ids
    forced = mi.SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True, logit_bias={42: 100})
    banned = mi.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={plain[0]: -100})
    stop_at = mi.SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[plain[3]])
    outs = engine.generate([prompt] * 3, [forced, banned, stop_at], use_tqdm=False)
    assert outs[0].token_ids == [42] * 6
    assert outs[1].token_ids[0] != plain[0]
    stop = plain.index(plain[3])  # its first time
    assert outs[2].token_ids == plain[:stop + 1] and outs[2].finish_reason == "stop"
    with eos_is(course_model, plain[1], engine):  # the model "ends" at its second token...
        early = mi.SamplingParams(temperature=0, max_tokens=8)
        late = mi.SamplingParams(temperature=0, max_tokens=8, min_tokens=5)
        a, b = engine.generate([prompt] * 2, [early, late], use_tqdm=False)
    assert a.token_ids == plain[:2] and a.finish_reason == "stop"
    assert len(b.token_ids) >= 5 and plain[1] not in b.token_ids[:5]  # ...but not before min_tokens
    assert engine.block_manager.num_free_blocks == 64


@pytest.mark.parametrize("kwargs, match", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(min_p=1.5), "min_p"),
    (dict(min_tokens=17), "min_tokens"), (dict(logit_bias={3: 101}), "logit_bias"),
    (dict(logit_bias={"3": 1.0}), "logit_bias"), (dict(stop_token_ids=[1, -2]), "stop_token_ids"),
])
def test_bad_values_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mi.SamplingParams(max_tokens=16, **kwargs)


def test_the_engine_refuses_token_ids_outside_the_vocabulary_and_the_plain_paths_refuse_penalties(course_model):
    engine = mi.LLMEngine(mi.EngineConfig(num_blocks=16), model=course_model)
    for params in (mi.SamplingParams(logit_bias={4096: 1.0}), mi.SamplingParams(stop_token_ids=[99999])):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.add_request([1, 2], params)
    assert not engine.requests
    for generate in (mi.generate_naive, mi.generate_cached):
        with pytest.raises(ValueError, match="presence_penalty: only the engine"):
            generate(course_model, [1, 2], mi.SamplingParams(presence_penalty=1.0))


def assert_theirs(lp, row: torch.Tensor, token: int, n: int) -> None:
    """A reported TokenLogprobs against a row of transformers' log-softmax: the token, its
    log-probability and rank, and the top n with their values."""
    assert lp.token == token and abs(lp.logprob - row[token].item()) < 1e-4
    assert lp.rank == int((row > row[token]).sum()) + 1
    top = row.topk(n)
    assert [t for t, _ in lp.top] == top.indices.tolist()
    assert all(abs(v - w) < 1e-4 for (_, v), w in zip(lp.top, top.values.tolist()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_scoring_kernel_equals_top_logprobs(dtype):
    """The one-pass kernel (chapter 12's end) against top_logprobs, under the interpreter: ragged
    vocabularies over chunks of 1-128 (one column in the last chunk, k above a chunk's width, k = V),
    the token the most likely, the least and in between, rows of ties (bf16 rounds many logits to
    one value). Ties may come in another order: each reported id's log-probability must be its value."""
    from miniinfer.kernels.logprobs import fused_top_logprobs, packed_top_logprobs
    from miniinfer.worker.sample.logprobs import top_logprobs
    gen = torch.Generator().manual_seed(0)
    for R, V, block, k in [(5, 1000, 128, 5), (3, 129, 64, 1), (2, 97, 32, 20), (1, 5, 4, 5), (2, 41, 1, 3)]:
        x = (torch.randn(R, V, generator=gen) * 3).to(dtype)
        x[-1, : V // 2] = x[-1, 0]  # half a row one value
        tokens = torch.randint(0, V, (R,), generator=gen)
        tokens[0], tokens[-1] = x[0].float().argmax(), x[-1].float().argmin()
        own, rank, top, ids = fused_top_logprobs(x, tokens, k, block=block)
        want_own, want_rank, want_top, _ = top_logprobs(x, tokens, k)
        logprobs = x.float().log_softmax(-1)
        assert torch.allclose(own, want_own, atol=1e-5) and torch.equal(rank, want_rank), (R, V, block, k)
        assert torch.allclose(top, want_top, atol=1e-5) and ids.max() < V, (R, V, block, k)
        assert torch.allclose(logprobs.gather(1, ids), want_top, atol=1e-5), (R, V, block, k)
        assert all(len(set(r)) == k for r in ids.tolist()), (R, V, block, k)  # k distinct tokens
        n = torch.randint(0, k + 1, (R,), generator=gen).double()
        packed = packed_top_logprobs(x, tokens, k, n, block=block)  # as the processors send it
        assert torch.equal(packed[:, :2], torch.stack([n, tokens.double()], 1)), (R, V, block, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_mask_kernel_equals_apply_bitmask(dtype):
    """Chapter 12's one-pass mask (under the interpreter) against apply_bitmask on the held rows:
    vocabularies that end inside a word and inside a chunk, chunks of 1-128, masks narrower than the
    vocabulary (the padding past them never allowed), rows with no grammar left as they were, bit 31."""
    from miniinfer.kernels.bitmask import masked_logits
    from miniinfer.worker.structured_output import apply_bitmask
    gen = torch.Generator().manual_seed(0)
    for R, V, words, block in [(6, 1000, 32, 128), (3, 97, 3, 32), (4, 64, 2, 1), (1, 33, 2, 16), (2, 5, 1, 4)]:
        x = (torch.randn(R, V, generator=gen) * 3).to(dtype)
        mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (R, words), generator=gen, dtype=torch.int32)
        mask[0] = -1  # every token the grammar has
        index = torch.randperm(R, generator=gen)
        index[::2] = -1
        held = index >= 0
        want = x.clone()
        padded = torch.nn.functional.pad(mask, (0, -(-V // 32) - words))
        want[held] = apply_bitmask(x[held], padded[index[held]])
        got = masked_logits(x, mask, index, block=block)
        assert torch.equal(got, want) and got.data_ptr() != x.data_ptr(), (R, V, words, block)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_penalties_kernel_equals_penalize(dtype):
    """Chapter 12's one-pass penalties (under the interpreter) against penalize on the penalized rows:
    vocabularies that end inside a chunk, chunks of 1-128, penalized rows in any order among rows left
    as they were (only converted), negative and zero penalties, a strided batch (the logits' rows)."""
    from miniinfer.kernels.penalties import penalized_logits
    from miniinfer.worker.sample.processors import penalize
    gen = torch.Generator().manual_seed(0)
    for B, V, N, block in [(6, 1000, 9, 128), (3, 97, 3, 32), (4, 64, 4, 1), (1, 33, 2, 16), (2, 5, 5, 4)]:
        x = (torch.randn(B, V + 3, generator=gen) * 3).to(dtype)[:, :V]
        counts = torch.randint(0, 4, (N, V), generator=gen, dtype=torch.int32)
        counts *= torch.rand(N, V, generator=gen) < 0.3
        in_prompt = torch.rand(N, V, generator=gen) < 0.2
        at = torch.randperm(B, generator=gen)[:max(1, B - 1)]
        rows = torch.randperm(N, generator=gen)[:len(at)]
        presence, frequency = torch.randn(2, len(at), generator=gen)
        repetition = torch.rand(len(at), generator=gen) * 2
        want = x.float().index_copy(0, at, penalize(x[at].float(), counts[rows], in_prompt[rows], presence, frequency,
                                                    repetition))
        got = penalized_logits(x, at, rows, counts, in_prompt, presence, frequency, repetition, block=block)
        assert got.dtype == torch.float32 and torch.equal(got, want), (B, V, N, block)


def test_scores_of_more_rows_than_a_piece_are_packed_in_order():
    """Scores.score takes SCORE_ROWS rows at a time (a long prompt's): 600 rows come back in their
    order, each as TokenLogprobs.of reads it, headed by its own head."""
    from types import SimpleNamespace

    from miniinfer.core.sequence import TokenLogprobs
    from miniinfer.worker.sample.logprobs import SCORE_ROWS, Logprobs, top_logprobs
    gen = torch.Generator().manual_seed(0)
    R, V = 2 * SCORE_ROWS + 88, 50
    logits, tokens = torch.randn(R, V, generator=gen), torch.randint(0, V, (R,), generator=gen)
    n = np.random.default_rng(0).integers(0, 4, R)
    scores = Logprobs(SimpleNamespace(config=SimpleNamespace(max_num_seqs=4))).score(
        torch.arange(R)[:, None], logits, tokens, n)
    own, rank, top, ids = top_logprobs(logits, tokens, 3)
    for r in (0, SCORE_ROWS - 1, SCORE_ROWS, R - 1):
        head, *row = scores[r].tolist()
        got = TokenLogprobs.of(tuple(row))
        assert head == r and (got.token, got.rank) == (tokens[r], rank[r]) and abs(got.logprob - own[r]) < 1e-6
        assert [t for t, _ in got.top] == ids[r, :n[r]].tolist()


def test_logprobs_equal_the_log_softmax_of_transformers_logits(hf_checkpoint):
    """Greedy and sampled requests, some with logprobs (n = 0, 1, 5) and some without, in one batch:
    each reported token's log-probability, rank and top n are those of transformers' logits."""
    kind, folder, hf = hf_checkpoint
    rng = random.Random(1)
    prompts = [[rng.randrange(301) for _ in range(rng.randint(2, 20))] for _ in range(6)]
    params = [mi.SamplingParams(temperature=(0, 0.9)[i % 2], seed=i, max_tokens=6, ignore_eos=True,
                                logprobs=(None, 0, 1, 5)[i % 4], repetition_penalty=(1.0, 1.3)[i % 2])
              for i in range(6)]
    engine = mi.LLMEngine(mi.EngineConfig(model=folder, num_blocks=64, max_num_seqs=4))
    outs = engine.generate(prompts, params, use_tqdm=False)
    for p, sp, out in zip(prompts, params, outs):
        if sp.logprobs is None:
            assert out.logprobs is None
            continue
        assert [lp.token for lp in out.logprobs] == out.token_ids
        with torch.no_grad():
            theirs = hf(torch.tensor([p + out.token_ids])).logits[0, len(p) - 1:-1].log_softmax(-1)
        for lp, row, token in zip(out.logprobs, theirs, out.token_ids):
            assert_theirs(lp, row, token, sp.logprobs)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_logprobs_out_of_range_and_on_the_plain_paths_are_refused(course_model, field):
    for bad in (-1, 21):
        with pytest.raises(ValueError, match=field):
            mi.SamplingParams(**{field: bad})
    with pytest.raises(ValueError, match=f"{field}: only the engine"):
        mi.generate_naive(course_model, [1, 2], mi.SamplingParams(**{field: 0}))


@pytest.mark.parametrize("field", ["presence_penalty", "min_p"])
def test_processors_that_change_the_logits_are_refused_with_speculation(course_model, field):
    engine = mi.LLMEngine(mi.EngineConfig(num_blocks=64, speculative_method="ngram"), model=course_model)
    rid = engine.add_request([1, 2, 3], mi.SamplingParams(max_tokens=4, **{field: 0.5}))
    failed = [o for o in engine.step() if o.request_id == rid]
    assert failed and failed[0].finish_reason == "error"
    assert f"{field}: not served with speculative decoding" in failed[0].error
    assert engine.block_manager.num_free_blocks == 64


def test_prompt_logprobs_equal_transformers_under_chunking_prefix_caching_and_preemption(hf_checkpoint):
    """Prompts sharing a prefix, some asking for prompt log-probabilities (n = 0, 3) and some not,
    prefilled in chunks of a small budget, in a pool small enough to preempt (recompute): every prompt
    token's log-probability, rank and top n are those of transformers' logits, each reported once by
    position; an asking request skips the prefix cache, the others still use it."""
    kind, folder, hf = hf_checkpoint
    rng = random.Random(2)
    shared = [rng.randrange(301) for _ in range(12)]
    prompts = [shared + [rng.randrange(301) for _ in range(rng.randint(1, 14))] for _ in range(8)]
    params = [mi.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=(None, 0, 3)[i % 3],
                                logprobs=(None, 2)[i % 2]) for i in range(8)]
    engine = mi.LLMEngine(mi.EngineConfig(model=folder, block_size=4, num_blocks=20, max_num_seqs=4,
                                          enable_prefix_caching=True, enable_chunked_prefill=True,
                                          max_num_batched_tokens=10))
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    final, preempted = run_steps(engine)
    assert preempted > 0
    for rid, p, sp in zip(ids, prompts, params):
        out = final[rid]
        if sp.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == len(p) and out.prompt_logprobs[0] is None
        with torch.no_grad():
            theirs = hf(torch.tensor([p])).logits[0, :-1].log_softmax(-1)
        for lp, row, token in zip(out.prompt_logprobs[1:], theirs, p[1:]):
            assert_theirs(lp, row, token, sp.prompt_logprobs)
        assert out.token_ids == hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                            max_new_tokens=10, min_new_tokens=10, do_sample=False)[0, len(p):].tolist()
    assert any(final[rid].num_cached_tokens for rid, sp in zip(ids, params) if sp.prompt_logprobs is None)
    assert engine.block_manager.num_free_blocks == 20


def test_structured_output_always_parses_and_validates_beside_free_requests(course_model):
    """Every schema, greedy and sampled, in one continuous batch with unconstrained requests, in a pool
    small enough to preempt: every constrained output parses and validates, the free ones run as alone."""
    import jsonschema
    from schemas import SCHEMAS
    tok = mi.load_tokenizer()
    prompts, params = [], []
    for i, schema in enumerate(SCHEMAS):
        for t in (0, 1.0):
            prompts.append(["def config():\n    return", "# data\n", "x ="][i % 3])
            params.append(mi.SamplingParams(temperature=t, seed=i, max_tokens=100,
                                            structured_output=mi.StructuredOutput(json=json.dumps(schema))))
    free = [mi.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 6
    engine = mi.LLMEngine(mi.EngineConfig(block_size=4, num_blocks=40, max_num_seqs=16), model=course_model,
                          tokenizer=tok)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts + ["def add(a, b):"] * 6, params + free)]
    final, preempted = run_steps(engine)
    outs = [final[rid] for rid in ids]
    assert preempted > 0 and engine.block_manager.num_free_blocks == 40
    for i, out in enumerate(outs[:len(params)]):
        assert out.finish_reason == "stop", (SCHEMAS[i // 2], out.text)
        value = json.loads(tok.decode(out.token_ids[:-1]))  # without the end token the grammar ended on
        jsonschema.validate(value, SCHEMAS[i // 2])
    alone = engine.generate(["def add(a, b):"], free[:1], use_tqdm=False)[0].token_ids
    assert all(o.token_ids == alone for o in outs[len(params):])


def test_a_grammar_never_allows_the_ids_past_the_tokenizer(tmp_path):
    """A model whose vocabulary pads the tokenizer's (4,096 + 200 ids, as checkpoints round theirs up),
    its padding ids pushed up by a logit bias: a request held to a regex writes only the tokenizer's
    ids and matches it; xgrammar is told the tokenizer's ids only (grammar_vocab: about 40 times less
    host work a row than with the padding), the mask's padding words are zeros."""
    import re

    from miniinfer.course.parity import make_hf_model
    from miniinfer.worker.structured_output import grammar_vocab
    tok = mi.load_tokenizer()
    make_hf_model("llama", vocab_size=len(tok) + 200, eos_token_id=tok.eos_token_id).save_pretrained(tmp_path)
    engine = mi.LLMEngine(mi.EngineConfig(num_blocks=64), model=mi.load_model(tmp_path), tokenizer=tok)
    assert grammar_vocab(tok, engine.info.vocab_size) == len(tok) < engine.info.vocab_size
    padding = {i: 50.0 for i in range(len(tok), len(tok) + 200)}
    params = [mi.SamplingParams(temperature=t, seed=1, max_tokens=40, logit_bias=padding,
                                structured_output=mi.StructuredOutput(regex="[a-z ]{1,30}")) for t in (0, 1.0)]
    free = mi.SamplingParams(temperature=0, max_tokens=5, logit_bias=padding, ignore_eos=True)
    *held, unheld = engine.generate(["def f():"] * 3, params + [free], use_tqdm=False)
    for out in held:
        assert max(out.token_ids) < len(tok) and re.fullmatch("[a-z ]{1,30}", tok.decode(out.token_ids[:-1])), out
    assert min(unheld.token_ids) >= len(tok)  # the bias alone does pick them
    assert engine.block_manager.num_free_blocks == 64


def test_the_mask_filler_takes_threads_only_when_rows_cost_more_than_their_start():
    """xgrammar's threads cost about THREAD_US each a call: cheap rows (the course tokenizer's) fill on
    one, costly ones (a 128k vocabulary's) on about sqrt(rows * cost / THREAD_US), never past the cap;
    the cost is timed on one thread; masks filled on several threads are those filled on one."""
    import xgrammar as xgr

    from miniinfer.worker.structured_output import THREAD_US, MaskFiller, compile_structure, grammar_compiler
    filler = MaskFiller(most=8)
    assert filler.threads(128) == 1  # nothing measured yet
    filler.row_us = 0.3
    assert filler.threads(128) == filler.threads(1) == 1
    filler.row_us = 40.0
    assert filler.threads(128) == 8 and filler.threads(16) == round((16 * 40 / THREAD_US) ** 0.5) == 3
    assert MaskFiller(most=2).threads(1) == 1
    tok = mi.load_tokenizer()
    grammar = compile_structure(mi.StructuredOutput(json='{"type": "object"}'), grammar_compiler(tok, len(tok)))
    matchers = [xgr.GrammarMatcher(grammar) for _ in range(6)]
    for n, m in enumerate(matchers):  # each somewhere else in the grammar
        for t in tok.encode('{"a": 1' + ", " * (n % 2), add_special_tokens=False)[:n]:
            m.accept_token(t)
    masks = {}
    for most in (1, 3):
        bitmask = torch.zeros(6, -(-len(tok) // 32), dtype=torch.int32)
        filler = MaskFiller(most=most)
        filler(matchers, bitmask, list(range(6)))  # the first call: one thread, timed
        assert filler.row_us > 0
        filler.row_us = 1e6  # as many threads as allowed from now
        bitmask.zero_()
        filler(matchers, bitmask, list(range(6)))
        assert (filler.row_us == 1e6) == (most > 1)  # a call on several threads does not retime a row
        masks[most] = bitmask
    assert torch.equal(masks[1], masks[3]) and len({tuple(r.tolist()) for r in masks[1]}) > 1


def test_regex_and_choice_outputs_match_and_bad_grammars_are_refused(course_model):
    import re
    tok = mi.load_tokenizer()
    engine = mi.LLMEngine(mi.EngineConfig(num_blocks=64), model=course_model, tokenizer=tok)
    S = mi.StructuredOutput
    cases = [(S(regex=r"[0-9]{3}-[0-9]{4}"), lambda s: re.fullmatch(r"[0-9]{3}-[0-9]{4}", s)),
             (S(choice=("yes", "no", 'say "hi"\n', "héllo")), lambda s: s in ("yes", "no", 'say "hi"\n', "héllo")),
             (S(json_object=True), lambda s: isinstance(json.loads(s), dict))]
    for t in (0, 1.0):
        params = [mi.SamplingParams(temperature=t, seed=3, max_tokens=60, structured_output=s) for s, _ in cases]
        for (_, ok), out in zip(cases, engine.generate(["def f():"] * len(cases), params, use_tqdm=False)):
            assert out.finish_reason == "stop" and ok(tok.decode(out.token_ids[:-1])), out.text
    for bad, match in [(S(json='{"type": "nope"}'), "Unsupported type"), (S(json="{not json"), "does not compile"),
                       (S(regex="a(b"), "parenthesis")]:
        with pytest.raises(ValueError, match=match):
            engine.add_request("x", mi.SamplingParams(structured_output=bad))
    deep = '{"type": "array", "items": ' * 64 + '{"type": "string", "pattern": "[[{{"}' + "}" * 64  # 65 levels
    for kwargs in (dict(), dict(json="{}", regex="a"), dict(choice=()), dict(choice=["a"]), dict(json=deep),
                   dict(regex="a" * 32769), dict(choice=("a" * 20000, "b" * 20000))):
        with pytest.raises(ValueError, match="structured_output"):
            S(**kwargs)
    with pytest.raises(ValueError, match="structured_output: only the engine"):
        mi.generate_naive(course_model, [1, 2], mi.SamplingParams(structured_output=S(json_object=True)))
    assert not engine.requests and engine.block_manager.num_free_blocks == 64


def test_degenerate_sampling_values_act_as_their_limit_and_a_grammar_always_holds(course_model):
    """Values that round away in float32 (top_p 1e-46, a temperature of 1e300 or 1e-300, a repetition
    penalty of 1e-300 or 1e300) sample as their limit would (greedy, or any allowed token), never a
    silent end-of-sequence from NaN logits; a grammar-held row never leaves its grammar whatever the
    values; a row left with no allowed token (the grammar must end, min_tokens forbids it) fails with
    the reason. The blocks all come back."""
    import re
    tok = mi.load_tokenizer()
    engine = mi.LLMEngine(mi.EngineConfig(num_blocks=64, block_size=8), model=course_model, tokenizer=tok)
    prompt = "def add(a, b):\n"
    greedy = engine.generate([prompt], mi.SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].token_ids
    assert mi.SamplingParams(temperature=1e-300).temperature == 0  # greedy, normalized where it enters
    for kwargs in (dict(top_p=1e-46), dict(top_p=1e-300), dict(temperature=1e-30)):
        out = engine.generate([prompt], mi.SamplingParams(max_tokens=8, seed=1, **kwargs), use_tqdm=False)[0]
        assert out.token_ids == greedy, kwargs
    eos = set(course_model.cfg.eos_token_ids)
    for kwargs in (dict(repetition_penalty=1e-300), dict(repetition_penalty=1e300), dict(temperature=1e300)):
        out = engine.generate([prompt], mi.SamplingParams(max_tokens=8, seed=1, **kwargs), use_tqdm=False)[0]
        assert out.finish_reason == "length" and not eos & set(out.token_ids), (kwargs, out.token_ids)
    digits = mi.StructuredOutput(regex="[0-9]+")
    for kwargs in (dict(temperature=1e300), dict(repetition_penalty=1e-300), dict(top_p=1e-46),
                   dict(repetition_penalty=1e300, presence_penalty=2)):
        params = [mi.SamplingParams(max_tokens=12, seed=s, structured_output=digits, **kwargs) for s in range(4)]
        for out in engine.generate([prompt] * 4, params, use_tqdm=False):
            text = tok.decode([t for t in out.token_ids if t not in eos])
            assert out.error is None and re.fullmatch("[0-9]+", text), (kwargs, out.token_ids)
    yes = mi.StructuredOutput(choice=("yes",))
    outs = engine.generate([prompt] * 2, [mi.SamplingParams(max_tokens=8, min_tokens=5, structured_output=yes),
                                          mi.SamplingParams(temperature=0, max_tokens=8)], use_tqdm=False)
    assert outs[0].finish_reason == "error" and "no token was allowed" in outs[0].error, outs[0]
    assert tok.decode(outs[0].token_ids) == "yes" and outs[1].token_ids == greedy  # the other row ran on
    assert not engine.requests and engine.block_manager.num_free_blocks == 64
