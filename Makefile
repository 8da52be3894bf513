# `make demo` and `make test` each create .venv when it is missing and install what they need.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: demo test docs bench lint clean

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
	@# tests/test_docs_site.py looks at a built page in headless Chromium (Debian's package).
	@command -v chromium >/dev/null 2>&1 || { SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && \
		$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }
	$(BIN)/mkdocs build --strict --quiet --site-dir $(VENV)/site
	OPTCLIP_DOCS_SITE=$(VENV)/site $(BIN)/python -m pytest -n 2 $(PYTEST_ARGS)

docs: $(VENV)/.installed-test
	$(BIN)/mkdocs build --strict --site-dir site

bench: $(VENV)/.installed-test
	$(BIN)/python benchmarks/bench_clip.py $(BENCH_ARGS)

lint: $(VENV)/.installed-test
	$(BIN)/ruff check optclip tests benchmarks

clean:
	rm -rf $(VENV) site
