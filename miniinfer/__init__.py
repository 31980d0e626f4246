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

from miniinfer import (
    parallel,  # noqa: E402,F401  (registers the tensor-parallel runner)
    processors,  # noqa: E402,F401  (registers the penalties and filters)
    quant,  # noqa: E402,F401  (registers the quantization methods)
    testing,  # noqa: E402
)
from miniinfer.async_engine import AsyncLLMEngine  # noqa: E402
from miniinfer.block_manager import BlockCopy, BlockManager, OutOfBlocks, draw_pool, replay  # noqa: E402
from miniinfer.config import EngineConfig  # noqa: E402
from miniinfer.course_model import course_model_path  # noqa: E402
from miniinfer.detokenize import IncrementalDetokenizer  # noqa: E402
from miniinfer.engine import LLMEngine, StepStats  # noqa: E402
from miniinfer.generate import generate_naive  # noqa: E402
from miniinfer.loader import CheckpointError, load_model, load_tokenizer  # noqa: E402
from miniinfer.model import ModelConfig, Transformer  # noqa: E402
from miniinfer.paged_cache import (  # noqa: E402
    PAGED_BACKENDS,
    PagedKVCache,
    gather_kv,
    generate_paged,
    paged_attention_ref,
    paged_utilization,
    slot_mapping,
)
from miniinfer.prefix_cache import PrefixCachingBlockManager, chain_hash  # noqa: E402
from miniinfer.radix import RadixTree  # noqa: E402
from miniinfer.sampler import SamplingBatch, sample_batch  # noqa: E402
from miniinfer.sampling import SamplingParams, StructuredOutput, sample  # noqa: E402
from miniinfer.scheduler import POLICIES, NewRequest, Scheduler, SchedulerOutput, SchedulingPolicy  # noqa: E402
from miniinfer.sequence import RequestDataError, RequestOutput, Sequence, Status  # noqa: E402
from miniinfer.speculative import DraftProposer, NgramProposer, Proposer, SpeculativeRunner  # noqa: E402
from miniinfer.static_cache import (  # noqa: E402
    StaticBatchGenerator,
    StaticKVCache,
    benchmark_lengths,
    generate_cached,
    generate_static_batch,
    left_pad,
    static_batch_waste,
    static_utilization,
    write_kv,
)
from miniinfer.timeline import StepRecord, draw_timeline, trace_steps  # noqa: E402
from miniinfer.varlen import VarlenBatch, VarlenKVCache, prefill_attention_ref, store_kv_ref  # noqa: E402

try:  # Triton ships for Linux only; elsewhere the PyTorch ops serve
    from miniinfer import kernels  # noqa: E402,F401  (registers the Triton ops and attention kernels)
except ImportError:
    pass

__all__ = ["PAGED_BACKENDS", "BlockCopy", "BlockManager", "CheckpointError", "OutOfBlocks", "PagedKVCache",
           "draw_pool", "gather_kv", "generate_paged", "paged_attention_ref", "paged_utilization",
           "replay", "slot_mapping", "ModelConfig", "SamplingParams", "StructuredOutput", "StaticBatchGenerator",
           "StaticKVCache", "Transformer",
           "benchmark_lengths", "course_model_path", "generate_cached", "generate_naive",
           "generate_static_batch", "left_pad", "load_model", "load_tokenizer", "sample",
           "static_batch_waste", "static_utilization", "testing", "write_kv", "VarlenBatch", "VarlenKVCache",
           "prefill_attention_ref", "store_kv_ref", "EngineConfig", "LLMEngine", "StepStats", "SamplingBatch",
           "sample_batch",
           "POLICIES", "NewRequest", "Scheduler", "SchedulerOutput", "SchedulingPolicy", "RequestDataError",
           "RequestOutput", "Sequence",
           "Status",
           "StepRecord", "draw_timeline", "trace_steps", "PrefixCachingBlockManager",
           "chain_hash", "RadixTree", "IncrementalDetokenizer",
           "AsyncLLMEngine", "DraftProposer", "NgramProposer", "Proposer", "SpeculativeRunner"]
