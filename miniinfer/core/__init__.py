"""The engine's ground floor, plain Python over plain data: sampling parameters, a request's state,
the block manager (and its prefix cache), the scheduler with its token budget, the engine's config.

Hand-written module: its submodules load when first named (`miniinfer.core.<module>`)."""

from miniinfer import submodules

__getattr__ = submodules(__name__)
