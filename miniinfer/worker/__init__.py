"""The device's side: the model runner (its KV cache, CUDA graphs, sampler and logits processors,
speculation's proposers), and the worker that holds one rank's runner.

Hand-written module: its submodules load when first named (`miniinfer.worker.<module>`)."""

from miniinfer import submodules

__getattr__ = submodules(__name__)
