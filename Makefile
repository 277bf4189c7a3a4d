# The two commands of the README. Each sets up .venv itself on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck pytest clean venv

venv: $(STAMP)

# torch first, pinned, so pip takes the CPU build on the machine's disk instead of a CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[redis,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/streamrec demo

lint: $(STAMP)
	$(BIN)/ruff check streamrec tests bench
	$(BIN)/ruff format --check streamrec tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/python -m pytest -q -m "not gpu"

test: lint typecheck pytest

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .streamrec-cache
