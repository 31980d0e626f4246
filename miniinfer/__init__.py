"""miniinfer: an LLM inference engine built step by step in the course notebooks.

Hand-written module: the public API, loaded lazily. Each name comes from the layer that defines it
when first used, so `mi.LLMEngine` loads the engine and not the server or the course's checks. The
layers, bottom up: kernels, model and layers, core, worker, engine, then serving and course on top.
"""

import importlib
import os
import sys

import torch

# Triton reads TRITON_INTERPRET when it is first imported: on a machine without CUDA its kernels
# can then still run (slowly) on the CPU. An explicit setting by the user wins.
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

LAYERS = ("kernels", "model", "layers", "core", "worker", "engine", "serving", "course")
# Each public name and the module it comes from.
PUBLIC = {
    **dict.fromkeys(["ModelConfig", "Transformer"], "model.transformer"),
    **dict.fromkeys(["CheckpointError", "load_model", "load_tokenizer", "read_config"], "model.loader"),
    "course_model_path": "model.course_model",
    "generate_naive": "worker.generate",
    **dict.fromkeys(["SamplingParams", "StructuredOutput", "sample"], "core.sampling_params"),
    **dict.fromkeys(["RequestDataError", "RequestOutput", "Sequence", "Status"], "core.sequence"),
    **dict.fromkeys(["BlockCopy", "BlockManager", "OutOfBlocks", "draw_pool", "replay"], "core.block_manager"),
    **dict.fromkeys(["PrefixCachingBlockManager", "chain_hash"], "core.prefix_cache"),
    **dict.fromkeys(["POLICIES", "NewRequest", "Scheduler", "SchedulerOutput", "SchedulingPolicy"], "core.scheduler"),
    "EngineConfig": "core.config",
    **dict.fromkeys(["PagedKVCache", "gather_kv", "paged_attention_ref", "paged_utilization", "slot_mapping"],
                    "worker.paged_cache"),
    **dict.fromkeys(["PAGED_BACKENDS", "generate_paged"], "worker.paged_generate"),
    **dict.fromkeys(["prefill_attention_ref", "store_kv_ref"], "worker.attention_ref"),
    **dict.fromkeys(["VarlenBatch", "VarlenKVCache"], "worker.kv_cache"),
    **dict.fromkeys(["SamplingBatch", "sample_batch"], "worker.sample.sampler"),
    **dict.fromkeys(["DraftProposer", "NgramProposer", "Proposer", "SpeculativeRunner"], "worker.speculative"),
    **dict.fromkeys(["LLMEngine", "StepStats"], "engine.llm_engine"),
    "AsyncLLMEngine": "engine.async_engine",
    **dict.fromkeys(["DisaggregatedConfig", "DisaggregatedEngine"], "engine.disaggregated"),
    "ReplicatedEngine": "engine.data_parallel",
    "IncrementalDetokenizer": "serving.detokenize",
    **dict.fromkeys(["StaticBatchGenerator", "StaticKVCache", "benchmark_lengths", "generate_cached",
                     "generate_static_batch", "left_pad", "static_batch_waste", "static_utilization", "write_kv"],
                    "course.static_cache"),
    **dict.fromkeys(["StepRecord", "draw_timeline", "trace_steps"], "course.timeline"),
    "RadixTree": "course.radix",
}
__all__ = sorted(PUBLIC)


def __getattr__(name: str):
    if name in PUBLIC:
        value = getattr(importlib.import_module(f"miniinfer.{PUBLIC[name]}"), name)
    elif name in LAYERS:
        value = importlib.import_module(f"miniinfer.{name}")
    else:
        raise AttributeError(f"module 'miniinfer' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *PUBLIC, *LAYERS])


def submodules(package: str):
    """A package's module `__getattr__` that imports its submodules when first named."""
    def getattr_(name: str):
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{package}.{name}":  # the submodule exists; something it imports does not
                raise
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
    return getattr_
