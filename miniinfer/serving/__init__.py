"""The OpenAI-compatible HTTP server, its request schema, the `miniinfer` command and the load generator.

Hand-written module: its submodules load when first named (`miniinfer.serving.<module>`)."""

from miniinfer import submodules

__getattr__ = submodules(__name__)
