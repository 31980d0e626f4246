"""Chapter 04: Triton kernels against the PyTorch references (interpreter on CPU), and the ops seam."""

import importlib

import pytest
import torch

import miniinfer as mi
from miniinfer.model.transformer import (
    add_rms_norm,
    apply_rope,
    qk_norm_rope,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
    silu_and_mul,
)

DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 200), (3, 1000), (2, 3, 5120), (4, 5, 3, 64), (37, 96)])
def test_rms_norm_and_fused_add(shape, dtype):
    gen = torch.Generator().manual_seed(sum(shape))
    x, r = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    w = torch.randn(shape[-1], generator=gen).to(dtype)
    torch.testing.assert_close(mi.kernels.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5))
    for got, ref in zip(mi.kernels.fused_add_rms_norm(x, r, w, 1e-5), add_rms_norm(x, r, w, 1e-5)):
        torch.testing.assert_close(got, ref)


def test_rms_norm_on_per_head_views():
    """The Qwen3 q/k norm: heads of a strided view, normalized over head_dim."""
    qkv = torch.randn(2, 7, (6 + 2 + 2) * 20)
    q = qkv[..., :120].view(2, 7, 6, 20)
    w = torch.randn(20)
    torch.testing.assert_close(mi.kernels.rms_norm(q, w, 1e-6), rms_norm(q, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (3, 2 * 7), (2, 3, 2 * 1025), (5, 2 * 96)])  # odd, one over a block
def test_silu_and_mul(shape, dtype):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))).to(dtype)
    tol = dict(rtol=2e-3, atol=2e-3) if dtype == torch.float16 else {}
    torch.testing.assert_close(mi.kernels.silu_and_mul(x), silu_and_mul(x), **tol)
    rows = x.flatten(0, -2)[::2]  # every other row: a view whose rows are not adjacent
    torch.testing.assert_close(mi.kernels.silu_and_mul(rows), silu_and_mul(rows), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, Hq, Hk, D", [(1, 32, 8, 128), (13, 6, 2, 20), (5, 5, 5, 96), (40, 3, 1, 2)])
def test_rope(T, Hq, Hk, D, dtype):
    gen = torch.Generator().manual_seed(T * Hq + D)
    q, k = torch.randn(T, Hq, D, generator=gen).to(dtype), torch.randn(T, Hk, D, generator=gen).to(dtype)
    cos, sin = (t.to(dtype) for t in rope_cos_sin(torch.randint(0, 9999, (T,), generator=gen), rope_inv_freq(D, 1e4)))
    tol = dict(rtol=2e-3, atol=2e-3) if dtype == torch.float16 else {}
    for got, ref in zip(mi.kernels.apply_rope(q, k, cos, sin), apply_rope(q, k, cos, sin)):
        torch.testing.assert_close(got, ref, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, Hq, Hk, D", [(1, 16, 8, 128), (7, 6, 2, 20), (3, 5, 5, 2)])
def test_qk_norm_rope_on_views_of_the_packed_projection(T, Hq, Hk, D, dtype):
    gen = torch.Generator().manual_seed(T + Hq * D)
    qkv = torch.randn(2, T, (Hq + 2 * Hk) * D, generator=gen).to(dtype)
    q, k = qkv[..., :Hq * D].view(2, T, Hq, D), qkv[..., Hq * D:(Hq + Hk) * D].view(2, T, Hk, D)
    cos, sin = (t.to(dtype) for t in rope_cos_sin(torch.randint(0, 9999, (2, T), generator=gen), rope_inv_freq(D, 1e4)))
    qw, kw = (1 + torch.randn(D, generator=gen)).to(dtype), (1 + torch.randn(D, generator=gen)).to(dtype)
    tol = dict(rtol=2e-3, atol=2e-3) if dtype == torch.float16 else {}
    args = (q, k, cos, sin, qw, kw, 1e-6)
    for got, ref in zip(mi.kernels.qk_norm_rope(*args), qk_norm_rope(*args)):
        torch.testing.assert_close(got, ref, **tol)


def test_rope_on_strided_views_with_leading_dims():
    qkv = torch.randn(2, 9, (4 + 2 + 2) * 16)
    q, k = qkv[..., :64].view(2, 9, 4, 16), qkv[..., 64:96].view(2, 9, 2, 16)
    cos, sin = rope_cos_sin(torch.arange(9).expand(2, 9), rope_inv_freq(16, 1e4))
    for got, ref in zip(mi.kernels.apply_rope(q, k, cos, sin), apply_rope(q, k, cos, sin)):
        torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M, N, K, block_n, block_k", [(1, 37, 53, 8, 32), (1, 1, 7, 1, 8), (2, 19, 130, 4, 64),
                                                       (3, 40, 96, 16, 16), (1, 130, 300, 64, 256)])
@pytest.mark.parametrize("add, norm, bias, gated", [(False, False, False, False), (True, True, True, False),
                                                    (True, True, False, True), (False, False, True, True)])
