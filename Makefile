# make lab          set up .venv and open the course in JupyterLab (your copies, in workspace/)
# make reset NB=05  take a fresh copy of chapter 05 (yours moves to workspace/backup/)
# make test         set up .venv and run every check CI runs
# make grade SUBMISSIONS=folder   grade students' problem sets into grades.csv (see docs/instructor.md)
# make demo         complete a prompt with the embedded course model
# make coverage     the tests' line coverage of miniinfer/ (a table, and coverage.json)
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NOTEBOOKS := notebooks/*.ipynb solutions/*.ipynb exercises/*.ipynb
# Without an NVIDIA GPU, PyTorch's CPU build: about 2.5 GB in .venv instead of 6 (CUDA libraries).
# `make TORCH_INDEX= lab` takes PyPI's default build instead. One retry, not pip's five: where the index
# cannot be reached, each of torch's ten requirements would wait out five backoffs (75 s in all).
TORCH_INDEX ?= $(if $(shell command -v nvidia-smi),,https://download.pytorch.org/whl/cpu)
LAB_ARGS ?=
GRADES ?= grades.csv
JOBS ?= 1
TIMEOUT ?= 600

.PHONY: install lab reset test coverage grade demo export exercises clean

install: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(if $(TORCH_INDEX),$(PY) -m pip install torch --retries 1 --index-url $(TORCH_INDEX) || echo "no CPU build of torch from $(TORCH_INDEX): PyPI's default follows")
	$(PY) -m pip install -e ".[dev]"
	touch $@

lab: $(STAMP)
	$(PY) tools/lab.py start $(LAB_ARGS)

reset:
	@test -n "$(NB)" || { echo "usage: make reset NB=05"; exit 2; }
	python3 tools/lab.py reset $(NB)

# Three pytest workers on two cores, one thread each: PyTorch's two OpenMP threads a process would
# oversubscribe the cores and spin (problem set 09's last part, twice at once: 54 s each, 11 s so), while
# a third worker fills the time the others spend waiting on servers, kernels and timeouts (a fresh
# clone's tests: 16 min 44 s against 18 min 29 s with two).
test: $(STAMP)
	$(PY) -m ruff check
	$(PY) -m mypy miniinfer
	$(PY) tools/build.py export --check
	$(PY) tools/build.py exercises --check
	$(PY) -m nbstripout --verify --keep-output --keep-count $(NOTEBOOKS)
	OMP_NUM_THREADS=1 $(PY) -m pytest --nbval -n 3 --dist loadfile --no-loadscope-reorder --durations=25

# The unit tests alone (the notebooks run the same code through the package). Lines run in the tests'
# own processes count; those run only in the engine's or the ranks' processes (the server's engine,
# tensor parallelism's workers) do not. docs/coverage.json keeps the totals and each module's share.
coverage: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --cov=miniinfer --cov-report=term:skip-covered \
		--cov-report=json:coverage.json tests/
	$(PY) -c 'import json; c = json.load(open("coverage.json")); json.dump({"totals": c["totals"], "files": \
		{f: round(v["summary"]["percent_covered"], 1) for f, v in c["files"].items()}}, \
		open("docs/coverage.json", "w"), indent=1)'

grade: $(STAMP)
	@test -n "$(SUBMISSIONS)" || { echo "usage: make grade SUBMISSIONS='folder or notebooks' [JOBS=2] [TIMEOUT=600] [GRADES=grades.csv]"; exit 2; }
	$(PY) -m miniinfer grade $(SUBMISSIONS) --out $(GRADES) --jobs $(JOBS) --timeout $(TIMEOUT)

demo: $(STAMP)
	$(PY) -m miniinfer generate $$'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'

# After editing a lesson or a solution notebook:
export: $(STAMP)
	$(PY) tools/build.py export

exercises: $(STAMP)
	$(PY) tools/build.py exercises

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info  # never workspace/: it holds the student's work
