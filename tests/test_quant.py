"""Chapter 10: quantized weights. Packing against compressed-tensors' own, the Triton kernels (under the
interpreter here) against dequantize-then-matmul, checkpoints written by compressed-tensors against
transformers' dequantized model, refusals, and the engine with quantized weights."""

import argparse
import json
from unittest import mock

import pytest
import torch
import transformers
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

import miniinfer as mi
from miniinfer.course.parity import hf_greedy
from miniinfer.kernels.quant import _e4m3, _e4m3_bits, int_matmul
from miniinfer.layers import quantization as quant

ct = pytest.importorskip("compressed_tensors")


@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from([4, 8]), rows=st.integers(1, 5), words=st.integers(1, 4), seed=st.integers(0, 99))
def test_pack_is_compressed_tensors_layout(bits, rows, words, seed):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-2 ** (bits - 1), 2 ** (bits - 1), (rows, words * 32 // bits), generator=g,
                          dtype=torch.int8)
    packed = quant.pack(codes, bits)
    assert torch.equal(packed, pack_to_int32(codes, bits))
    assert torch.equal(quant.unpack(packed, bits), codes)


@pytest.mark.parametrize("bits,group", [(8, None), (4, 128), (4, 32)])
def test_round_to_nearest_error_is_half_a_step(bits, group):
    w = torch.randn(19, 256) * torch.rand(19, 1) * 3
    codes, scale = quant.quantize_int(w, bits, group)
    assert codes.min() >= -2 ** (bits - 1) and codes.max() <= 2 ** (bits - 1) - 1
    err = (quant.dequantize(quant.pack(codes, bits), scale, bits) - w).abs()
    step = scale.repeat_interleave(256 // scale.shape[1], dim=1)
    assert (err <= step / 2 + 1e-6).all()


@pytest.mark.parametrize("bits,group", [(8, None), (4, 128), (4, 32)])
@pytest.mark.parametrize("M", [1, 3, 17, 40])
def test_int_matmul_equals_dequantize_then_matmul(bits, group, M):
    """Each kernel within 1e-5 of |x| @ |W|^T of the float64 product: the int4 GEMV's sums carry 16 x for
    each pair of codes (chapter 10), a few 1e-7 of it in error where a float32 matmul's is below 1e-7."""
    torch.manual_seed(M)
    N, K = 37, 256  # N not a multiple of any tile; M = 40 takes the dequantize-then-matmul path
    codes, scale = quant.quantize_int(torch.randn(N, K), bits, group)
    packed = quant.pack(codes, bits)
    x, bias = torch.randn(M, K), torch.randn(N)
    w = quant.dequantize(packed, scale, bits).double()
    ref, bound = x.double() @ w.T, 1e-5 * (x.double().abs() @ w.abs().T)
    out = int_matmul(x, packed.t().contiguous(), scale.t().contiguous(), bits, bias)
    assert ((out - bias - ref).abs() <= bound).all()
    for config in (dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32 if group == 32 else 128, SPLIT_K=3),  # tiled
                   dict(BLOCK_N=16, WORDS=8)):  # GEMV, any M; tiles of 64 int8 or 16 int4 inputs
        other = int_matmul(x, packed.t().contiguous(), scale.t().contiguous(), bits, None, config)
        assert ((other - ref).abs() <= bound).all(), ((other - ref).abs() / bound).max()


@pytest.mark.parametrize("bits,group", [(8, None), (4, 128), (4, 32)])
@pytest.mark.parametrize("M,N,K,gated,bias", [(1, 37, 256, False, False), (1, 19, 384, True, True),
                                              (3, 40, 256, True, False), (2, 33, 512, False, True)])