def test_gemv(M, N, K, block_n, block_k, add, norm, bias, gated, dtype):
    """Chapter 06's GEMV with each of its prologues and epilogues against the PyTorch ops, odd sizes."""
    gen = torch.Generator().manual_seed(M * N + K)
    h, x, nw = torch.randn(M, K, generator=gen), torch.randn(M, K, generator=gen), torch.randn(K, generator=gen)
    w = torch.randn(2 * N if gated else N, K, generator=gen) / K ** 0.5
    b = torch.randn(w.shape[0], generator=gen) if bias else None
    h, x, nw, w, b = (t.to(dtype) if t is not None else None for t in (h, x, nw, w, b))
    y, total = add_rms_norm(h, x, nw, 1e-6) if add else (h, None)
    ref = torch.nn.functional.linear(y if norm else total if add else h, w, b)
    ref = silu_and_mul(ref) if gated else ref
    out, s = mi.kernels.gemv(h, w, b, residual=x if add else None, norm=(nw, 1e-6) if norm else None, gated=gated,
                             config=dict(BLOCK_N=block_n, BLOCK_K=block_k))
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.float16 else {}
    torch.testing.assert_close(out, ref, **tol)
    if add:
        torch.testing.assert_close(s, total)
    else:
        assert s is None


@pytest.mark.parametrize("inside", [True, False])
def test_the_fused_ops_take_the_norm_inside_the_gemv_up_to_a_width_and_apart_past_it(hf_checkpoint, monkeypatch,
                                                                                   inside):
    """Rows up to NORM_INSIDE_UP_TO wide: the GEMV does the add and the norm; wider: chapter 04's kernel
    does, then the GEMV (SiLU still inside gate/up's). Every one-row matmul a GEMV, the same tokens."""
    kg = importlib.import_module("miniinfer.kernels.gemv")
    model = mi.load_model(hf_checkpoint[1])
    prompt, params = [5, 17, 200, 3, 99], mi.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref = mi.generate_cached(model, prompt, params)
    calls: list[dict] = []
    gemv = kg.gemv
    monkeypatch.setattr(kg, "gemv", lambda *a, **k: calls.append(k) or gemv(*a, **k))
    monkeypatch.setattr(kg, "NORM_INSIDE_UP_TO", model.cfg.hidden_size if inside else model.cfg.hidden_size - 1)
    assert mi.generate_cached(model.use_ops("fused"), prompt, params) == ref
    with_norm = [k.get("norm") is not None for k in calls]
    # per decode step: qkv, o, gate/up, down in every layer, then the LM head
    assert len(calls) == (params.max_tokens - 1) * (4 * model.cfg.num_layers + 1)
    assert sum(with_norm) == (params.max_tokens - 1) * (2 * model.cfg.num_layers + 1 if inside else 0)
    assert any(k.get("gated") for k in calls)


@pytest.mark.parametrize("ops", ["triton", "fused"])
def test_greedy_tokens_unchanged_with_triton_ops(hf_checkpoint, ops):
    kind, folder, _ = hf_checkpoint
    model = mi.load_model(folder)
    assert model.ops is mi.model.transformer.TORCH_OPS  # CPU default
    prompt = [5, 17, 200, 3, 99]
    params = mi.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = mi.generate_cached(model, prompt, params)
    assert mi.generate_cached(model.use_ops(ops), prompt, params) == ref, kind


def test_course_model_with_triton_ops():
    """The course model's greedy tokens through the Triton kernels and the fused GEMVs (five: under the
    interpreter each decode step of the two takes about a second)."""
    model, tok = mi.load_model(), mi.load_tokenizer()
    prompt = tok("import os\n").input_ids
    params = mi.SamplingParams(temperature=0, max_tokens=5)
    ref = mi.generate_naive(model, prompt, params)
    assert mi.generate_cached(model.use_ops("triton"), prompt, params) == ref
    assert mi.generate_cached(model.use_ops("fused"), prompt, params) == ref  # its decode steps through the GEMVs


def test_ops_selection():
    assert mi.model.transformer.default_ops("cpu") is mi.model.transformer.TORCH_OPS
    assert mi.model.transformer.default_ops("cuda") is mi.model.transformer.OPS_BACKENDS["fused"]
    with pytest.raises(ValueError, match=r"no ops backend 'cuda': there are \['fused', 'torch', 'triton'\]"):
        mi.load_model().use_ops("cuda")


def test_kernels_read_no_module_global_but_constexprs():
    """A compiled kernel may read a module's global only when it is a `tl.constexpr(...)`: the
    interpreter, which the CPU tests run, lets any global through, and a GPU then fails to compile
    (chapter 06's sampling kernel did, reading a plain float). Every global a @triton.jit function
    names must be a function, a module, or a constexpr."""
    import ast
    from pathlib import Path

    bad = []
    for path in sorted((Path(mi.__file__).parent / "kernels").glob("*.py")):
        tree = ast.parse(path.read_text())
        plain = {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets
                 if isinstance(t, ast.Name) and not (isinstance(node.value, ast.Call)
                                                     and getattr(node.value.func, "attr", "") == "constexpr")}
        for fn in tree.body:
            if isinstance(fn, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in fn.decorator_list):
                local = {a.arg for a in fn.args.args} | {n.id for n in ast.walk(fn)
                                                         if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
                bad += [f"{path.name}: {fn.name} reads {n.id}" for n in ast.walk(fn)
                        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in plain - local]
    assert not bad, bad
