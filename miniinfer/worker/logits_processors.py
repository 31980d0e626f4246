"""Hand-written, not from a notebook: chapter 12's logits processors moved on 2026-12-06, to
`miniinfer.worker.sample.processors` (penalties and filters), `miniinfer.worker.sample.logprobs` and
`miniinfer.worker.structured_output`. This name stays so that problem sets copied into a workspace
before then (their given code says `mi.worker.logits_processors`), and submissions graded from them,
still run.

Hand-written module (chapter 12)."""

from miniinfer.worker import structured_output as _structured
from miniinfer.worker.sample import logprobs as _logprobs
from miniinfer.worker.sample import processors as _processors


def __getattr__(name: str):
    for moved in (_processors, _logprobs, _structured):
        if hasattr(moved, name):
            return getattr(moved, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
