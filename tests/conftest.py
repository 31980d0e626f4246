"""Shared fixtures: small random Hugging Face checkpoints of each supported architecture."""

import contextlib
import os
import sys
from pathlib import Path

import pytest
import torch

# Triton must see TRITON_INTERPRET before it is first imported (see miniinfer/__init__.py).
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers.utils import logging as hf_logging  # noqa: E402

# `make test` runs two pytest workers on two cores: with torch's default of a thread per core each,
# four threads contend for two cores, and the engine tests' many small steps run several times slower.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

hf_logging.disable_progress_bar()
hf_logging.set_verbosity_error()

from miniinfer.course.parity import SHAPES, make_hf_model  # noqa: E402

# `make test` hands each worker whole files (--dist loadfile) in this order: the longest first, so that none
# starts near the end while the other workers wait (xdist's own order, most tests first, left test_grade's
# 209 s and test_browser's 82 to the last minutes). Seconds per file in a fresh clone's run on two cores
# (2026-12-08, --junitxml): 360, 319, 209, 121, 120, 115, 103, 100, 88, 82, 77, 68; the rest keep their order.
LONGEST_FIRST = ["tests/test_checks.py", "tests/test_server.py", "tests/test_grade.py", "tests/test_speculative.py",
                 "tests/test_pipeline.py", "tests/test_persistent.py", "notebooks/16_scaling_out.ipynb",
                 "tests/test_attention.py", "tests/test_quant.py", "tests/test_browser.py", "tests/test_parallel.py",
                 "tests/test_data_parallel.py"]


ROOT = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(items):
    if gone := [path for path in LONGEST_FIRST if not (ROOT / path).exists()]:
        raise pytest.UsageError(f"tests/conftest.py's LONGEST_FIRST names files that are gone: {gone}")
    rank = {ROOT / path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path, len(LONGEST_FIRST)))  # stable: a notebook's cells stay in order


@pytest.fixture(scope="session", params=list(SHAPES))
def hf_checkpoint(request, tmp_path_factory):
    """(kind, folder, hf_model) for each architecture, saved with save_pretrained."""
    return saved(request.param, make_hf_model(request.param), tmp_path_factory)


def saved(kind: str, model, tmp_path_factory):
    """(kind, folder, model): the model written by save_pretrained into a fresh folder."""
    folder = tmp_path_factory.mktemp(kind)
    model.save_pretrained(folder)
    return kind, folder, model


@contextlib.contextmanager
def eos_is(model, token: int, engine=None):
    """Pretend `token` is the model's end-of-sequence token (and its engine's), for stopping tests."""
    holders = [model.cfg] + ([engine.scheduler] if engine is not None else [])
    saved = [h.eos_token_ids for h in holders]
    for h in holders:
        h.eos_token_ids = [token]
    try:
        yield
    finally:
        for h, ids in zip(holders, saved):
            h.eos_token_ids = ids


def unchanged_on_error(snapshot, fn, *args):
    """Call fn(*args); if it raises a documented error, snapshot() must be exactly as before."""
    from miniinfer.core.block_manager import OutOfBlocks

    before = snapshot()
    try:
        return fn(*args)
    except (OutOfBlocks, KeyError, ValueError):
        assert snapshot() == before, f"{fn.__name__}{args} failed but changed the state"


def started_below(pid: int) -> list:
    """The processes started below process pid for an engine (its ranks, its replicas), as psutil's. Without a
    GPU a process's children are forked by its fork server (chapter 08's process_context): left out are the
    server (started by a command line of its own, where a fork keeps its parent's) and the resource tracker."""
    import psutil

    def server(p) -> bool:
        line = p.cmdline()
        return "multiprocessing.forkserver" in " ".join(line) and line != p.parent().cmdline()

    return [p for p in psutil.Process(pid).children(recursive=True)
            if not server(p) and "multiprocessing.resource_tracker" not in " ".join(p.cmdline())]


@pytest.fixture(scope="session")
def course_model():
    """The embedded course model, loaded once for the tests that serve it."""
    import miniinfer as mi

    return mi.load_model(None)
