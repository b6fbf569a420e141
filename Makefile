# make demo : set up .venv from a clean clone and run the main job
# make test : set up .venv and run the whole test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test venv bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/planner demo

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/published_runs.py
	$(PY) benchmarks/layout_search.py
	$(PY) benchmarks/checkpoint_io.py
	$(PY) benchmarks/clustering_quality.py
	$(PY) benchmarks/rl_harness.py

clean:
	rm -rf $(VENV) build *.egg-info
