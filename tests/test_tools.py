"""tools/benchlib.py: the header and the result file every bench script writes through, and that no
script keeps a header or a timer of its own."""

import json
import os
import re
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent.parent / "tools"
sys.path.insert(0, str(TOOLS))

import benchlib  # noqa: E402
import pytest  # noqa: E402


def test_the_header_names_the_machine_and_the_versions_on_a_cpu_too():
    h = benchlib.header(rows=256)
    assert h["gpu"] is None and h["gpus"] == 0  # CI has no GPU
    assert h["torch"] and h["transformers"] and h["python"].count(".") == 2
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", h["date"]) and h["rows"] == 256
    assert h["cpu"].endswith(f"{os.cpu_count()} cores") and h["load_1min"] >= 0
    assert benchlib.version("no-such-package-anywhere") is None


def test_a_result_file_keeps_the_parts_of_earlier_runs_and_saves_each_part_as_it_ends(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"matrix": {"plain": 1.0}, "date": "2020-01-01"}))
    results = benchlib.Results(path, copy_GBps=3000.0)
    assert results.data["matrix"] == {"plain": 1.0} and results.data["copy_GBps"] == 3000.0
    assert json.loads(path.read_text())["date"] == "2020-01-01"  # nothing written before a part ends
    save = results.saver("batch1")
    assert save({"bf16": 0.97}) == {"bf16": 0.97}
    on_disk = json.loads(path.read_text())
    assert on_disk["batch1"] == {"bf16": 0.97} and on_disk["matrix"] == {"plain": 1.0}
    assert on_disk["date"] != "2020-01-01" and on_disk["copy_GBps"] == 3000.0


def test_no_tool_writes_its_own_header_or_times_with_its_own_timer():
    """The versions come from benchlib.header, GPU times from benchlib.gpu_ms / graph_ms."""
    own = {p.name: [pattern for pattern in (r"torch\.__version__", r"import do_bench", r"\bdo_bench\(")
                    if re.search(pattern, p.read_text())]
           for p in TOOLS.rglob("*.py") if p.name != "benchlib.py"}
    assert {name: found for name, found in own.items() if found} == {}


def test_a_tools_command_line_runs_the_command_named_with_its_arguments(monkeypatch):
    ran = []
    fns = {"run": lambda out, *parts: ran.append((out, parts)), "plot": lambda path: ran.append(path)}
    monkeypatch.setattr(sys, "argv", ["bench_x.py", "run", "out.json", "matrix", "batch1"])
    benchlib.commands(**fns)
    monkeypatch.setattr(sys, "argv", ["bench_x.py", "plot", "out.json"])
    benchlib.commands(**fns)
    assert ran == [("out.json", ("matrix", "batch1")), "out.json"]
    monkeypatch.setattr(sys, "argv", ["bench_x.py", "rnu", "out.json"])
    with pytest.raises(SystemExit, match=r"unknown command 'rnu'.*\n.*run OUT \[PARTS\.\.\.\]\n.*plot PATH"):
        benchlib.commands(**fns)


def test_no_tool_reads_its_command_line_by_hand():
    """Commands go through benchlib.commands (or argparse, for options): no tool reads sys.argv itself
    but benchlib, sample_stacks (it runs another program under that program's command line) and
    provenance (a check of the docs that imports no torch, its one argument the report's path)."""
    own = {"benchlib.py", "sample_stacks.py", "provenance.py"}
    by_hand = [p.name for p in TOOLS.rglob("*.py") if "sys.argv" in p.read_text() and p.name not in own]
    assert by_hand == []
