# Two commands on a fresh machine:
#   make demo   set up .venv, train a small transformer with ModelParallel
#               on 2 CPU processes, print losses, layouts and parity
#   make test   set up .venv, run lint, build the docs and run the whole
#               test suite
#   make docs   build the documentation site into site/ (--strict)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CI pins the exact versions; pyproject.toml declares the supported ranges.
PINS := torch==2.13.0 keras==3.15.1
# The tests also feed tf.data pipelines and TensorBoard (the `tf` extra), train keras_hub
# models (the `hub` extra); the demo needs neither.
TEST_PINS := tensorflow-cpu==2.21.0 tensorboard==2.21.0 keras-hub==0.32.0

# `make test-next`: the same suite on the next releases, in a venv of its own:
# Keras 3.16 (keras-nightly), keras-hub-nightly and torch 2.15.
NEXT_VENV := .venv-next
NEXT_BIN := $(NEXT_VENV)/bin
NEXT_PINS := torch==2.15.0 tensorflow-cpu==2.21.0 tensorboard==2.21.0 \
	keras-hub-nightly==0.33.0.dev202610250352
NEXT_KERAS := keras-nightly==3.16.0.dev2026102704
# Some machines cap torch below 2.15 with a constraints file in pip's own
# configuration; this venv's pip calls (and only they) read an empty one.
NEXT_PIP := PIP_CONSTRAINT=/dev/null $(NEXT_BIN)/pip

.PHONY: demo test test-next test-slow setup setup-test lint docs bench bench-report clean

setup: $(VENV)/.installed
setup-test: $(VENV)/.installed-test

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(PINS)
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install --quiet $(PINS) $(TEST_PINS) -e '.[test,tf,hub]'
	touch $@

$(VENV)/.installed-docs: $(VENV)/.installed
	$(BIN)/pip install --quiet $(PINS) -e '.[docs]'
	touch $@

demo: setup
	$(BIN)/keras-dtensor demo --nproc 2 --epochs 3

lint: setup
	$(BIN)/ruff check src tests benchmarks examples scripts
	$(BIN)/ruff format --check src tests benchmarks examples scripts

# Strict: a broken link or an unresolved API reference fails the build.
docs: $(VENV)/.installed-docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir site

test: setup-test lint docs
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q --durations=10 -m "not slow"

# tensorflow and keras-hub-nightly pull in `keras`, which owns the same keras/
# folder as keras-nightly: it is taken out, then keras-nightly put back whole.
$(NEXT_VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(NEXT_VENV)
	$(NEXT_PIP) install --quiet --upgrade pip
	$(NEXT_PIP) install --quiet $(NEXT_PINS) 'pytest>=8' 'ruff>=0.6'
	$(NEXT_PIP) uninstall --quiet --yes keras
	$(NEXT_PIP) install --quiet --no-deps --force-reinstall $(NEXT_KERAS)
	$(NEXT_PIP) install --quiet --no-deps -e .
	touch $@

test-next: $(NEXT_VENV)/.installed
	OMP_NUM_THREADS=1 $(NEXT_BIN)/python -m pytest -q --durations=10 -m "not slow"

# BENCHMARKS.md is generated from benchmarks/results*.json, never edited.
bench-report: setup
	$(BIN)/python benchmarks/report.py

test-slow: setup-test
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q --durations=10 -m slow

clean:
	rm -rf $(VENV) $(NEXT_VENV) build site *.egg-info src/*.egg-info .pytest_cache
