# Two entry points, both from a fresh clone: `make demo` and `make test`.
# torch is pinned to the CPU wheel this machine has on disk; pyproject.toml states the range users can use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0

.PHONY: setup demo test test-all test-floors lint bench
setup: $(STAMP)

$(STAMP): pyproject.toml requirements/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -c requirements/constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

# loadfile: a module's tests on one worker, so its module-scoped fixtures (reference runs of real trainings)
# are made once, not on both. One run each on 2 cores (2026-12-04): 12.4 min, against 14.3 for worksteal
# (about 13.5 without a flaky test's 60 s timeout in that run).
test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=25

# Also the tests marked slow (longer trials, and scenarios the default run covers another way).
test-all: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile -m 'slow or not slow'

# The lowest stated versions, in .venv-floors: a smoke set of tests, each floor's own (tools/test_floors.sh);
# CI runs it. FULL=1 adds the larger set of whole test files (a few minutes more).
test-floors: $(STAMP)
	BASE_VENV=$(VENV) FULL=$(FULL) tools/test_floors.sh

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy resilience

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run