def test_int_gemv_with_the_gate_inside_after_the_ops_add_and_norm(bits, group, M, N, K, gated, bias):
    """Chapter 06's fused ops over an IntLinear with the Triton kernels: the layer declines the add and
    norm inside its GEMV, so chapter 04's kernel runs them first, then the GEMV with SiLU-and-multiply in
    its epilogue; against the add, the norm, the dequantized matmul and SiLU one by one. Tiles of 8
    words split K in several, groups span tiles and lie within them."""
    from miniinfer.kernels import quant as kq
    from miniinfer.kernels.gemv import FUSED_OPS

    torch.manual_seed(M * N)
    h, x, nw = torch.randn(M, K), torch.randn(M, K), torch.randn(K)
    codes, scale = quant.quantize_int(torch.randn(2 * N if gated else N, K), bits, group)
    b = torch.nn.Parameter(torch.randn(codes.shape[0])) if bias else None
    layer = quant.IntLinear.from_codes(codes, scale, bits, b, kernels=kq.TRITON_QUANT)
    norm = mi.model.transformer.RMSNorm(K, 1e-6)
    norm.weight.data = nw
    y, total = mi.model.transformer.add_rms_norm(h, x, nw, 1e-6)
    ref = torch.nn.functional.linear(y, quant.dequantize(quant.pack(codes, bits), scale, bits), b)
    ref = mi.model.transformer.silu_and_mul(ref) if gated else ref
    with mock.patch.object(kq, "GEMV_ROWS", 4), torch.no_grad():
        assert layer.gemv(h, residual=x, norm=(nw, 1e-6), gated=gated) is None
        out, s = FUSED_OPS.add_norm_linear(h, x, norm, layer, gated)
    torch.testing.assert_close(s, total)
    # sum x*v - 1.5 * sum x cancels a few bits of float32 (the tiled kernel's exact codes keep them)
    torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-3)
    tiles = kq.int_gemv(y, layer.weight_packed, layer.weight_scale, bits, b, gated=gated,
                        config=dict(BLOCK_N=16, WORDS=8))
    torch.testing.assert_close(tiles, ref, atol=1e-3, rtol=1e-3)


def compile_int_gemv_for_h100(bits: int, gated: bool, fp32: bool) -> None:
    """The int GEMV compiled for an H100 (sm_90) without one: Triton's front end checks what its
    interpreter does not (a constexpr assigned twice, a loop that its pipeliner cannot take). Run with
    TRITON_INTERPRET=0."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from miniinfer.kernels import quant as kq
    signature = dict(x_ptr="*fp32" if fp32 else "*bf16", w_ptr="*i32", s_ptr="*bf16", b_ptr="*bf16",
                     out_ptr="*bf16", M="i32", N="i32", K="i32", x_stride="i32")
    shipped = kq.gemv_config(8192 if gated else 4096, 4096, bits, torch.device("cuda"))
    for tile in (dict(BLOCK_N=16, WORDS=64, num_warps=4), shipped):
        constants = dict(ROWS=2, HAS_BIAS=True, GATED=gated, BITS=bits, GROUP=128, PDL=True,
                         **{k: v for k, v in tile.items() if k != "num_warps"})
        source = ASTSource(kq._int_gemv_kernel, {**signature, **dict.fromkeys(constants, "constexpr")}, constants)
        triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=tile["num_warps"]))


@pytest.mark.parametrize("bits, gated, fp32", [(4, True, False), (8, False, True)])
def test_the_int_gemv_compiles_for_an_h100_on_any_machine(bits, gated, fp32):
    """A small tile (four warps) and gemv_config's own for an 8B-sized layer (eight warps)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = f"import test_quant as t; t.compile_int_gemv_for_h100({bits}, {gated}, {fp32})"
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "0"}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@triton.jit
def _round_all(x_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, _e4m3(tl.load(x_ptr + i)))


@triton.jit
def _read_all(b_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, _e4m3_bits(tl.load(b_ptr + i)))


