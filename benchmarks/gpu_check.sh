#!/usr/bin/env bash
# benchmarks/gpu_check.sh: the prepared GPU check (see benchmarks/README.md).
#
# Runs in the repository root on a machine whose python3 already has torch and triton, with no
# network: it imports normbook from src/ through PYTHONPATH and installs only the wheels in .whl/
# (Liger-Kernel; `make gpu-wheels` downloads them), into a temporary folder.
#
# Steps, each under its own timeout so that one hang cannot eat the rest (all: < 8 minutes):
#   env        versions, commit, nvidia-smi
#   wheels     .whl/*.whl -> a temporary site folder first on PYTHONPATH (else: Liger not measured)
#   gpu_tests  pytest -m gpu over the kernel tests
#   report     the static compile report, compiled here (Triton of this machine)
#   host       python -m normbook.bench host: host time per call, launches stubbed
#   bench_*    bf16: 4 ops x fwd/bwd, normbook, torch, liger; fp32 layer_norm with compile;
#              bf16 torch.compile in the time left
#   merge, summary, plots, model (the report's predictions against the measurement)
# What comes back is at most 8 files, none in a folder (the device tool returns no more):
#   $OUT/results.json   every benchmark row, merged, with provenance
#   $OUT/summary.txt    steps, host times, the tables and the goal check
#   $OUT/report.json    the compile report of this machine
#   $OUT/overview.png   fraction of copy bandwidth, every op, bf16
#   $OUT/model.png      the performance model's prediction against the measurement, bf16
#   $OUT/logs.tar.gz    every log, every per-run JSON, every plot
# DRY_RUN=1: the same steps on the CPU (Triton's interpreter, M = 64, small D, torch.compile's
# aot_eager backend), in under 3 minutes: `make test` runs it, so a broken step shows here.
# OUT unset: benchmarks/results/gpu-<date>/. PYTHON overrides the interpreter (default python3).
set -u -o pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
DRY=${DRY_RUN:-0}
OUT="${OUT:-benchmarks/results/gpu-$(date +%F)}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY="${PYTHON:-python3}"
WORK=$(mktemp -d)
LOGS="$WORK/logs"
mkdir -p "$LOGS"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PIP_NO_INDEX=1 PYTHONUNBUFFERED=1    # nothing here may reach for the network
unset TRITON_INTERPRET                     # compiled kernels (the dry run's bench sets it itself)
: > "$LOGS/steps.txt"

elapsed() { echo $(( $(date +%s) - T0 )); }

# step NAME SECONDS CMD...: run CMD with a timeout, its output in logs/NAME.txt; show the last
# lines; record rc and time in logs/steps.txt. rc 124: timed out.
step() {
  local name=$1 limit=$2; shift 2
  local t=$(date +%s) rc
  echo "=== [$(elapsed)s] $name (timeout ${limit}s)"
  timeout -k 10 "$limit" "$@" > "$LOGS/$name.txt" 2>&1
  rc=$?
  tail -n 8 "$LOGS/$name.txt"
  echo "=== $name: rc=$rc in $(( $(date +%s) - t ))s"
  echo "$name rc=$rc $(( $(date +%s) - t ))s" >> "$LOGS/steps.txt"
}

if [ "$DRY" = 1 ]; then
  BENCH=("$PY" -m normbook.bench --dry-run --no-plots --no-progress)
  BF16=(--dtypes bf16 --D 256,1024)
  FP32=(--dtypes fp32 --D 1024)
  LIM_BF16=90; LIM_FP32=40; DEADLINE=170
  REPORT=(--quick); LIM_REPORT=60   # make triton36 runs the full report in make test
else
  # D in an order that spreads coverage if a time budget cuts a run short
  BENCH=("$PY" -m normbook.bench --device cuda --M 32768 --modes fwd,bwd
         --warmup-ms 10 --rep-ms 50 --no-plots --no-progress)
  BF16=(--dtypes bf16 --D 1024,32768,131072,4096,16384,65536,2048,8192)
  FP32=(--dtypes fp32 --D 1024,32768,4096,16384,65536,2048,8192,131072)
  LIM_BF16=170; LIM_FP32=70; DEADLINE=450
  REPORT=(); LIM_REPORT=150         # 608 compiles, single-threaded: about a minute
fi
OPS=(--ops layer_norm,rms_norm,add_layer_norm,add_rms_norm)

step env 30 bash -c "$PY -c 'import sys, platform, torch, triton; \
print(\"python\", sys.version.split()[0], platform.platform()); \
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"available\", torch.cuda.is_available()); \
print(\"triton\", triton.__version__); \
print(\"device\", torch.cuda.get_device_name() if torch.cuda.is_available() else None)'; \
git rev-parse HEAD 2>/dev/null || echo 'commit unknown'; nvidia-smi 2>&1 || echo 'nvidia-smi: none'"

