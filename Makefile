# The two verbs of the Quick start: `make demo` and `make test`.
# Everything runs from a virtualenv inside the checkout (.venv), created on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Pinned so a CPU-only machine never pulls a multi-GB CUDA build; pyproject accepts any torch>=2.4.
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test test-slow lint venv clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_PIN)"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $@

venv: $(BIN)/.installed

demo: venv
	$(BIN)/dilocod demo

# `make test`: ruff and every test not marked slow (pure units, real processes on loopback; a few
# minutes). `make test-slow`: the long real-process runs (chaos, demo with chaos, long convergence
# checks). pytest exits 5 when it collected nothing: a broken suite, not a pass.
PYTEST = $(BIN)/python -m pytest -q -rs -p no:cacheprovider
define run_pytest
	$(PYTEST) $(1); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make $@: no tests were collected" >&2; exit 1; fi; exit $$rc
endef

# Tests run in parallel (pytest-xdist), a worker per core and one more, up to 4: most of a test's
# time is spent waiting on the real processes it starts, so a worker per core leaves a core idle
# while its test waits (on 2 cores, 3 workers against 2: make test 306 s against 400 s, the slow
# tests 188 s against 213 s). test-slow runs the chaos tests alone first (their bounds hold on the
# host's cores, not on what a second worker leaves of them), then the other slow tests in
# parallel, test by test (the equivalence cases of one file spread over the workers).
CORES := $(shell nproc 2>/dev/null || echo 2)
WORKERS ?= $(shell echo $$(( $(CORES) + 1 < 4 ? $(CORES) + 1 : 4 )))

test: venv
	$(BIN)/ruff check dilocod devkit tests bench
	$(call run_pytest,-m "not slow" -n $(WORKERS) --dist worksteal)

test-slow: venv
	$(call run_pytest,-m slow tests/chaos)
	$(call run_pytest,-m slow --ignore=tests/chaos -n $(WORKERS) --dist worksteal)

lint: venv
	$(BIN)/ruff check dilocod devkit tests bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
