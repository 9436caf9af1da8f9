#!/usr/bin/env bash
# GPU check: the CUDA tests (tests/test_cuda.py), then (issue 8, item 9) pinned staging bandwidth against a
# plain device-to-host copy, blocking time with asynchronous staging during real GPU training steps, real NVML
# readings with the health monitor running against them, then (issue 18) what saves cost a real Lightning fit
# on the GPU in its steady state, each CheckpointIO side by side, with the GPU's utilization in those windows
# (bench_lightning --mode throughput --accelerator gpu). Needs one CUDA GPU and a CUDA build of torch in the interpreter it runs (PYTHON, default
# .venv/bin/python; the CPU wheel that `make setup` installs will not do), with pytest and Lightning. Sized to
# finish within 8 minutes on one H200 (2026-12-04: the bench_gpu part took 115 s); hard limits of 120 s, 200 s
# and 250 s stop each part otherwise. Prints markdown and keeps a copy in benchmarks/out/gpu_check.md, to paste
# into benchmarks/RESULTS.md.
#
#     benchmarks/gpu_check.sh [--quick] [any option of: python -m benchmarks.bench_gpu --help]
#
# On a machine whose python3 has CUDA torch, Lightning, nvidia-ml-py, xxhash and fsspec already (as the H200 lent
# on 2026-12-04 had): PYTHON=python3 PYTHONPATH=$PWD benchmarks/gpu_check.sh. Without zlib-ng there, a name's
# CRC-32s are zlib's (about 10x slower); its wheel can be installed next to the others.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    "$PYTHON" -c 'import torch; print(f"gpu_check: no usable CUDA device (torch {torch.__version__}, CUDA build: {torch.version.cuda})")' >&2
    exit 2
fi
mkdir -p benchmarks/out
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >&2 || true
status=0
# The CUDA tests first (skipped on machines without a GPU; never run before this script's next GPU session)
timeout --kill-after=10 120 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_cuda.py >&2 || status=$?
timeout --kill-after=10 200 "$PYTHON" -m benchmarks.bench_gpu "$@" | tee benchmarks/out/gpu_check.md || status=$?
# 1.6 GB of state, 0.3 s steps on an H200 (batch 16384), a save every 10 steps: 6 saves per fit, 4 of them in
# the steady windows (not a fit's first interval, nor its last with the wait for the last save).
fit=(--size-gb 1.6 --batch 16384 --steps 60 --every 10)
[[ " $* " == *" --quick "* ]] && fit=(--size-gb 0.2 --batch 4096 --steps 30 --every 10)
timeout --kill-after=10 250 "$PYTHON" -m benchmarks.bench_lightning --mode throughput --accelerator gpu "${fit[@]}" \
    | tee -a benchmarks/out/gpu_check.md || status=$?
exit "$status"