# Liger-Kernel travels as a wheel in .whl/ (make gpu-wheels); installed apart, never into python3's site
if ls .whl/*.whl >/dev/null 2>&1; then
  step wheels 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:$WORK/site"
else
  echo "no .whl/ (make gpu-wheels): Liger-Kernel is recorded as not measured" | tee "$LOGS/wheels.txt"
fi

if "$PY" -c "import pytest" 2>/dev/null; then
  # only the kernel test files: the others import test-only packages the GPU machine may lack
  step gpu_tests 100 "$PY" -m pytest -m gpu tests/test_kernels_accuracy.py tests/test_kernels_api.py \
    tests/test_kernels_residual.py tests/test_kernels_gpu.py -q -p no:cacheprovider
else
  echo "pytest is not installed for $PY: GPU tests not run" | tee "$LOGS/gpu_tests.txt"
fi

step report "$LIM_REPORT" "$PY" -m normbook.kernels.report "${REPORT[@]}" --json "$WORK/report.json"
step host 60 "$PY" -m normbook.bench host --json "$WORK/host.json"

step bench_bf16 "$LIM_BF16" "${BENCH[@]}" "${OPS[@]}" "${BF16[@]}" \
  --providers normbook,torch,liger --time-budget $(( LIM_BF16 - 30 )) --out "$WORK/bench-bf16"
step bench_fp32 "$LIM_FP32" "${BENCH[@]}" --ops layer_norm "${FP32[@]}" \
  --providers normbook,torch,compile,liger --time-budget $(( LIM_FP32 - 25 )) --out "$WORK/bench-fp32"

# torch.compile of bf16 in what is left, keeping 50 s for the summary, the plots and the archive.
# A compile takes seconds per shape; rows past the budget are recorded as skipped.
left=$(( DEADLINE - 50 - $(elapsed) ))
if [ "$left" -ge 40 ]; then
  step bench_compile "$left" "${BENCH[@]}" "${OPS[@]}" "${BF16[@]}" --providers compile \
    --time-budget $(( left - 30 )) --out "$WORK/bench-bf16-compile"
else
  echo "only ${left}s left: torch.compile bf16 benchmark not run" | tee -a "$LOGS/steps.txt"
fi

results=$(ls "$WORK"/bench-*/results.json 2>/dev/null)
if [ -n "$results" ]; then
  # shellcheck disable=SC2086  # one argument per results file
  step merge 30 "$PY" -m normbook.bench --merge $results --out "$OUT/results.json"
  step summary 30 "$PY" -m normbook.bench --summary "$OUT/results.json"
  step plots 60 "$PY" -m normbook.bench --plot $results --out "$WORK/plots"
  step overview 30 "$PY" -m normbook.bench --overview "$OUT/results.json" --out "$OUT/overview.png"
  [ -f "$WORK/report.json" ] && step model 30 "$PY" -m normbook.bench --model-check "$OUT/results.json" \
    --report "$WORK/report.json" --out "$OUT/model.png"
else
  echo "no benchmark results: nothing to merge, summarize or plot" | tee -a "$LOGS/steps.txt"
fi
[ -f "$WORK/report.json" ] && cp "$WORK/report.json" "$OUT/report.json"

{
  echo "normbook GPU check$([ "$DRY" = 1 ] && echo ' (DRY RUN on the CPU: no figure here is a GPU measurement)'), $(date -u +%FT%TZ), $(elapsed) s"
  echo; echo "== steps (rc 0 = ok, 124 = timed out)"; cat "$LOGS/steps.txt"
  echo; echo "== versions"; cat "$LOGS/env.txt" 2>/dev/null | head -n 6
  echo; echo "== GPU tests"; tail -n 3 "$LOGS/gpu_tests.txt" 2>/dev/null
  echo; echo "== compile report"; tail -n 1 "$LOGS/report.txt" 2>/dev/null
  echo; echo "== host time per call"; cat "$LOGS/host.txt" 2>/dev/null
  echo; echo "== benchmark"; cat "$LOGS/summary.txt" 2>/dev/null || echo "no benchmark results"
  echo; echo "== the model against measurement"; cat "$LOGS/model.txt" 2>/dev/null || echo "not compared"
} > "$OUT/summary.txt"

cp "$OUT/summary.txt" "$WORK/"
( cd "$WORK" && tar -czf "$OUT/logs.tar.gz" logs plots bench-* host.json report.json summary.txt 2>/dev/null )
rm -rf "$WORK"
echo "=== done in $(elapsed)s; in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
# every file is written whatever failed; the exit status says whether every step passed
if grep -v " rc=0 " "$OUT/summary.txt" | grep -q " rc=[0-9]"; then
  echo "=== some steps failed:"; grep " rc=" "$OUT/summary.txt" | grep -v " rc=0 "
  exit 1
fi
