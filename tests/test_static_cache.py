"""Chapter 02: the static KV cache, static batching, and the waste measurements."""

import pytest
import torch
from conftest import eos_is

import miniinfer as mi
from miniinfer.course.parity import hf_greedy

GREEDY = mi.SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
PROMPTS = [[5, 17, 200, 3, 99, 42, 7], [11], [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 13], [77, 78]]


def test_cached_equals_naive_and_transformers(hf_checkpoint):
    kind, folder, hf = hf_checkpoint
    model = mi.load_model(folder)
    for prompt in PROMPTS:
        cached = mi.generate_cached(model, prompt, GREEDY)
        assert cached == mi.generate_naive(model, prompt, GREEDY), kind
        assert cached == hf_greedy(hf, prompt), kind


def test_batched_equals_unbatched(hf_checkpoint):
    _, folder, _ = hf_checkpoint
    model = mi.load_model(folder)
    assert mi.generate_static_batch(model, PROMPTS, GREEDY) == \
        [mi.generate_cached(model, p, GREEDY) for p in PROMPTS]


def test_course_model_cached_batched_naive_agree():
    model, tok = mi.load_model(), mi.load_tokenizer()
    prompts = [tok(p).input_ids for p in ["def fibonacci(n):", "import os\n", "class Stack:\n    def"]]
    params = mi.SamplingParams(temperature=0, max_tokens=40)
    naive = [mi.generate_naive(model, p, params) for p in prompts]
    assert [mi.generate_cached(model, p, params) for p in prompts] == naive
    assert mi.generate_static_batch(model, prompts, params) == naive


def test_each_sequence_stops_at_its_own_eos():
    model = mi.load_model()
    prompts = [[604, 656, 199], [534, 889, 66, 271], [278]]
    full = mi.generate_static_batch(model, prompts, mi.SamplingParams(temperature=0, max_tokens=12,
                                                                      ignore_eos=True))
    with eos_is(model, full[0][3]):  # the first row ends at its fourth token
        outs = mi.generate_static_batch(model, prompts, mi.SamplingParams(temperature=0, max_tokens=12))
    eos = full[0][3]
    for out, ref in zip(outs, full):
        assert out == (ref[:ref.index(eos) + 1] if eos in ref else ref)
    assert len(outs[0]) == 4


def test_seeded_sampling_is_reproducible_and_matches_naive():
    model = mi.load_model()
    params = mi.SamplingParams(temperature=0.9, top_k=40, top_p=0.9, max_tokens=20, seed=3,
                               ignore_eos=True)
    prompt = [604, 656, 199]
    assert mi.generate_cached(model, prompt, params) == mi.generate_naive(model, prompt, params)


def test_prompt_longer_than_the_cache_fails_before_any_work(monkeypatch):
    model = mi.load_model()
    monkeypatch.setattr(model, "forward", lambda *a, **k: pytest.fail("the model ran"))
    monkeypatch.setattr(mi.course.static_cache, "StaticKVCache", lambda *a, **k: pytest.fail("allocated"))
    with pytest.raises(ValueError, match="exceeds the KV cache of 16 tokens"):
        mi.generate_cached(model, list(range(10)), mi.SamplingParams(max_tokens=7), cache_len=16)
    with pytest.raises(ValueError, match="the prompt is empty"):
        mi.generate_static_batch(model, [[1, 2], []], mi.SamplingParams())


def test_generator_is_reusable_and_checks_batch_size():
    model = mi.load_model()
    gen = mi.StaticBatchGenerator(model, batch=2, cache_len=64)
    params = mi.SamplingParams(temperature=0, max_tokens=10)
    a = gen.generate([[604, 656], [534]], params)
    gen.generate([[1, 2, 3, 4, 5, 6, 7, 8], [9]], params)  # leaves other K/V behind in the cache
    assert gen.generate([[604, 656], [534]], params) == a
    with pytest.raises(ValueError, match="batches of 2 prompts, got 1"):
        gen.generate([[1]], params)
    with pytest.raises(ValueError, match="exceeds the KV cache of 64 tokens"):
        gen.generate([[1] * 55, [2]], params)


def test_left_pad():
    ids, real, pos = mi.left_pad([[7, 8, 9], [5]], pad_id=0)
    assert ids.tolist() == [[7, 8, 9], [0, 0, 5]]
    assert real.tolist() == [[True, True, True], [False, False, True]]
    assert pos.tolist() == [[0, 1, 2], [0, 0, 0]]


def test_write_kv_writes_only_its_slots():
    kc, vc = torch.zeros(2, 6, 1, 3), torch.zeros(2, 6, 1, 3)
    k, v = torch.ones(2, 2, 1, 3), 2 * torch.ones(2, 2, 1, 3)
    mi.write_kv(kc, vc, k, v, 3)
    assert kc[:, 3:5].eq(1).all() and vc[:, 3:5].eq(2).all()
    assert kc[:, :3].eq(0).all() and kc[:, 5:].eq(0).all()


def test_cache_overflow_is_an_error():
    cache = mi.StaticKVCache(mi.load_model().cfg, 1, 4)
    cache.step(torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="the cache holds 4 tokens; 5 asked for"):
        cache.step(torch.ones(1, 2, dtype=torch.bool))


def test_waste_measurements():
    assert mi.static_batch_waste([10, 10], 2) == 0
    assert mi.static_batch_waste([10, 30], 2) == pytest.approx(1 - 40 / 60)
    assert mi.static_batch_waste([10, 30], 1) == 0
    lengths = [(100, 100), (300, 200)]
    assert mi.static_utilization(lengths, max_len=1000) == pytest.approx(700 / 2000)
    assert mi.static_utilization(lengths, batch_size=2) == pytest.approx(700 / (2 * 500))
    bench = mi.benchmark_lengths()
    assert len(bench) == 256 and all(100 <= p <= 1024 and 100 <= o <= 1024 for p, o in bench)
    assert bench == mi.benchmark_lengths()  # seeded
