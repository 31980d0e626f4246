"""Chapter 05: the varlen batch, the attention backend and the Triton paged-attention kernels against
the PyTorch references (the interpreter on CPU; `tools/bench_attention.py check` runs the same
cases on a GPU in bf16: miniinfer.course.parity holds them)."""

import functools
import random

import pytest
import torch

import miniinfer as mi
from miniinfer.course.parity import decode_errors, hf_greedy, prefill_errors, random_paged

# Relative error (Frobenius norm) allowed against the reference, by dtype. float32 products run in
# full precision; 16-bit kernels round the softmax weights before p.V, as the reference does.
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_kernel_matches_reference(dtype):
    errs = decode_errors(dtype=dtype)
    assert max(errs) < TOL[dtype], errs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_kernel_matches_reference(dtype):
    errs = prefill_errors(dtype=dtype)
    assert max(errs) < TOL[dtype], errs


def test_decode_kernel_equals_prefill_kernel_on_one_token():
    """A decode is a prefill of one token: both kernels (and both references) agree on it."""
    rng = random.Random(5)
    (k_cache, v_cache), tables, gen = random_paged(rng, [70, 1, 33], 2, 64, 3, "cpu", torch.float32)
    q = torch.randn(3, 8, 64, generator=gen)
    ctx = torch.tensor([70, 1, 33], dtype=torch.int32)
    decode = mi.kernels.paged_attention(q, k_cache, v_cache, tables, ctx, 0.125)
    prefill = mi.kernels.prefill_attention(q, k_cache, v_cache, torch.arange(4, dtype=torch.int32), ctx, tables,
                                           0.125, 1)
    torch.testing.assert_close(decode, prefill)


def test_decode_config_fills_the_gpu_without_over_splitting():
    config = functools.partial(mi.kernels.decode_config, kv_heads=8, multiprocessors=132)
    assert config(batch=1, head_dim=64, max_len=32768) == dict(num_splits=66, tile=128, num_warps=4)
    assert config(batch=16, head_dim=128, max_len=2048) == dict(num_splits=4, tile=64, num_warps=4)
    assert config(batch=64, head_dim=64, max_len=2048) == dict(num_splits=1, tile=128, num_warps=4)
    assert config(batch=8, head_dim=128, max_len=2048) == dict(num_splits=8, tile=64, num_warps=4)
    assert config(batch=256, head_dim=64, max_len=32768)["num_splits"] == 1  # the batch fills the GPU
    assert config(batch=1, head_dim=64, max_len=100)["num_splits"] == 1  # no split shorter than 2 tiles
    assert config(batch=1, head_dim=20, max_len=5000)["tile"] == 128  # odd head dims: padded to 32 lanes
    assert all(config(batch=b, head_dim=64, max_len=n)["num_splits"] >= 1 for b in (1, 3, 64, 1000) for n in (1, 10**6))


def test_store_kv_writes_only_real_slots():
    k, v = torch.randn(5, 2, 20), torch.randn(5, 2, 20)
    slots = torch.tensor([7, -1, 0, 11, 3], dtype=torch.int32)
    for store in (mi.kernels.store_kv, mi.store_kv_ref):
        kc, vc = torch.full((4, 3, 2, 20), 9.0), torch.full((4, 3, 2, 20), 9.0)
        store(k, v, kc, vc, slots)
        flat_k, flat_v = kc.flatten(0, 1), vc.flatten(0, 1)
        assert torch.equal(flat_k[[7, 0, 11, 3]], k[[0, 2, 3, 4]])
        assert torch.equal(flat_v[[7, 0, 11, 3]], v[[0, 2, 3, 4]])
        untouched = [s for s in range(12) if s not in (7, 0, 11, 3)]
        assert (flat_k[untouched] == 9).all() and (flat_v[untouched] == 9).all()


def test_varlen_batch_metadata():
    batch = mi.VarlenBatch.build([[901], [11, 12, 13, 14, 15], [21, 22, 23, 24]], [[7, 2, 9], [4, 0], [5, 8, 3]],
                                 [9, 0, 6], block_size=4)
    assert batch.input_ids.tolist() == [901, 11, 12, 13, 14, 15, 21, 22, 23, 24]
    assert batch.positions.tolist() == [9, 0, 1, 2, 3, 4, 6, 7, 8, 9]
    assert batch.slot_mapping.tolist() == [37, 16, 17, 18, 19, 0, 34, 35, 12, 13]
    assert batch.query_start_loc.tolist() == [0, 1, 6, 10] and batch.seq_lens.tolist() == [10, 5, 10]
    assert batch.block_tables.tolist() == [[7, 2, 9], [4, 0, 0], [5, 8, 3]]
    assert batch.block_tables.dtype == torch.int32 and (batch.max_query_len, batch.max_seq_len) == (5, 10)


