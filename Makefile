# Two commands on a fresh machine: `make demo` and `make test`. Each builds .venv itself.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo serve test lint bench clean

# torch is installed first and pinned: 2.13.0 is a local CPU wheel here; anything looser pulls CUDA builds.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rlrun demo

serve: $(STAMP)
	$(VENV)/bin/rlrun serve

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy api rlrun trainer

test: lint
	$(VENV)/bin/pytest -q

bench: $(STAMP)
	$(PY) -m pip install -q -e '.[dev,bench]'
	@for f in bench/*.py; do echo "== $$f"; $(PY) $$f || exit 1; done

clean:
	rm -rf $(VENV) .rlrun .pytest_cache .mypy_cache .ruff_cache
