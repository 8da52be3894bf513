# `make demo` and `make test` each create .venv when it is missing and install what they need.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: demo test docs bench bench-docs lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test,docs,demo]'
	touch $@

$(VENV)/.installed-demo: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[demo]'
	touch $@

demo: $(VENV)/.installed-demo
	$(BIN)/python -m optclip.demo $(DEMO_ARGS)

test: $(VENV)/.installed-test
	$(BIN)/ruff check optclip tests benchmarks
	@if [ -f mkdocs.yml ]; then $(BIN)/mkdocs build --strict --quiet --site-dir $(VENV)/site; fi
	$(BIN)/python -m pytest -n 2 $(PYTEST_ARGS)

docs: $(VENV)/.installed-test
	$(BIN)/mkdocs build --strict --site-dir site

# Every transform: compile and step ratios against adam, state bytes; writes
# benchmarks/results.json and (full runs) docs/benchmarks.md. BENCH_ARGS=--quick for a smoke run.
bench: $(VENV)/.installed-test
	$(BIN)/python benchmarks/bench_clip.py $(BENCH_ARGS)

# Rebuild docs/benchmarks.md from the last benchmarks/results.json.
bench-docs: $(VENV)/.installed-test
	$(BIN)/python benchmarks/bench_clip.py --render benchmarks/results.json

lint: $(VENV)/.installed-test
	$(BIN)/ruff check optclip tests benchmarks

clean:
	rm -rf $(VENV) site
