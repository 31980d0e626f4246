"""The engine: LLMEngine (schedule, execute, update), its executors (a runner in this process, or a
worker process per rank), and the engine's loop in a process of its own with its clients.

Hand-written module: its submodules load when first named (`miniinfer.engine.<module>`)."""

from miniinfer import submodules

__getattr__ = submodules(__name__)
