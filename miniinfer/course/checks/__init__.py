"""Checks that exercise notebooks call: a student's answer against the reference, on random inputs.

Hand-written module: `harness.py` holds the registry (EXERCISES), `your_answers` and the comparison
on random inputs; `chNN.py` the checks of problem set NN. A notebook calls them by name
(`mi.course.checks.check_rms_norm(fn)`), a grader by exercise id (`EXERCISES["01.rms_norm"]`).
"""

from miniinfer.course.checks import (
    ch01,
    ch02,
    ch03,
    ch04,
    ch05,
    ch06,
    ch07,
    ch08,
    ch09,
    ch10,
    ch11,
    ch12,
    ch13,
    ch14,
    ch15,
    ch16,
    ch17,
    ch99,
    speed,
)
from miniinfer.course.checks.harness import (
    EXERCISES,
    AnswerError,
    Exercise,
    NotAnswered,
    device,
    last_failure,
    last_part,
    problem_set,
    your_answers,
)

CHAPTERS = (ch01, ch02, ch03, ch04, ch05, ch06, ch07, ch08, ch09, ch10, ch11, ch12, ch13, ch14, ch15, ch16, ch17, ch99)
__all__ = ["EXERCISES", "AnswerError", "Exercise", "NotAnswered", "device", "last_failure", "last_part",
           "problem_set", "speed", "your_answers"]


def __getattr__(name: str):
    """A check (or a chapter's helper, such as chapter 11's simulated_ranks) by its name alone."""
    for module in CHAPTERS:
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
