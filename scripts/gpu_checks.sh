#!/usr/bin/env bash
# The GPU checks, for a machine with CUDA (e.g. the `device` tool): bf16 GRPO step and a QLoRA DPO run
# (tests/loops/test_gpu.py; both are skipped on CPU machines). Installs the qlora extra (bitsandbytes).
# Run from the repository root:  bash scripts/gpu_checks.sh
set -euo pipefail
make .venv/.installed
.venv/bin/pip install -q -e '.[qlora]'
.venv/bin/python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device here'; print(torch.cuda.get_device_name(0))"
.venv/bin/python -m pytest -m gpu tests/loops/test_gpu.py -q -s -p no:cacheprovider