def test_e4m3_rounding_and_reading_are_torchs_casts():
    """The fp8 GEMV's rounding of activations, on every e4m3 value, every midpoint between two (the
    ties), and random values at several scales (subnormals among them)."""
    exact = torch.arange(256, dtype=torch.uint8).view(quant.FP8).float()
    exact = exact[exact.isfinite()].sort().values
    torch.manual_seed(0)
    x = torch.cat([exact, (exact[1:] + exact[:-1]) / 2, torch.randn(3000) * 100, torch.randn(3000) * 1e-2,
                   torch.randn(1000) * 1e-4]).clamp(-quant.FP8_MAX, quant.FP8_MAX)
    x = torch.cat([x, torch.zeros(8192 - len(x))])
    out = torch.empty_like(x)
    _round_all[(1,)](x, out, N=len(x))
    assert torch.equal(out, x.to(quant.FP8).float())
    # and the fp8 GEMV's reading of weights: every byte but e4m3's two NaNs, subnormals and signs included
    codes = torch.arange(256, dtype=torch.uint8).view(torch.int8)
    read = torch.empty(256)
    _read_all[(1,)](codes, read, N=256)
    exact = codes.view(quant.FP8).float()
    finite = exact.isfinite()
    assert torch.equal(read[finite].double() * 2.0 ** 120, exact[finite].double())


@pytest.mark.parametrize("M,N,K,gated,bias", [(1, 37, 256, False, False), (1, 19, 384, True, True),
                                              (2, 33, 520, False, True), (3, 8, 1000, True, False)])
def test_fp8_gemv_computes_what_scaled_mm_does(M, N, K, gated, bias):
    """The fp8 GEMV on normed rows (an FP8Linear declines the add and norm: the ops run them first)
    against FP8Linear's activations quantized by quantize_fp8, float32 products, the scales and the bf16
    bias after, rounded to bf16 (what `_scaled_mm` returns), SiLU after: equal up to the order of the
    sums (a bf16 step)."""
    from miniinfer.kernels import quant as kq

    torch.manual_seed(M * N)
    h, x, nw = torch.randn(M, K), torch.randn(M, K), torch.randn(K)
    w, ws = quant.quantize_fp8(torch.randn(2 * N if gated else N, K))
    b = torch.randn(w.shape[0]) if bias else None
    y, _ = mi.model.transformer.add_rms_norm(h, x, nw, 1e-6)
    yq, ys = quant.quantize_fp8(y)
    ref = yq.float() @ w.float().T * ys * ws.T + (b.bfloat16().float() if bias else 0)
    ref = ref.bfloat16().float()
    ref = mi.model.transformer.silu_and_mul(ref) if gated else ref
    layer = quant.FP8Linear(K, w.shape[0], False)
    layer.weight, layer.weight_scale = w, ws
    assert layer.gemv(h, residual=x, norm=(nw, 1e-6), gated=gated) is None
    with mock.patch.object(kq, "FP8_GEMV_ROWS", 4):
        out = kq.TRITON_QUANT.fp8_gemv(y, w, ws, b, gated=gated)
        assert kq.TRITON_QUANT.fp8_gemv(y.repeat(5, 1), w, ws, b) is None  # over the rows
    step = 2 ** -7 * ref.abs().max().item()
    torch.testing.assert_close(out, ref, atol=step, rtol=2 ** -7)
    tiles = kq.fp8_gemv(y, w, ws, b, gated=gated, config=dict(BLOCK_N=4, BLOCK_K=64))  # K in several tiles
    torch.testing.assert_close(tiles, ref, atol=step, rtol=2 ** -7)


@pytest.mark.parametrize("scheme", ["int8", "int4", "fp8"])
def test_quantized_layers_stay_close_to_the_original(scheme):
    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 48, bias=True)
    x = torch.randn(5, 256)
    q = quant.SCHEMES[scheme].quantize(layer)
    ref = layer(x)
    err = ((q(x) - ref).norm() / ref.norm()).item()
    assert err < {"int8": 0.01, "int4": 0.15, "fp8": 0.05}[scheme]


def test_int4_needs_whole_groups():
    with pytest.raises(ValueError, match="groups of 128"):
        quant.SCHEMES["int4"].quantize(torch.nn.Linear(96, 8))


