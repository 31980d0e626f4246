"""Chapter 17's persistent decode step. Triton's interpreter runs a grid's programs one after another, so
programs that wait on each other cannot run here: the schedule (who waits for what) is proved in
Python for many shapes and program counts, and the kernel runs as one program working through every
task in order, against the model's own forward through the paged pool. The kernel is also compiled for an
H100 here: Triton's front end checks what the interpreter does not."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
from hypothesis import given, settings
from hypothesis import strategies as st

from miniinfer.course.checks.ch17 import small_model
from miniinfer.kernels.persistent import (
    DOWN,
    GU,
    LM,
    QKV,
    O,
    PersistentDecode,
    ScheduleError,
    Shape,
    check_schedule,
    deal,
    schedule,
    stacked,
    unsupported,
    waits_for,
    where_supported,
)
from miniinfer.model.transformer import Transformer
from miniinfer.worker.paged_cache import PagedKVCache

shapes = st.builds(Shape, layers=st.integers(1, 3), hidden=st.sampled_from([16, 48, 64]),
                   heads=st.sampled_from([2, 4]), kv_heads=st.just(2), head_dim=st.sampled_from([8, 16]),
                   ffn=st.integers(8, 100), vocab=st.integers(5, 70), tile=st.sampled_from([32, 64, 256]),
                   splits=st.integers(1, 4), programs=st.integers(1, 40))


@settings(max_examples=30, deadline=None)
@given(shapes)
def test_every_schedule_finishes_and_reads_only_what_is_written(shape):
    tasks = schedule(shape)
    assert check_schedule(deal(tasks, shape.programs), shape.layers) == len(tasks)
    assert sorted(t.op for t in tasks).count(LM) == shape.tasks(LM)
    for op in (QKV, O, GU, DOWN, LM):  # a whole tile, a half or a quarter: never longer than the whole one
        (n, k), rows = shape.size(op), shape.rows(op)
        whole = max(1, shape.tile // triton.next_power_of_2(k))
        assert rows in (whole, whole // 2, whole // 4) and rows >= 1
        cost = {r: triton.cdiv(triton.cdiv(n, r), shape.programs) * (r * k + shape.tile // 4) for r in (rows, whole)}
        assert cost[rows] <= cost[whole]


def test_an_ops_tiles_shrink_where_its_tasks_then_fill_the_programs_rounds():
    ops = (QKV, O, GU, DOWN, LM)
    llama = Shape(layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64, ffn=8192, vocab=128256)
    assert [llama.tasks(op) for op in ops] == [192, 128, 1024, 512, 8016]  # one program: whole tiles
    # 132 programs: QKV's 192 tasks of 64 KB took two rounds, its 384 of 32 KB take three half as long
    assert [dataclasses.replace(llama, programs=132).tasks(op) for op in ops] == [384, 128, 1024, 512, 8016]
    qwen3 = Shape(layers=28, hidden=1024, heads=16, kv_heads=8, head_dim=128, ffn=3072, vocab=151936, programs=132)
    assert [qwen3.tasks(op) for op in ops] == [128, 128, 384, 128, 4748]  # O: 64 tasks left half the SMs idle


def one_short(op, layer, shape):
    wait, count = waits_for(op, layer, shape)
    return (wait, count - 1) if op == GU else (wait, count)


def one_too_many(op, layer, shape):
    wait, count = waits_for(op, layer, shape)
    return (wait, count + 1) if op == DOWN else (wait, count)


def layers_at_once(op, layer, shape):
    return (-1, 0) if op == QKV else waits_for(op, layer, shape)


def two_back(op, layer, shape):  # O waits for QKV: attention's output may not be there yet
    return (layer * 5 + QKV, shape.tasks(QKV)) if op == O else waits_for(op, layer, shape)


@pytest.mark.parametrize("rule, error", [(one_short, "may read mid"), (one_too_many, "wait forever"),
                                         (layers_at_once, "may read stream"), (two_back, "may read attention")])
def test_a_wrong_dependency_rule_is_caught(rule, error):
    shape = Shape(layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=48, vocab=40, tile=64)
    with pytest.raises(ScheduleError, match=error):
        check_schedule(deal(schedule(shape, rule), 5), shape.layers)


def tiny(kind: str, **sizes) -> Transformer:
    return small_model(kind, **{**dict(hidden=64, ffn=96, vocab=200, heads=4, head_dim=16), **sizes})


def ints(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# Attention in parts of whole 4-position tiles (splits, tile): 3 parts over 8 positions ([0, 4), [4, 8) and an
# empty one) and over 9 (one tile each, the new position in the last). 16 query heads of 128 dimensions a KV
# head: the merge takes their parts two at a time, the second time the last part and one masked (one step:
# the merge is its point, and the interpreter takes about 15 s a step of it).
@pytest.mark.parametrize("kind, block_size, sizes, parts, steps", [
    ("llama", 3, {}, (3, 4), 2), ("qwen2", 1, dict(hidden=48, ffn=80, vocab=131), (1, 32), 2),
    ("qwen3", 16, dict(heads=6, kv_heads=2, head_dim=12), (2, 4), 2),
    ("llama", 2, dict(heads=16, kv_heads=1, head_dim=128), (3, 2), 1)])
@torch.no_grad()
def test_the_step_gives_the_models_logits_and_cache(kind, block_size, sizes, parts, steps):
    model = tiny(kind, **sizes)
    cache = PagedKVCache(model.cfg, 40, block_size)
    table = [7, 2, 9, 30, 1, 4, 11, 5, 3, 20][:-(-12 // block_size)]
    prompt = [3, 17, 42, 8, 99, 120, 7]
    want = cache.run(model, [prompt], [table], [0])
    step = PersistentDecode(model, cache.k, cache.v, block_size, programs=1, tile=128, num_warps=4, splits=parts[0])
    step.config["BP"] = parts[1]
    n = len(prompt)
    for _ in range(steps):
        token, slot = int(want[0].argmax()), table[n // block_size] * block_size + n % block_size
        got = step.step(ints(token), ints(n), ints(slot), ints(n + 1), ints(*table)).clone()
        k = cache.k.clone()
        want = cache.run(model, [[token]], [table], [n])  # the same slot written again, by the model
        assert (got - want).abs().max() < 1e-4
        assert torch.allclose(k, cache.k, atol=1e-5)
        n += 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="programs that wait on each other need a GPU")
@pytest.mark.parametrize("kv_heads, splits, sizes", [(1, None, {}), (2, 3, {}), (2, None, {}),
                                                    (1, None, dict(heads=16, head_dim=128))])
@torch.no_grad()
def test_on_a_gpu_the_parts_merge_to_the_models_logits_the_same_way_every_step(kv_heads, splits, sizes):
    """One program per SM, so attention's parts run at once: the model's logits at contexts of 1 to 701 (three
    query heads of 12 dimensions a KV head; or 16 of 128, whose merge takes the parts two at a time), the same
    bits step after step (the merge adds the parts in a fixed order: a difference would be a race), and every
    counter back at zero after each step."""
    model = small_model("qwen3", **{"heads": 3 * kv_heads, "kv_heads": kv_heads, **sizes})
    cache = PagedKVCache(model.cfg, 48, 16, device="cuda")
    table = torch.randperm(48, generator=torch.Generator().manual_seed(0)).tolist()
    step = PersistentDecode(model, cache.k, cache.v, 16, splits=splits)

    def ints(*values):
        return torch.tensor(values, dtype=torch.int32, device="cuda")
    for n in (0, 5, 40, 700):
        prompt = [(7 * i) % 300 for i in range(n + 1)]
        if n:
            cache.run(model, [prompt[:n]], [table], [0])
        args = (ints(prompt[n]), ints(n), ints(table[n // 16] * 16 + n % 16), ints(n + 1), ints(*table))
        got = step.step(*args).clone()
        assert (got - cache.run(model, [prompt[n:]], [table], [n])).abs().max() < 1e-4
        for _ in range(20):
            assert torch.equal(step.step(*args), got) and not step.counters.any()


def test_splits_must_be_at_least_one():
    model = tiny("llama")
    pool = torch.zeros(2, 4, 3, 2, 16)
    with pytest.raises(ValueError, match="splits must be at least 1, not 0"):
        PersistentDecode(model, pool, pool, 3, splits=0)


@torch.no_grad()
def test_layers_weights_are_stacked_once_and_the_model_reads_the_same_values():
    model = tiny("llama")
    ids = torch.tensor([[1, 2, 3]])
    before = model(ids)
    whole = stacked(model.model.layers, "mlp.down_proj.weight")
    assert whole.shape[0] == 2 and model.model.layers[1].mlp.down_proj.weight.data_ptr() == whole[1].data_ptr()
    assert stacked(model.model.layers, "mlp.down_proj.weight").data_ptr() == whole.data_ptr()
    assert torch.equal(model(ids), before)


def test_models_it_cannot_run_are_named_and_left_to_the_graphs():
    model = tiny("llama")
    pool = torch.zeros(2, 4, 3, 2, 16)
    assert unsupported(model, torch.float32) is None
    assert "dtype" in unsupported(model, torch.float8_e4m3fn)
    assert where_supported(model, pool.to(torch.bfloat16), pool.to(torch.bfloat16), 3) is None
    with pytest.raises(ValueError, match="cannot run this model: a KV pool of another dtype"):
        PersistentDecode(model, pool.to(torch.bfloat16), pool.to(torch.bfloat16), 3)
    assert "odd head size" in unsupported(tiny("llama", head_dim=7), torch.float32)


def test_the_setting_names_each_step_and_refuses_where_the_kernel_cannot_run():
    import miniinfer as mi
    from miniinfer.worker.cuda_graphs import SINGLE_STEPS
    model = tiny("llama")
    pool = torch.zeros(2, 4, 3, 2, 16)
    assert SINGLE_STEPS["graphs"](model, pool, pool, 3) is None
    assert isinstance(SINGLE_STEPS["auto"](model, pool, pool, 3), PersistentDecode)
    assert SINGLE_STEPS["auto"](tiny("llama"), pool.half(), pool.half(), 3) is None  # another dtype: the graphs
    assert mi.EngineConfig().decode_kernel == "graphs"
    for wrong in (dict(), dict(device="cuda", cuda_graph=False), dict(device="cuda", tensor_parallel_size=2)):
        with pytest.raises(ValueError, match="decode_kernel='persistent' is one GPU's kernel"):
            mi.EngineConfig(decode_kernel="persistent", **wrong)
    with pytest.raises(ValueError, match="decode_kernel must be one of"):
        mi.EngineConfig(decode_kernel="megakernel")


def compile_for_h100(sizes: dict, prefetch: int, trace: bool, into: str) -> None:
    """Compile the step's kernel for an H100 (sm_90) without one, with the arguments `step` launches it with:
    Triton's front end checks what its interpreter does not (a loop variable that changes shape, a constexpr it
    cannot fold). Run with TRITON_INTERPRET=0."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import miniinfer.kernels.persistent as persistent
    model = small_model("qwen3", **sizes)
    cache = PagedKVCache(model.cfg, 16, 16)
    step = PersistentDecode(model, cache.k, cache.v, 16, programs=132)
    step.config.update(PREFETCH=prefetch, INTO=into)
    kernel, launched = persistent._decode_kernel, {}
    persistent._decode_kernel = {(132,): lambda *args, **kw: launched.update(args=args, kw=kw)}  # kernel[grid](...)
    one = torch.zeros(1, dtype=torch.int32)
    step.step(one, one, one, one, one, trace=torch.zeros(1, dtype=torch.int64) if trace else None)
    types = {torch.float32: "*fp32", torch.int32: "*i32", torch.int64: "*i64"}
    signature = {name: types[a.dtype] if isinstance(a, torch.Tensor) else "fp32" if isinstance(a, float) else "i32"
                 for name, a in zip(kernel.arg_names, launched["args"])}
    options = {k: launched["kw"].pop(k) for k in ("num_warps",)}
    signature.update(dict.fromkeys(launched["kw"], "constexpr"))
    compiled = triton.compile(ASTSource(kernel, signature, launched["kw"]), target=GPUTarget("cuda", 90, 32),
                              options=dict(options, launch_cooperative_grid=True))
    # Triton turns some sums of products into tl.dot, which takes float32 as tf32 (on an H100, 16 query heads
    # a KV head moved the float32 logits by 2.5e-3): every product here is meant in full float32.
    assert "tt.dot" not in compiled.asm["ttir"], "a sum of products compiled as tl.dot (tf32 for float32)"


# Two attention shapes on 132 programs: 3 query heads of 12 over 2 KV heads (32 parts each, merged in one load),
# 16 of 128 over one (32 parts, merged two at a time); prefetch off, one and two tasks ahead (into L2, or L1);
# the traced kernel.
@pytest.mark.parametrize("sizes, prefetch, trace, into", [
    ({}, 1, False, "L2"), (dict(heads=16, kv_heads=1, head_dim=128), 2, True, "L2"), ({}, 0, True, "L2"),
    ({}, 1, False, "L1")])
def test_the_kernel_compiles_for_an_h100_on_any_machine(sizes, prefetch, trace, into):
    code = f"import test_persistent as t; t.compile_for_h100({sizes!r}, {prefetch}, {trace}, {into!r})"
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "0"}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
