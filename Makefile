# Two commands do all set-up on a fresh machine:  make train  and  make test.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
WORKDIR ?= workdirs/default
CONFIG ?= configs/default.py

.PHONY: install lock lint train test test-fast durations docs clean

install: $(STAMP)

# The exact versions of requirements/lock.txt (CPU); LOCK=requirements/lock-cuda.txt or
# requirements/lock-tpu.txt for a GPU or a TPU (the same pins plus JAX's plugin; after an
# install for another lock, add -B). Reinstalls only when pyproject.toml or the lock
# changes; otherwise this takes a second. The package itself goes in editable, without
# resolving anything again, and without setuptools' warning on every editable install
# (that a folder named as the package in the working directory would shadow it: here
# that folder is the package); its other warnings and errors show.
LOCK ?= requirements/lock.txt
$(STAMP): pyproject.toml $(LOCK)
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11 or newer is needed, found " + sys.version.split()[0])'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r $(LOCK)
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q --no-deps -e .
	@touch $(STAMP)

# libtpu, the TPU compiler behind transformer/tools/compile_check.py (which compiles for a
# TPU slice on this machine) and its tests, at requirements/lock-tpu.txt's version (the one
# JAX expects). It goes in a folder of its own, .venv/libtpu, where JAX does not look: a
# libtpu JAX finds is loaded by every process, which then logs errors about the TPU it
# lacks and starts 0.6 s slower. compile_check alone loads it from there. Its wheel is for
# Linux x86-64 only; elsewhere the tests that need it are skipped and say why.
LIBTPU := $(VENV)/.libtpu-installed
$(LIBTPU): requirements/lock-tpu.txt | $(STAMP)
	@if [ "$$(uname -s)-$$(uname -m)" = Linux-x86_64 ]; then \
	  rm -rf $(VENV)/libtpu && \
	  $(PY) -m pip install -q --no-deps --target $(VENV)/libtpu \
	    "$$(grep '^libtpu==' requirements/lock-tpu.txt)" || exit 1; \
	else echo "libtpu has no wheel for $$(uname -s)-$$(uname -m): compile_check's tests skip"; fi
	@touch $(LIBTPU)

# Resolves pyproject.toml's dependencies again into the three locks, keeping every pin
# that still satisfies it (uv prefers the versions already in a lock). The GPU and TPU
# locks are constrained by the CPU one, so all three share every common version;
# requirements/constraints.txt holds back what it names in all three, and says why.
# UPGRADE=--upgrade moves everything to the newest versions allowed,
# UPGRADE="--upgrade-package jax --upgrade-package jaxlib" only those (docs/development.md).
UPGRADE ?=
LOCK_COMPILE = $(VENV)/bin/uv pip compile pyproject.toml --universal --quiet \
	--custom-compile-command "make lock" --extra test --extra dev --extra export \
	-c requirements/constraints.txt $(UPGRADE)
lock: install
	$(LOCK_COMPILE) -o requirements/lock.txt
	$(LOCK_COMPILE) --extra cuda -c requirements/lock.txt -o requirements/lock-cuda.txt
	$(LOCK_COMPILE) --extra tpu -c requirements/lock.txt -o requirements/lock-tpu.txt

# Trains the embedded default (or resumes it), then beam-searches the test split;
# the last line printed is its sacreBLEU.
train: install
	$(PY) train.py --config $(CONFIG) --workdir $(WORKDIR)
	$(PY) eval.py --workdir $(WORKDIR) --split test

# Three workers, one test file each at a time: most tests wait on single-threaded work
# (start-up, tracing, compiling, subprocesses), so on 2 cores two workers left them idle
# part of the time: three took the suite from 22.6 minutes to 19, 1.9 cores busy on
# average. Files are handed out longest first, as tests/durations.json measured
# them (--no-loadscope-reorder: by default xdist hands out the files with the most tests
# first instead).
PYTEST := $(PY) -m pytest -n 3 --dist loadfile --no-loadscope-reorder

# The full suite, as CI runs it, after the checks.
test: lint $(LIBTPU)
	$(PYTEST) --durations=15 tests

# ruff (lint, then formatting, checked not applied) and mypy, configured in pyproject.toml,
# over transformer/, the three commands, configs/ and docs/render/. `$(VENV)/bin/ruff
# format` and `$(VENV)/bin/ruff check --fix` apply what they can.
LINT_PATHS := transformer train.py eval.py generate.py configs docs/render tests
# All three run, and any finding fails the target.
lint: install
	@status=0; \
	set -x; \
	$(VENV)/bin/ruff check $(LINT_PATHS) || status=1; \
	$(VENV)/bin/ruff format --check $(LINT_PATHS) || status=1; \
	$(VENV)/bin/mypy || status=1; \
	exit $$status

# The edit-test loop: every file's quick tests, without those measured as slow.
test-fast: install $(LIBTPU)
	$(PYTEST) -m "not slow" tests

# Runs the full suite once and records each test's time in tests/durations.json, then
# the fast tier on its own into tests/durations_fast.json: they order the files and mark
# the slow tests (tests/helpers/durations.py).
durations: install $(LIBTPU)
	$(PYTEST) --store-durations tests
	$(PYTEST) -m "not slow" --store-durations=fast tests

# Renders the figures of README, docs/ and the configs' docstrings from the records in
# docs/results/ (docs/render/render_docs.py).
docs: install
	$(PY) -m docs.render.render_docs

clean:
	rm -rf $(VENV) workdirs .pytest_cache .mypy_cache .ruff_cache
