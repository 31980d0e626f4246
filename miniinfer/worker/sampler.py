"""Hand-written, not from a notebook: chapter 06's sampler moved to `miniinfer.worker.sample.sampler`
on 2026-12-06. This name stays so that problem sets copied into a workspace before then (their given
code says `mi.worker.sampler`), and submissions graded from them, still run.

Hand-written module (chapter 06)."""

from miniinfer.worker.sample import sampler as _moved


def __getattr__(name: str):
    return getattr(_moved, name)
