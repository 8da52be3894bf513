# `make demo` and `make test` each create .venv when it is missing and install what they need.
# `make test` also runs the suite once in .venv-floor, on the oldest versions pyproject.toml
# declares (.ci/floor.txt), without the notebooks and docs tests: those check the docs and
# notebooks, not the library's compatibility, and would double the time.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
FLOOR := .venv-floor
PYTEST_ARGS ?=
FLOOR_PYTEST_ARGS ?= --ignore=tests/test_notebooks.py --ignore=tests/test_docs_examples.py \
	--ignore=tests/test_docs_site.py
# The first run keeps XLA's defaults, which users and the benchmarks run with. The floor run
# checks compatibility with the oldest versions, not XLA's code generation, and compiling is most
# of its time: it compiles at LLVM's optimization level 0, with XLA:CPU's loop emitters instead
# of its fusion emitters, and hands LLVM each module in one piece (no parallel codegen beside
# pytest's two workers). Measured: the floor run 1870 -> 1186 s, every test passing; on every
# transform, 4 steps alone and chained with adam, float32 outputs within 3e-7 of each leaf's
# largest value under the defaults, bfloat16 outputs and NaNs the same; the cost tests' kernel
# and pass counts the same. (conftest.py adds the 8 host devices.)
FLOOR_XLA_FLAGS ?= --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false \
	--xla_cpu_parallel_codegen_split_count=1
LINTED := optclip tests benchmarks examples

.PHONY: demo test docs bench bench-device bench-docs lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test,docs,demo]'
	touch $@

$(FLOOR)/bin/python:
	$(PYTHON) -m venv $(FLOOR)
	$(FLOOR)/bin/python -m pip install -q --upgrade pip

$(FLOOR)/.installed: pyproject.toml .ci/floor.txt | $(FLOOR)/bin/python
	$(FLOOR)/bin/python -m pip install -q -c .ci/floor.txt -e '.[test,demo]'
	$(FLOOR)/bin/python -c "import importlib.metadata as m; \
	  pins = [l.strip().split('==') for l in open('.ci/floor.txt') if l[0].isalpha()]; \
	  wrong = [(n, v, m.version(n)) for n, v in pins if m.version(n) != v]; \
	  assert not wrong, f'not the floor versions: {wrong}'"
	touch $@

$(VENV)/.installed-demo: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[demo]'
	touch $@

demo: $(VENV)/.installed-demo
	$(BIN)/python examples/char_transformer_demo.py $(DEMO_ARGS)

test: $(VENV)/.installed-test $(FLOOR)/.installed
	$(BIN)/ruff check $(LINTED)
	@# tests/test_docs_site.py looks at a built page in headless Chromium (Debian's package).
	@command -v chromium >/dev/null 2>&1 || { SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && \
		$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }
	$(BIN)/mkdocs build --strict --quiet --site-dir $(VENV)/site
	OPTCLIP_DOCS_SITE=$(VENV)/site $(BIN)/python -m pytest -n 2 $(PYTEST_ARGS)
	@echo "== the suite on the oldest supported versions (.ci/floor.txt)"
	XLA_FLAGS="$(FLOOR_XLA_FLAGS)" $(FLOOR)/bin/python -m pytest -n 2 -q $(FLOOR_PYTEST_ARGS) \
		$(PYTEST_ARGS)

docs: $(VENV)/.installed-test
	$(BIN)/mkdocs build --strict --site-dir site

# Every transform: compile and step ratios against adam, state bytes; writes
# benchmarks/results.json and (full runs) docs/benchmarks.md. BENCH_ARGS=--quick for a smoke run;
# BENCH_ARGS="--only NAME... --skip-global --update" re-measures a few rows of the last full run.
bench: $(VENV)/.installed-test
	$(BIN)/python benchmarks/bench_clip.py $(BENCH_ARGS)

# On a machine whose JAX device is a GPU (with jax[cuda] installed): memory bandwidth reached
# and chain(T, adam) / adam per step; writes benchmarks/results_device.json, which the page shows.
bench-device: $(VENV)/.installed-test
	$(BIN)/python benchmarks/bench_device.py --all $(BENCH_ARGS)

# Rebuild docs/benchmarks.md from the last benchmarks/results.json (and results_device.json).
bench-docs: $(VENV)/.installed-test
	$(BIN)/python benchmarks/bench_clip.py --render benchmarks/results.json

lint: $(VENV)/.installed-test
	$(BIN)/ruff check $(LINTED)

clean:
	rm -rf $(VENV) $(FLOOR) site
