#!/usr/bin/env bash
# The GPU checks, for a machine with CUDA (e.g. the `device` tool): bf16 GRPO step, a QLoRA DPO run, bf16 and
# fp16 autocast SFT/DPO runs against fp32, 2 NCCL ranks (DDP, FSDP2; DPO and GRPO) against one GPU and an FSDP2
# engine sync streamed over NCCL, where there are 2 GPUs (tests/loops/test_gpu.py; skipped on CPU machines), then the memory
# bench in bf16 on the GPU (bench/memory.py --cuda). Installs the qlora and bench extras.
# Run from the repository root:  bash scripts/gpu_checks.sh
set -euo pipefail
make .venv/.installed
.venv/bin/pip install -q -e '.[qlora,bench]'
.venv/bin/python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device here'; print(torch.cuda.get_device_name(0))"
.venv/bin/python -m pytest -m gpu tests/loops/test_gpu.py -q -s -p no:cacheprovider
RLRUN_BENCH_PRESET="${RLRUN_BENCH_PRESET:-llama-125m}" .venv/bin/python bench/memory.py --cuda
