"""Every figure in the prose is traceable (tools/provenance.py): each number with a unit or an x in the
lessons' markdown, README.md and docs/benchmarks/LEDGER.md comes from a stored output, a JSON key,
arithmetic on traced figures of its passage or a command-line default, or says it is not a stored
measurement; docs/provenance.md, which lists those and every sentence that promises work, is current."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import provenance  # noqa: E402


def test_every_figure_in_the_prose_is_traced():
    figures, _ = provenance.audit()
    assert [f"{f.where}: {f.text}" for f in figures if not f.source] == []


def test_the_provenance_report_is_current():
    """A new promise ("to come", "not yet", ...) or figure declared unstored changes the report: read
    the list again and regenerate it with `python tools/provenance.py`."""
    assert (ROOT / "docs" / "provenance.md").read_text() == provenance.report()


def test_a_figure_is_traced_only_where_its_source_holds_it():
    json_cited = "At the copy bandwidth (`copy_GBps` in `attention_h200.json`) of {} GB/s"
    assert provenance.trace("4,281", "GB/s", json_cited.format("4,281"), "", None)
    assert not provenance.trace("4,381", "GB/s", json_cited.format("4,381"), "", None)
    assert not provenance.trace("4,281", "GB/s", "At the copy bandwidth of 4,281 GB/s", "", None)
    ratio = "488 against 108 tokens/s: 4.5x"
    assert provenance.traced_as_ratio("4.5", ratio) and not provenance.traced_as_ratio("5.5", ratio)
