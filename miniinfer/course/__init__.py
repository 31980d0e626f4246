"""What the course adds around the engine: the exercise checks, the grader, reference generators
(the static KV cache), the radix tree and the step timeline.

Hand-written module: its submodules load when first named (`miniinfer.course.<module>`)."""

from miniinfer import submodules

__getattr__ = submodules(__name__)
