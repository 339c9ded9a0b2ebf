#!/usr/bin/env bash
# The prepared GPU run (one short script, for a session that has a CUDA device; see the device tool's README).
# Writes everything under ${OUT:-gpu_out}. Usage on the device machine, from the repo root:
#   bash benchmarks/gpu_check.sh
set -uo pipefail
out="${OUT:-gpu_out}"
mkdir -p "$out"
python -m venv /tmp/gpu_venv && . /tmp/gpu_venv/bin/activate
pip install -q -e ".[test]" > "$out/install.txt" 2>&1   # uses the machine's CUDA torch if present, else PyPI's
python -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))" > "$out/device.txt" 2>&1
timeout 240 pytest -q tests/test_cuda.py tests/test_scaling.py tests/test_cast_cache.py > "$out/tests.txt" 2>&1
timeout 120 python benchmarks/bench_step_time.py --device cuda --dtype float16 > "$out/step_fp16.txt" 2>&1
timeout 120 python benchmarks/bench_step_time.py --device cuda --dtype bfloat16 > "$out/step_bf16.txt" 2>&1
timeout 180 amp-patch experiment --device cuda --half-dtype float16 --out "$out/experiment" > "$out/experiment.txt" 2>&1
tail -n 3 "$out"/*.txt
