"""Layers that replace the model's own when a feature asks: quantized linear layers (chapter 10) and
tensor-parallel ones (chapter 11), all loaded through the model's `load_weight` hook.

Hand-written module: its submodules load when first named (`miniinfer.layers.<module>`)."""

from miniinfer import submodules

__getattr__ = submodules(__name__)
