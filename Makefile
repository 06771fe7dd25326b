# Two commands do all set-up on a fresh machine:  make train  and  make test.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
WORKDIR ?= workdirs/default
CONFIG ?= configs/default.py

.PHONY: install train test test-fast durations clean

install: $(STAMP)

# Reinstalls only when pyproject.toml changes; otherwise this takes a second.
$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "Python 3.10 or newer is needed, found " + sys.version.split()[0])'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

# Trains the embedded default (or resumes it), then beam-searches the test split;
# the last line printed is its sacreBLEU.
train: install
	$(PY) train.py --config $(CONFIG) --workdir $(WORKDIR)
	$(PY) eval.py --workdir $(WORKDIR) --split test

# Two workers, one test file each at a time: most tests wait on single-threaded work
# (start-up, tracing, compiling, subprocesses), so two share the cores well. Files are
# handed out longest first, as tests/durations.json measured them (--no-loadscope-reorder:
# by default xdist hands out the files with the most tests first instead).
PYTEST := $(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder

# The full suite, as CI runs it.
test: install
	$(PYTEST) --durations=15 tests

# The edit-test loop: every file's quick tests, without those measured as slow.
test-fast: install
	$(PYTEST) -m "not slow" tests

# Runs the full suite once and records each test's time in tests/durations.json, which
# orders the files and marks the slow tests (tests/helpers/durations.py).
durations: install
	$(PYTEST) --store-durations tests

clean:
	rm -rf $(VENV) workdirs .pytest_cache
