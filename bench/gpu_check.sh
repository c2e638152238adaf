#!/usr/bin/env bash
# The GPU check for a lent H200 (issue "scale"): at most 8 minutes, using the packages already on the machine
# (jax with CUDA, flax, transformers); nothing is installed. Run from the repository root:
#   bash bench/gpu_check.sh            # full-width Qwen3.6-27B-shaped and 8B-dense targets, bf16, random weights
#   bash bench/gpu_check.sh --layers 16   # if compiles of the full depth do not fit the time
# Prints a table and writes bench/results/gpu_check_gpu.json (see bench/gpu_check.py).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv,noheader || true
timeout 480 python bench/gpu_check.py --minutes 7.3 "$@"
