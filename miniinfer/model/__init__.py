"""The model: its config and the Llama-family transformer with its reference ops (chapter 01), the
loader of Hugging Face checkpoints, the naive generation loop, and the embedded course model.

Hand-written module: its submodules load when first named (`miniinfer.model.<module>`)."""

from miniinfer import submodules

__getattr__ = submodules(__name__)
