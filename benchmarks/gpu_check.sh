#!/usr/bin/env bash
# The GPU checks in one go, about 9 minutes on an H100: what is live at two compiled steps' peaks
# (benchmarks/cuda_peak.py), the CUDA tests (8 processes where pytest-xdist is installed), then
# benchmarks/gpu.py --quick (ResNet-50 fp32 and GPT-2 at limit = in-core/3, the default planner)
# with the time left, a profiler trace of one step of in-core and of each fxpooch row kept
# (benchmarks/streams.py summarizes it into the JSON). Beside them, on a CPU core of its own,
# benchmarks/plan_time.py: the default planner's CPU time on the sweep's GPT-2 rows on this
# machine, with its Python speed (plan_time.json).
#
#   bash benchmarks/gpu_check.sh [DIR] [BENCH_SECONDS] [gpu.py options...]
#
# DIR (default benchmarks/results/gpu-check) receives peak.log, pytest.log, bench.log, gpu.json, the
# traces (traces/*.json.gz) and the measured profiles of test_cuda.py's limit sweep (profiles/*.json,
# replayable on any machine). Options after BENCH_SECONDS go to gpu.py, e.g. --skip torch.compile.
set -uo pipefail
out="${1:-benchmarks/results/gpu-check}"
bench_s="${2:-360}"
shift $(( $# < 2 ? $# : 2 ))
mkdir -p "$out/profiles" "$out/traces"
export PYTHONUNBUFFERED=1
python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())' || exit 2
timeout 480 python3 benchmarks/plan_time.py --out "$out/plan_time.json" > "$out/plan_time.log" 2>&1 &
plan_time=$!
timeout 60 python3 benchmarks/cuda_peak.py > "$out/peak.log" 2>&1; grep -v Warn "$out/peak.log" | tail -n 30
parallel=$(python3 -c 'import xdist' 2>/dev/null && echo "-n 8")
# -v: a line per test as it ends, so a run stopped by its timeout still names what failed
FXPOOCH_KEEP_PROFILES="$out/profiles" timeout 150 python3 -m pytest -v -rfE $parallel -p no:cacheprovider \
    tests/test_cuda.py tests/test_training_loops.py -k cuda 2>&1 | tee "$out/pytest.log" \
    | grep -E "(FAILED|ERROR)|passed|failed"
timeout "$bench_s" python3 benchmarks/gpu.py --quick --time-budget "$((bench_s - 70))" --out "$out/gpu.json" \
    --trace-dir "$out/traces" "$@" > "$out/bench.log" 2>&1
echo "benchmark exit $?"
grep -v "fxpooch.pipeline\|fxpooch.profile\|fxpooch.progress" "$out/bench.log" | tail -n 25
wait "$plan_time"; echo "plan_time exit $?"
grep -E '^(machine|\{)' "$out/plan_time.log"