def write_compressed(preset: str, folder, ignore=("lm_head",)) -> None:
    """A small Llama quantized by compressed-tensors itself (min-max scales, as its observers pick)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(cfg).eval()
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])}, ignore=list(ignore)))
    for m in model.modules():
        if getattr(m, "quantization_scheme", None) is None or not hasattr(m, "weight_scale"):
            continue
        w, args = m.weight.detach(), m.quantization_scheme.weights
        groups = w.reshape(w.shape[0], -1, args.group_size) if args.strategy == "group" else w[:, None, :]
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        m.weight_scale.data = scale.to(m.weight_scale.dtype).reshape(m.weight_scale.shape)
        if hasattr(m, "weight_zero_point"):
            m.weight_zero_point.data = zero.to(m.weight_zero_point.dtype).reshape(m.weight_zero_point.shape)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)


def dequantized(folder):
    """transformers' own reading of the checkpoint: compressed-tensors decompresses the weights."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=transformers.CompressedTensorsConfig(dequantize=True)).eval()


@pytest.mark.parametrize("preset,layer", [("W4A16", quant.IntLinear), ("W8A16", quant.IntLinear)])
def test_compressed_tensors_checkpoint_matches_its_library(tmp_path, preset, layer):
    write_compressed(preset, tmp_path)
    ours, theirs = mi.load_model(tmp_path), dequantized(tmp_path)
    proj = ours.model.layers[1].mlp.down_proj
    assert isinstance(proj, layer)
    w = quant.dequantize(proj.weight_packed.t(), proj.weight_scale.t(), proj.bits)
    assert torch.equal(w, theirs.model.layers[1].mlp.down_proj.weight)
    ids = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        assert torch.allclose(ours(ids), theirs(ids).logits, atol=1e-4)
    greedy = mi.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine = mi.LLMEngine(mi.EngineConfig(model=tmp_path, num_blocks=32, max_model_len=128))
    out = engine.generate([list(range(5, 15))], greedy, use_tqdm=False)[0]
    assert out.token_ids == hf_greedy(theirs, list(range(5, 15)), 8)
    assert engine.block_manager.num_free_blocks == 32


def test_fp8_checkpoint_weights_match_its_library(tmp_path):
    write_compressed("FP8_DYNAMIC", tmp_path)
    ours, theirs = mi.load_model(tmp_path), dequantized(tmp_path)
    proj = ours.model.layers[0].self_attn.o_proj
    assert isinstance(proj, quant.FP8Linear)
    w = proj.weight.float() * proj.weight_scale
    assert torch.allclose(w, theirs.model.layers[0].self_attn.o_proj.weight, rtol=1e-6, atol=0)


def test_unsupported_checkpoints_are_refused_before_serving(tmp_path):
    write_compressed("W4A16_ASYM", tmp_path / "asym")
    with pytest.raises(mi.CheckpointError, match="symmetric"):
        mi.load_model(tmp_path / "asym")
    write_compressed("W4A16", tmp_path / "w4")
    with pytest.raises(mi.CheckpointError, match="already quantized"):
        mi.load_model(tmp_path / "w4", quantization="int8")
    config = json.loads((tmp_path / "w4" / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "gptq"
    (tmp_path / "w4" / "config.json").write_text(json.dumps(config))
    with pytest.raises(mi.CheckpointError, match="no quantization 'gptq'"):
        mi.LLMEngine(mi.EngineConfig(model=tmp_path / "w4"))
    with pytest.raises(ValueError, match="quantization must be one of"):
        mi.EngineConfig(quantization="int3")


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_engine_with_quantized_weights_agrees_with_naive_decoding(scheme):
    greedy = mi.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7, 8], list(range(100, 140)), [42]]
    engine = mi.LLMEngine(mi.EngineConfig(quantization=scheme, num_blocks=24, max_num_seqs=2))
    outs = engine.generate(prompts, greedy, use_tqdm=False)
    model = quant.quantize_model(mi.load_model(), scheme, lm_head="int8")  # the engine's default beside them
    assert [o.token_ids for o in outs] == [mi.generate_naive(model, p, greedy) for p in prompts]
    assert engine.block_manager.num_free_blocks == 24


