# make demo : set up .venv from a clean clone and run the main job (suggest, then the default report)
# make test : set up .venv and run the whole test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# verl's own shipped trainer config checks `planner export --to verl` (tests/test_trainers.py); only its
# YAML is read, so it is installed without its dependencies (ray, vllm, ...)
VERL   := verl==0.9.1
# older verl releases' wheels (their shipped configs only, read from the zip) check `export --to verl --verl-version`
VERL_OLD := verl==0.6.1 verl==0.7.1

.PHONY: demo test venv bench reports clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	$(PY) -m pip install --quiet --no-deps $(VERL)
	for v in $(VERL_OLD); do $(PY) -m pip download --quiet --no-deps -d $(VENV)/verl-wheels $$v; done
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/planner suggest --budget 8npu
	mkdir -p build
	$(VENV)/bin/planner report --budget 8npu -o build/demo-report --force

reports: $(STAMP)
	$(VENV)/bin/planner report --model qwen3-30b-a3b --hardware ascend-910b2 --budget 8npu -o reports/qwen3-30b-a3b-910b2 --force
	$(VENV)/bin/planner report --model deepseek-v3 --hardware atlas-a3 --budget 64npu -o reports/deepseek-v3-a3 --force

# one pytest worker per core, at most 8 (pytest-xdist): 8.6 minutes on 2 cores against 13.4 in one process
test: $(STAMP)
	$(PY) -m pytest -q -n auto --maxprocesses 8

bench: $(STAMP)
	$(PY) benchmarks/published_runs.py
	$(PY) benchmarks/layout_search.py
	$(PY) benchmarks/checkpoint_io.py
	$(PY) benchmarks/clustering_quality.py
	$(PY) benchmarks/rl_harness.py
	$(PY) benchmarks/suggest_search.py
	$(PY) benchmarks/check_memory.py

clean:
	rm -rf $(VENV) build *.egg-info