def test_varlen_batch_views_are_16_byte_aligned():
    """Triton compiles a variant per pointer alignment: ragged sizes must not make new ones."""
    rng = random.Random(0)
    for _ in range(50):
        B = rng.randint(1, 9)
        q_lens, cached = [rng.randint(1, 7) for _ in range(B)], [rng.randint(0, 9) for _ in range(B)]
        tables = [list(range(-(-(c + q) // 3) + rng.randint(0, 2))) for c, q in zip(cached, q_lens)]
        batch = mi.VarlenBatch.build([[1] * q for q in q_lens], tables, cached, block_size=3)
        for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            assert getattr(batch, name).data_ptr() % 16 == 0, name


@pytest.mark.parametrize("tokens, tables, cached", [([], [], []), ([[]], [[0]], [0]), ([[1, 2]], [[0]], [3])])
def test_varlen_batch_refuses_impossible_input(tokens, tables, cached):
    with pytest.raises(ValueError, match="at least one new token and blocks"):
        mi.VarlenBatch.build(tokens, tables, cached, block_size=4)


def step_by_step(model, cache, prompt, chunks, new_tokens, block_size):
    """Prefill prompt in chunks of these sizes, then decode greedily: the varlen path a scheduler
    with chunked prefill takes (chapter 07)."""
    bm = mi.BlockManager(cache.k.shape[1], block_size)
    bm.allocate("s", len(prompt))
    done, tokens = 0, []
    try:
        for n in chunks:
            logits = cache.run(model, [prompt[done:done + n]], [bm.block_table("s")], [done])
            done += n
        for _ in range(new_tokens):
            tokens.append(int(logits.argmax(-1)))
            bm.append_token("s")
            logits = cache.run(model, [[tokens[-1]]], [bm.block_table("s")], [len(prompt) + len(tokens) - 1])
    finally:
        bm.free("s")
    return tokens


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_generate_paged_varlen_equals_transformers(hf_checkpoint, kernels, block_size):
    kind, folder, hf = hf_checkpoint
    model = mi.load_model(folder)
    prompts = [[5, 17, 200, 3, 99, 42, 7], [11], list(range(250, 240, -1)) + [1, 2, 3, 4, 5, 6, 7], [77, 78]]
    params = mi.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    bm = mi.BlockManager(120, block_size)
    backend = functools.partial(mi.VarlenKVCache, kernels=kernels)
    outs = mi.generate_paged(model, prompts, params, block_manager=bm, backend=backend)
    assert outs == [hf_greedy(hf, p, 10) for p in prompts], kind
    assert bm.num_free_blocks == 120


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_chunked_prefill_through_the_varlen_path(hf_checkpoint, kernels):
    """A prompt prefilled in chunks (some smaller than a block, one ending mid-block) decodes the
    same tokens as transformers."""
    kind, folder, hf = hf_checkpoint
    model = mi.load_model(folder)
    prompt = [(7 * i + 3) % 300 for i in range(23)]
    cache = mi.VarlenKVCache(model.cfg, 20, 4, kernels=kernels)
    assert step_by_step(model, cache, prompt, [2, 9, 1, 11], 6, 4) == hf_greedy(hf, prompt, 6), kind


def test_course_model_generate_paged_default_backend_is_varlen():
    model, tok = mi.load_model(), mi.load_tokenizer()
    prompts = [tok(t).input_ids for t in ["def fibonacci(n):", "import os\n"]]
    params = mi.SamplingParams(temperature=0, max_tokens=32)
    bm = mi.BlockManager(64, 16)
    made = []
    backend = lambda *a: made.append(mi.PAGED_BACKENDS["varlen"](*a)) or made[-1]  # noqa: E731
    assert mi.generate_paged(model, prompts, params, block_manager=bm) == \
        mi.generate_paged(model, prompts, params, backend=backend) == \
        [mi.generate_naive(model, p, params) for p in prompts]
    assert isinstance(made[0], mi.VarlenKVCache) and bm.num_free_blocks == 64


def test_unknown_backend_and_kernels_are_refused():
    model = mi.load_model()
    with pytest.raises(ValueError, match=r"no paged attention backend 'flash': there are \['gather', 'varlen'\]"):
        mi.generate_paged(model, [[1, 2]], mi.SamplingParams(max_tokens=2), backend="flash")
    with pytest.raises(ValueError, match=r"no attention kernels 'cuda': there are \['latent', 'torch', 'triton'\]"):
        mi.VarlenKVCache(model.cfg, 4, 4, kernels="cuda")


def test_later_chapters_are_named_in_the_tables_and_imported_when_asked_for():
    """No table changes on import: a later chapter's entry is a "module:attribute" name in the table
    itself, imported when first asked for; a name that does not import fails loudly."""
    assert dict(mi.engine.llm_engine.BLOCK_MANAGERS)[True] == "miniinfer.core.prefix_cache:PrefixCachingBlockManager"
    assert mi.engine.llm_engine.BLOCK_MANAGERS[True] is mi.core.prefix_cache.PrefixCachingBlockManager
    assert dict(mi.engine.llm_engine.EXECUTORS)["multiprocess"] == "miniinfer.engine.multiprocess:MultiProcessExecutor"
    assert dict(mi.worker.kv_cache.ATTENTION_KERNELS)["triton"] == "miniinfer.kernels.attention:TRITON_ATTENTION"
    broken = mi.model.registry.Registry("thing", {"x": "miniinfer.no_such_module:X"})
    with pytest.raises(ModuleNotFoundError, match="no_such_module"):
        broken["x"]
