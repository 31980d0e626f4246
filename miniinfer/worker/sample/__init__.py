"""Choosing the next token: the batched sampler (chapter 06), and the logits processors that change or
score the logits first (chapter 12: penalties and filters, log-probabilities).

Hand-written module: its submodules load when first named (`miniinfer.worker.sample.<module>`)."""

from miniinfer import submodules

__getattr__ = submodules(__name__)
