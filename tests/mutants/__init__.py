"""Plausible wrong answers to every exercise of the problem sets, one module per chapter (`MUTANTS`:
the check and the wrong answer), each named (or documented) for its mistake. `tests/test_checks.py`
runs every one against its check, which must reject it; `python tests/mutants/report.py` writes the report
of which case of which check rejects each (docs/mutants.md)."""
