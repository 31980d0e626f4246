"""Shared fixtures: small random Hugging Face checkpoints of each supported architecture."""

import contextlib
import os
import sys

import pytest
import torch

# Triton must see TRITON_INTERPRET before it is first imported (see miniinfer/__init__.py).
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers.utils import logging as hf_logging  # noqa: E402

# `make test` runs two pytest workers on two cores: with torch's default of a thread per core each,
# four threads contend for two cores, and the engine tests' many small steps run several times slower.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

hf_logging.disable_progress_bar()
hf_logging.set_verbosity_error()

# Odd sizes and grouped-query attention everywhere: shapes that powers of two would hide.
COMMON = dict(vocab_size=301, hidden_size=72, intermediate_size=100, num_hidden_layers=2,
              num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
              tie_word_embeddings=False, rms_norm_eps=1e-5)
SHAPES = {
    "llama": dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
                                   "rope_theta": 500000.0}),
    "qwen2": dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen3": dict(head_dim=20, tie_word_embeddings=True),  # head_dim != hidden / heads, q/k norm
}


def make_hf_model(kind: str, **overrides):
    """A random-init transformers model of the given architecture (float32, eval mode)."""
    import transformers

    cls = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[kind]
    config = getattr(transformers, f"{cls}Config")(**{**COMMON, **SHAPES[kind], **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, f"{cls}ForCausalLM")(config).eval()
    with torch.no_grad():  # random biases and norm weights, so that a missed one shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
    return model


@pytest.fixture(scope="session", params=list(SHAPES))
def hf_checkpoint(request, tmp_path_factory):
    """(kind, folder, hf_model) for each architecture, saved with save_pretrained."""
    return saved(request.param, make_hf_model(request.param), tmp_path_factory)


def saved(kind: str, model, tmp_path_factory):
    """(kind, folder, model): the model written by save_pretrained into a fresh folder."""
    folder = tmp_path_factory.mktemp(kind)
    model.save_pretrained(folder)
    return kind, folder, model


def hf_greedy(hf, prompt: list[int], n: int = 32) -> list[int]:
    """The oracle: n greedy tokens from transformers' generate, EOS ignored."""
    return hf.generate(torch.tensor([prompt], device=hf.device), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False)[0, len(prompt):].tolist()


@contextlib.contextmanager
def eos_is(model, token: int, engine=None):
    """Pretend `token` is the model's end-of-sequence token (and its engine's), for stopping tests."""
    holders = [model.cfg] + ([engine.scheduler] if engine is not None else [])
    saved = [h.eos_token_ids for h in holders]
    for h in holders:
        h.eos_token_ids = [token]
    try:
        yield
    finally:
        for h, ids in zip(holders, saved):
            h.eos_token_ids = ids


def unchanged_on_error(snapshot, fn, *args):
    """Call fn(*args); if it raises a documented error, snapshot() must be exactly as before."""
    from miniinfer.core.block_manager import OutOfBlocks

    before = snapshot()
    try:
        return fn(*args)
    except (OutOfBlocks, KeyError, ValueError):
        assert snapshot() == before, f"{fn.__name__}{args} failed but changed the state"


@pytest.fixture(scope="session")
def course_model():
    """The embedded course model, loaded once for the tests that serve it."""
    import miniinfer as mi

    return mi.load_model(None)
