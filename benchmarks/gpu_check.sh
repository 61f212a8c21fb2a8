#!/usr/bin/env bash
# The GPU checks in one go, about 8 minutes on an H100: the CUDA tests (8 processes where
# pytest-xdist is installed), then the
# benchmark's default configuration (ResNet-50 fp32 at limit = in-core/3) with the time left.
#
#   bash benchmarks/gpu_check.sh [DIR] [BENCH_SECONDS]
#
# DIR (default benchmarks/results/gpu-check) receives pytest.log, bench.log, gpu.json and the
# measured profiles of test_cuda.py's limit sweep (profiles/*.json, replayable on any machine).
set -uo pipefail
out="${1:-benchmarks/results/gpu-check}"
bench_s="${2:-300}"
mkdir -p "$out/profiles"
export PYTHONUNBUFFERED=1
python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())' || exit 2
parallel=$(python3 -c 'import xdist' 2>/dev/null && echo "-n 8")
FXPOOCH_KEEP_PROFILES="$out/profiles" timeout 180 python3 -m pytest -q -rfE $parallel -p no:cacheprovider \
    tests/test_cuda.py tests/test_training_loops.py -k cuda 2>&1 | tee "$out/pytest.log" \
    | grep -E "^(FAILED|ERROR)|passed|failed"
timeout "$bench_s" python3 benchmarks/gpu.py --quick --time-budget "$((bench_s - 60))" --out "$out/gpu.json" \
    > "$out/bench.log" 2>&1
echo "benchmark exit $?"
grep -v "fxpooch.pipeline\|fxpooch.profile\|fxpooch.progress" "$out/bench.log" | tail -n 25
