#!/usr/bin/env bash
# The GPU check for a lent GPU (one H100 80 GB or H200 141 GB; issue #52): at most 8 minutes, using the packages
# already on the machine (jax with CUDA, flax, transformers); nothing is installed. Run from the repository root:
#   bash bench/gpu_check.sh              # 8B-dense then Qwen3.6-27B-shaped targets, full size, bf16, random weights
#   bash bench/gpu_check.sh --layers 16  # if compiles of the full depth do not fit the time
# Writes $OUT/gpu_check_gpu.json (rewritten after every measurement, so a crash keeps what was measured), the
# printed log $OUT/gpu_check_gpu.log and $OUT/nvidia_smi.txt; without $OUT, into bench/results/. See bench/gpu_check.py;
# `python bench/gpu_check.py --dry-run` runs the same code on tiny shapes on a CPU (tests/test_gpu_check.py).
set -euo pipefail
cd "$(dirname "$0")/.."
out_dir="${OUT:-bench/results}"
mkdir -p "$out_dir"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1  # the log keeps every line
# One process owns the GPU: one pool of 92% of its memory (the 27B's 54 GB of weights + a 32k-slot cache + the
# programs' temporaries). Without a fraction, JAX's BFC allocator caps at 75% (60 GB on an H100) even when it
# does not preallocate; 8% stays outside for CUDA, cuBLAS and the Pallas compiler.
export XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_PREALLOCATE:-true}"
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
export XLA_CLIENT_MEM_FRACTION="${XLA_CLIENT_MEM_FRACTION:-$XLA_PYTHON_CLIENT_MEM_FRACTION}"  # the newer name
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv,noheader 2>&1 | tee "$out_dir/nvidia_smi.txt" \
  || true
# the script stops itself at --minutes (each step checks the time left); timeout is the backstop: SIGTERM (the
# script records it and exits), then SIGKILL 10 s later if a compile holds it up
timeout -k 10 460 python bench/gpu_check.py --minutes 7.2 --out "$out_dir/gpu_check_gpu.json" "$@" 2>&1 \
  | tee "$out_dir/gpu_check_gpu.log"
