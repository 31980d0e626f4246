"""Chapter 03: slot mapping, gathering through block tables, the paged forward and generation."""

import pytest
import torch
from conftest import eos_is

import miniinfer as mi
from miniinfer.course.parity import hf_greedy

GREEDY = mi.SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
PROMPTS = [[5, 17, 200, 3, 99, 42, 7], [11], [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17], [77, 78]]


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_paged_equals_naive_and_transformers(hf_checkpoint, block_size):
    kind, folder, hf = hf_checkpoint
    model = mi.load_model(folder)
    bm = mi.BlockManager(200, block_size)
    paged = mi.generate_paged(model, PROMPTS, GREEDY, block_manager=bm)
    assert paged == [mi.generate_naive(model, p, GREEDY) for p in PROMPTS], kind
    assert paged[0] == hf_greedy(hf, PROMPTS[0])
    assert bm.num_free_blocks == 200  # nothing leaked


def test_course_model_paged_equals_naive_with_eos():
    model, tok = mi.load_model(), mi.load_tokenizer()
    prompts = [tok(t).input_ids for t in ["def fibonacci(n):", "import os\n", "class A:\n    def f(self"]]
    params = mi.SamplingParams(temperature=0, max_tokens=48)
    bm = mi.BlockManager(64, 8)
    assert mi.generate_paged(model, prompts, params, block_manager=bm) == \
        [mi.generate_naive(model, p, params) for p in prompts]
    assert bm.num_free_blocks == 64


def test_sequences_finish_at_different_times_and_free_early():
    model = mi.load_model()
    params = mi.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    full = mi.generate_paged(model, [[604, 656, 199], [278]], params)
    with eos_is(model, full[0][2]):
        outs = mi.generate_paged(model, [[604, 656, 199], [278]], mi.SamplingParams(temperature=0, max_tokens=12))
    eos = full[0][2]
    assert outs == [r[:r.index(eos) + 1] if eos in r else r for r in full]


def test_pool_too_small_is_refused_up_front_and_nothing_leaks():
    model = mi.load_model()
    bm = mi.BlockManager(5, 4)
    bm.allocate("other", 4)
    with pytest.raises(mi.OutOfBlocks, match="the batch can need 5 blocks, the pool has 4 free"):
        mi.generate_paged(model, [[1, 2, 3], [4]], mi.SamplingParams(max_tokens=7), block_manager=bm)
    assert bm.num_free_blocks == 4 and bm.block_table("other") == [0]


def test_an_error_mid_generation_frees_every_block(monkeypatch):
    model = mi.load_model()
    bm = mi.BlockManager(32, 4)
    calls = []

    def failing_forward(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return type(model).forward(model, *a, **k)
    monkeypatch.setattr(model, "forward", failing_forward)
    with pytest.raises(RuntimeError, match="boom"):
        mi.generate_paged(model, [[1, 2, 3], [4, 5]], mi.SamplingParams(max_tokens=10), block_manager=bm)
    assert bm.num_free_blocks == 32


def test_slot_mapping_and_gather():
    table = [7, 2, 5]
    assert mi.slot_mapping(table, 2, 5, 3).tolist() == [23, 6, 7, 8, 15]
    pool = torch.arange(8 * 3, dtype=torch.float).view(8, 3, 1, 1)
    got = mi.gather_kv(pool, torch.tensor([table]), 7)
    assert got.flatten().tolist() == [21, 22, 23, 6, 7, 8, 15]


def test_paged_attention_ref_matches_dense_attention():
    gen = torch.Generator().manual_seed(0)
    B, Hq, Hk, D, bs, nb = 3, 6, 2, 20, 5, 40
    k_cache, v_cache = torch.randn(nb, bs, Hk, D, generator=gen), torch.randn(nb, bs, Hk, D, generator=gen)
    lens = torch.tensor([1, 17, 9])
    tables = torch.randperm(nb, generator=gen)[:B * 4].view(B, 4)
    q = torch.randn(B, Hq, D, generator=gen)
    out = mi.paged_attention_ref(q, k_cache, v_cache, tables, lens, D ** -0.5)
    for b in range(B):
        n = int(lens[b])
        k = k_cache[tables[b]].flatten(0, 1)[:n][None]
        v = v_cache[tables[b]].flatten(0, 1)[:n][None]
        ref = mi.model.transformer.causal_attention(q[b][None, None], k, v, D ** -0.5, q_start=n - 1)[0, 0]
        torch.testing.assert_close(out[b], ref)


def test_copy_block_duplicates_every_layer():
    cfg = mi.load_model().cfg
    cache = mi.PagedKVCache(cfg, 4, 2)
    cache.k.normal_()
    cache.v.normal_()
    cache.copy_block(mi.BlockCopy(1, 3))
    assert torch.equal(cache.k[:, 3], cache.k[:, 1]) and torch.equal(cache.v[:, 3], cache.v[:, 1])


def test_utilization_at_block_size_16_is_at_least_95_percent():
    lengths = mi.benchmark_lengths()
    assert mi.paged_utilization(lengths, 16) >= 0.95
    assert mi.paged_utilization(lengths, 1) == 1.0
    assert mi.paged_utilization([(3, 2)], 4) == 5 / 8


def test_replay_snapshots():
    states = mi.replay(4, 2, [("allocate", "A", 3), ("fork", "A", "B"), ("append", "B"), ("free", "A")])
    assert [d for d, _ in states] == ["empty pool", "allocate A 3", "fork A B", "append B", "free A"]
    assert states[3][1].block_table("B") == [0, 2] and states[4][1].num_free_blocks == 2
