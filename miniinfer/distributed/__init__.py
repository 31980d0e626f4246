"""What crosses processes: chapter 15's transfer of a request's K/V blocks between two engines (the
blocks gathered into one message, the link between the engines' processes).

Hand-written module: its submodules load when first named (`miniinfer.distributed.<module>`)."""

from miniinfer import submodules

__getattr__ = submodules(__name__)