@pytest.mark.parametrize("head", ["int8", "int4"])
def test_the_lm_head_quantized_too_gets_its_own_codes_and_serves(head):
    """The course model ties its head to the embedding: quantizing the head leaves the embedding's matrix
    whole, the head's logits within its rounding, and the engine asked for it (quantize_lm_head) serving
    as naive decoding does."""
    ref = mi.load_model()
    model = quant.quantize_model(mi.load_model(), "int4", lm_head=head)
    assert isinstance(model.lm_head, quant.IntLinear) and model.lm_head.bits == int(head[3:])
    assert torch.equal(model.model.embed_tokens.weight, ref.model.embed_tokens.weight)
    head_layer = model.lm_head
    w = quant.dequantize(head_layer.weight_packed.t(), head_layer.weight_scale.t(), head_layer.bits)
    step = head_layer.weight_scale.t().repeat_interleave(w.shape[1] // head_layer.weight_scale.shape[0], dim=1)
    assert ((w - ref.lm_head.weight).abs() <= step / 2 + 1e-6).all()  # the embedding's matrix, rounded to nearest
    h = torch.randn(3, ref.cfg.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(head_layer(h), h @ w.T, atol=1e-4, rtol=1e-4)
    greedy = mi.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [42]]
    engine = mi.LLMEngine(mi.EngineConfig(quantization="int4", quantize_lm_head=head, num_blocks=24, max_num_seqs=2))
    assert isinstance(engine.model.lm_head, quant.IntLinear) and engine.model.lm_head.bits == int(head[3:])
    outs = engine.generate(prompts, greedy, use_tqdm=False)
    assert [o.token_ids for o in outs] == [mi.generate_naive(model, p, greedy) for p in prompts]
    assert engine.block_manager.num_free_blocks == 24
    with pytest.raises(ValueError, match="quantize_lm_head is one process's option"):
        mi.EngineConfig(quantize_lm_head=head, tensor_parallel_size=2)


def test_the_lm_head_is_int8_by_default_beside_quantized_layers_in_one_process():
    """quantize_lm_head="auto": int8 where the layers are quantized on one process; kept as loaded where
    they are not, on split ranks, and when asked for None (the command line's "none")."""
    from miniinfer.cli import engine_config, engine_options
    assert mi.EngineConfig(quantization="int4").lm_head_format() == "int8"
    assert mi.EngineConfig().lm_head_format() is None
    assert mi.EngineConfig(quantization="int4", quantize_lm_head=None).lm_head_format() is None
    assert mi.EngineConfig(quantization="int8", tensor_parallel_size=2).lm_head_format() is None
    assert mi.EngineConfig(quantize_lm_head="int4").lm_head_format() == "int4"
    parser = argparse.ArgumentParser()
    engine_options(parser)
    assert engine_config(parser.parse_args(["--quantization", "int4", "--quantize-lm-head", "none"])).lm_head_format() \
        is None
    assert engine_config(parser.parse_args(["--quantization", "int4"])).lm_head_format() == "int8"
    engine = mi.LLMEngine(mi.EngineConfig(quantization="int8", quantize_lm_head=None, num_blocks=8))
    assert not isinstance(engine.model.lm_head, quant.IntLinear)


@pytest.mark.parametrize("scheme", ["int4", "fp8"])
def test_fused_ops_send_quantized_decode_steps_through_their_gemv(monkeypatch, scheme):
    """With the Triton GEMVs (as on a GPU; the prefill's matmuls stay PyTorch's here, to be quick) and
    chapter 06's fused ops, a one-row step's projections go through the int or fp8 GEMV (the norm
    before it, SiLU inside gate/up's); the tokens stay the PyTorch path's."""
    from miniinfer.kernels import quant as kq

    class GemvOnly(quant.QuantKernels):
        int_gemv = kq.TritonQuantKernels.int_gemv
        fp8_gemv = kq.TritonQuantKernels.fp8_gemv

    model = quant.quantize_model(mi.load_model(), scheme)
    prompt, greedy = [5, 17, 200, 3, 99], mi.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    ref = mi.generate_cached(model, prompt, greedy)
    calls = []
    name = "int_gemv" if scheme == "int4" else "fp8_gemv"
    original = getattr(kq, name)
    monkeypatch.setattr(kq, name, lambda *a, **k: calls.append(k) or original(*a, **k))
    monkeypatch.setitem(quant.QUANT_KERNELS, "torch", GemvOnly())
    assert mi.generate_cached(model.use_ops("fused"), prompt, greedy) == ref
    assert any(k.get("gated") for k in calls) and any(not k.get("gated") for k in calls)  # gate/up, and the rest


def test_gptq_beats_round_to_nearest_on_correlated_inputs():
    torch.manual_seed(0)
    w = torch.randn(48, 256)
    x = torch.randn(1000, 256) @ (torch.randn(256, 256) * 0.3 + torch.eye(256))
    errors = []
    for codes, scale in (quant.quantize_int(w, 4, 128), quant.gptq(w, x.T @ x, 4, 128)):
        assert codes.min() >= -8 and codes.max() <= 7
        errors.append((x @ (quant.dequantize(quant.pack(codes, 4), scale, 4) - w).T).norm().item())
    assert errors[1] < 0.8 * errors[0]


def test_gptq_model_runs_in_the_engine():
    model = mi.load_model()
    calibration = [torch.randint(0, 4096, (1, 64)) for _ in range(2)]
    quant.quantize_model(model, "int4", calibration)
    assert isinstance(model.model.layers[0].mlp.down_proj, quant.IntLinear)
    greedy = mi.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine = mi.LLMEngine(mi.EngineConfig(num_blocks=16), model=model)
    assert engine.generate([[1, 2, 3]], greedy, use_tqdm=False)[0].token_ids == mi.generate_naive(model, [1, 2, 3],
                                                                                                   greedy)


def test_fp8_pool_saturates_and_holds_twice_the_blocks_of_bf16():
    fp8 = torch.float8_e4m3fn
    k_cache, v_cache = torch.zeros(2, 4, 1, 2, dtype=fp8), torch.zeros(2, 4, 1, 2, dtype=fp8)
    k = torch.tensor([[[1000.0, -0.3]]])
    mi.store_kv_ref(k, -k, k_cache, v_cache, torch.tensor([5]))
    assert k_cache.flatten(0, 1)[5].float().tolist() == [[448.0, -0.3125]]
    assert v_cache.flatten(0, 1)[5].float().tolist() == [[-448.0, 0.3125]]
    bf16 = mi.LLMEngine(mi.EngineConfig(kv_cache_dtype=torch.bfloat16)).block_manager.num_blocks
    assert mi.LLMEngine(mi.EngineConfig(kv_cache_dtype="fp8")).block_manager.num_blocks == 2 * bf16


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_fp8_kv_cache_paths_agree(mode):
    """Every path over an e4m3 pool gives the tokens of one request alone: batching, preemption (a pool
    of 10 blocks for 3 requests), chunked prefill and prefix caching."""
    greedy = mi.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [list(range(10, 50)), list(range(10, 40)) + [7, 8], [99] * 20]
    alone = [mi.LLMEngine(mi.EngineConfig(kv_cache_dtype="fp8", num_blocks=32)).generate([p], greedy, use_tqdm=False)
             [0].token_ids for p in prompts]
    engine = mi.LLMEngine(mi.EngineConfig(kv_cache_dtype="fp8", num_blocks=10, block_size=8, preemption_mode=mode,
                                          enable_prefix_caching=True, enable_chunked_prefill=True,
                                          max_num_batched_tokens=24, max_model_len=64))
    assert [o.token_ids for o in engine.generate(prompts, greedy, use_tqdm=False)] == alone
    assert engine.block_manager.num_free_blocks == 10
