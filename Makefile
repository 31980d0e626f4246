# make lab   set up .venv and open the course in JupyterLab
# make test  set up .venv and run every check CI runs
# make demo  complete a prompt with the embedded course model
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NOTEBOOKS := notebooks/*.ipynb solutions/*.ipynb exercises/*.ipynb

.PHONY: install lab test demo export exercises clean

install: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e ".[dev]"
	touch $@

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/

test: $(STAMP)
	$(PY) tools/build.py export --check
	$(PY) tools/build.py exercises --check
	$(PY) -m nbstripout --verify --keep-output --keep-count $(NOTEBOOKS)
	$(PY) -m pytest --nbval -n 2 --dist loadfile

demo: $(STAMP)
	$(PY) -m miniinfer generate $$'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'

# After editing a lesson or a solution notebook:
export: $(STAMP)
	$(PY) tools/build.py export

exercises: $(STAMP)
	$(PY) tools/build.py exercises

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
