#!/usr/bin/env bash
# GPU check (issue 8, item 9): pinned staging bandwidth against a plain device-to-host copy, blocking time with
# asynchronous staging during real GPU training steps, real NVML readings with the health monitor running
# against them. Needs one CUDA GPU and a CUDA build of torch in the interpreter it runs (PYTHON, default
# .venv/bin/python; the CPU wheel that `make setup` installs will not do). Sized to finish within 8 minutes on
# one H200; a hard limit of 470 s stops it otherwise. Prints markdown and keeps a copy in
# benchmarks/out/gpu_check.md, to paste into benchmarks/RESULTS.md.
#
#     benchmarks/gpu_check.sh [--quick] [any option of: python -m benchmarks.bench_gpu --help]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    "$PYTHON" -c 'import torch; print(f"gpu_check: no usable CUDA device (torch {torch.__version__}, CUDA build: {torch.version.cuda})")' >&2
    exit 2
fi
mkdir -p benchmarks/out
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >&2 || true
timeout --kill-after=10 470 "$PYTHON" -m benchmarks.bench_gpu "$@" | tee benchmarks/out/gpu_check.md
