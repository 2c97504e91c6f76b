# The two verbs of the Quick start: `make demo` and `make test`.
# Everything runs from a virtualenv inside the checkout (.venv), created on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Pinned so a CPU-only machine never pulls a multi-GB CUDA build; pyproject accepts any torch>=2.4.
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test lint venv clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_PIN)"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $@

venv: $(BIN)/.installed

demo: venv
	$(BIN)/dilocod demo

# pytest exits 5 when it collected nothing: a broken suite, not a pass.
test: venv
	$(BIN)/ruff check dilocod tests bench
	$(BIN)/python -m pytest -q; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: no tests were collected" >&2; exit 1; fi; exit $$rc

lint: venv
	$(BIN)/ruff check dilocod tests bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
