"""Parity of the from-scratch model and naive decoding with Hugging Face transformers."""

import pytest
import torch

import miniinfer as mi
from miniinfer.course.parity import hf_greedy


def test_logits_match_transformers(hf_checkpoint):
    kind, folder, hf = hf_checkpoint
    model = mi.load_model(folder)
    ids = torch.randint(0, 301, (3, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert ours.shape == theirs.shape == (3, 37, 301)
    rel = (ours - theirs).norm() / theirs.norm()
    assert rel < 1e-4, f"{kind}: relative error {rel:.2e}"


def test_greedy_naive_matches_transformers(hf_checkpoint):
    kind, folder, hf = hf_checkpoint
    model = mi.load_model(folder)
    prompt = [5, 17, 200, 3, 99, 42, 7]
    ours = mi.generate_naive(model, prompt, mi.SamplingParams(temperature=0, max_tokens=32,
                                                              ignore_eos=True))
    assert ours == hf_greedy(hf, prompt)


def test_course_model_matches_transformers():
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(mi.course_model_path(), dtype=torch.float32).eval()
    model, tok = mi.load_model(), mi.load_tokenizer()
    prompt = tok("import os\n").input_ids
    with torch.no_grad():
        x = torch.tensor([prompt])
        rel = (model(x) - hf(x).logits).norm() / hf(x).logits.norm()
    assert rel < 1e-4
    ours = mi.generate_naive(model, prompt, mi.SamplingParams(temperature=0, max_tokens=32,
                                                              ignore_eos=True))
    assert ours == hf_greedy(hf, prompt)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_loads_and_runs(hf_checkpoint, dtype):
    _, folder, _ = hf_checkpoint
    model = mi.load_model(folder, dtype=dtype)
    assert all(p.dtype == dtype for p in model.parameters())
    ref = mi.load_model(folder)
    ids = torch.arange(20)[None]
    with torch.no_grad():
        rel = (model(ids).float() - ref(ids)).norm() / ref(ids).norm()
    assert rel < 5e-2


def test_batched_forward_equals_single_rows(hf_checkpoint):
    _, folder, _ = hf_checkpoint
    model = mi.load_model(folder)
    ids = torch.randint(0, 301, (4, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        batched = model(ids)
        rows = torch.cat([model(ids[i:i + 1]) for i in range(4)])
    torch.testing.assert_close(batched, rows, rtol=1e-5, atol=1e-5)


def test_rope_scaling_changes_frequencies():
    base = mi.model.transformer.rope_inv_freq(64, 500000.0)
    scaled = mi.model.transformer.rope_inv_freq(64, 500000.0, {"rope_type": "llama3", "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 8192})
    assert torch.equal(scaled[:4], base[:4])  # high frequencies unchanged
    torch.testing.assert_close(scaled[-1], base[-1] / 8)  # the longest wavelengths divided by factor
    with pytest.raises(ValueError, match="unsupported rope scaling 'longrope'"):
        mi.model.transformer.rope_inv_freq(64, 1e4, {"rope_type": "longrope", "factor": 4.0})


@pytest.mark.parametrize("params", [  # DeepSeek-V2-Lite's (the attention factor 1), and one where it is not
    dict(factor=40.0, mscale=0.707, mscale_all_dim=0.707, beta_fast=32, beta_slow=1,
         original_max_position_embeddings=4096),
    dict(factor=4.0, mscale=1.0, mscale_all_dim=0.8, original_max_position_embeddings=512)])
def test_yarn_equals_transformers(params):
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = dict(rope_type="yarn", rope_theta=10000.0, **params)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](DeepseekV3Config(qk_rope_head_dim=64, rope_parameters=rope))
    ours, our_factor = mi.model.transformer.yarn(64, 10000.0, rope)
    torch.testing.assert_close(ours, inv_freq)
    assert our_factor == pytest.approx(factor)


def test_unsupported_architecture_is_named():
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        mi.ModelConfig.from_hf({"model_type": "gpt2"})
