#!/usr/bin/env bash
# The vLLM inference backend (RLRUN_INFERENCE_BACKEND=vllm) on a GPU: tests/inference/test_vllm_gpu.py (the same
# first-token log-probabilities as the HF backend; 32 concurrent streams served), then bench/inference.py with
# both backends side by side. vLLM pins its own torch and transformers, so this runs in an environment that
# already has vLLM (PYTHON, default python3): rlrun goes in without its pinned torch/transformers/peft, its
# other requirements as pyproject names them.
# Run from the repository root:  PYTHON=/path/to/vllm-env/bin/python bash scripts/gpu_vllm_inference.sh
set -euo pipefail
PY="${PYTHON:-python3}"
"$PY" -c "import torch, vllm; assert torch.cuda.is_available(), 'no CUDA device here'; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name(0))"
"$PY" - <<'PYEOF' > /tmp/rlrun-vllm-reqs.txt
import tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
skip = ("torch", "transformers", "tokenizers", "peft", "accelerate")  # the vLLM environment's own stay
print("\n".join(d for d in deps if not d.split("=")[0].split("<")[0].split(">")[0].strip().startswith(skip)))
PYEOF
"$PY" -m pip install -q -r /tmp/rlrun-vllm-reqs.txt pytest
"$PY" -m pip install -q --no-deps -e .
"$PY" -m pytest -m gpu tests/inference/test_vllm_gpu.py -q -s -p no:cacheprovider
"$PY" bench/inference.py --backends hf,vllm --device cuda
