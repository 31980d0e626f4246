"""miniinfer: an LLM inference engine built step by step in the course notebooks.

Hand-written module: it gathers the public API from the modules the notebooks export.
"""

import os
import sys

import torch

# Triton reads TRITON_INTERPRET when it is first imported: on a machine without CUDA its kernels
# can then still run (slowly) on the CPU. An explicit setting by the user wins.
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from miniinfer import testing  # noqa: E402
from miniinfer.course_model import course_model_path  # noqa: E402
from miniinfer.generate import generate_naive  # noqa: E402
from miniinfer.loader import CheckpointError, load_model, load_tokenizer  # noqa: E402
from miniinfer.model import ModelConfig, Transformer  # noqa: E402
from miniinfer.sampling import SamplingParams, sample  # noqa: E402

__all__ = ["CheckpointError", "ModelConfig", "SamplingParams", "Transformer", "course_model_path",
           "generate_naive", "load_model", "load_tokenizer", "sample", "testing"]
