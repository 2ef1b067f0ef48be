#!/usr/bin/env bash
# benchmarks/gpu_check.sh: the prepared GPU check (see benchmarks/README.md).
#
# Runs in the repository root on a machine whose python3 already has torch and triton, with
# no network: it installs nothing and imports normbook from src/ through PYTHONPATH.
# Steps, each under its own timeout so that one hang cannot eat the rest (all: < 8 minutes):
#   env           versions and nvidia-smi
#   gpu_tests     python3 -m pytest -m gpu tests/test_kernels_*.py -> $OUT/gpu_tests.txt
#   report        python3 -m normbook.kernels.report --json  -> $OUT/compile_report.json (if present)
#   bench_bf16    4 ops, fwd and bwd, normbook and torch      -> $OUT/bench-bf16/results.json
#   bench_fp32    layer_norm fp32, normbook, torch, compile   -> $OUT/bench-fp32/results.json
#   bench_compile 4 ops bf16 under torch.compile, in the time left -> $OUT/bench-bf16-compile/
#   summary       tables and the DESIGN.md goal check         -> $OUT/summary.txt
#   plots         GB/s and fraction of copy vs D              -> $OUT/plots/*.png
# OUT unset (a run by hand): the results go to benchmarks/results/gpu-<date>/.
# PYTHON overrides the interpreter (default python3).
set -u -o pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
DEADLINE=450   # seconds after start by which every step has ended (the hard limit is 480)
OUT="${OUT:-benchmarks/results/gpu-$(date +%F)}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PIP_NO_INDEX=1           # nothing here may reach for the network
unset TRITON_INTERPRET          # compiled kernels, not the interpreter
: > "$OUT/steps.txt"

elapsed() { echo $(( $(date +%s) - T0 )); }

# step NAME SECONDS TAIL CMD...: run CMD with a timeout, its output in $OUT/NAME.txt; show
# the last TAIL lines; record rc and time in $OUT/steps.txt. rc 124: timed out.
step() {
  local name=$1 limit=$2 tail_n=$3; shift 3
  local t=$(date +%s) rc
  echo "=== [$(elapsed)s] $name (timeout ${limit}s)"
  timeout -k 10 "$limit" "$@" > "$OUT/$name.txt" 2>&1
  rc=$?
  tail -n "$tail_n" "$OUT/$name.txt"
  echo "=== $name: rc=$rc in $(( $(date +%s) - t ))s"
  echo "$name rc=$rc $(( $(date +%s) - t ))s" >> "$OUT/steps.txt"
}

# D in an order that spreads coverage if a time budget cuts a run short
D_ORDER=1024,32768,131072,4096,16384,65536,2048,8192
BENCH=("$PY" -m normbook.bench --device cuda --M 32768 --D "$D_ORDER" --modes fwd,bwd
       --warmup-ms 10 --rep-ms 50 --no-plots --no-progress)

step env 30 200 bash -c "$PY -c 'import sys, platform, torch, triton; \
print(\"python\", sys.version.split()[0], platform.platform()); \
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"available\", torch.cuda.is_available()); \
print(\"triton\", triton.__version__); \
print(\"device\", torch.cuda.get_device_name() if torch.cuda.is_available() else None)'; \
git rev-parse HEAD 2>/dev/null || echo 'commit unknown'; nvidia-smi || echo 'nvidia-smi failed'"

if "$PY" -c "import pytest" 2>/dev/null; then
  # only the kernel test files: the others import test-only packages (hypothesis) the GPU machine may lack
  step gpu_tests 100 25 "$PY" -m pytest -m gpu tests/test_kernels_accuracy.py tests/test_kernels_api.py tests/test_kernels_residual.py -q -p no:cacheprovider
else
  echo "pytest is not installed for $PY: GPU tests not run" | tee "$OUT/gpu_tests.txt"
fi

if [ -f src/normbook/kernels/report.py ]; then
  step compile_report 45 15 "$PY" -m normbook.kernels.report --json "$OUT/compile_report.json"
else
  echo "no src/normbook/kernels/report.py: compile report not run"
fi

step bench_bf16 140 12 "${BENCH[@]}" --ops layer_norm,rms_norm,add_layer_norm,add_rms_norm \
  --dtypes bf16 --providers normbook,torch --time-budget 105 --out "$OUT/bench-bf16"

step bench_fp32 80 12 "${BENCH[@]}" --ops layer_norm --dtypes fp32 \
  --providers normbook,torch,compile --time-budget 50 --out "$OUT/bench-fp32"

# torch.compile of bf16 in what is left, keeping 60 s for the summary and the plots. A
# compile takes seconds per shape; rows past the budget are recorded as skipped.
left=$(( DEADLINE - 60 - $(elapsed) ))
if [ "$left" -ge 45 ]; then
  step bench_compile "$left" 12 "${BENCH[@]}" \
    --ops layer_norm,rms_norm,add_layer_norm,add_rms_norm --dtypes bf16 --providers compile \
    --time-budget $(( left - 35 )) --out "$OUT/bench-bf16-compile"
else
  echo "only ${left}s left: torch.compile bf16 benchmark not run"
fi

results=$(ls "$OUT"/bench-*/results.json 2>/dev/null)
if [ -n "$results" ]; then
  # shellcheck disable=SC2086  # one argument per results file
  step summary 25 90 "$PY" -m normbook.bench --summary $results
  # shellcheck disable=SC2086
  step plots 35 3 "$PY" -m normbook.bench --plot $results --out "$OUT/plots"
else
  echo "no benchmark results to summarize"
fi

echo "=== done in $(elapsed)s; results in $OUT"
cat "$OUT/steps.txt"
