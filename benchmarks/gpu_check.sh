#!/usr/bin/env bash
# benchmarks/gpu_check.sh: the prepared GPU check (see benchmarks/README.md).
#
# Runs in the repository root on a machine whose python3 already has torch and triton, with no
# network: it imports normbook from src/ through PYTHONPATH and installs only the wheels in .whl/
# (Liger-Kernel, transformers and hypothesis; `make gpu-wheels` downloads them), into a
# temporary folder.
#
# Steps, in this order (a step's cap in seconds, GPU run / dry run):
#   env        versions, commit (NORMBOOK_COMMIT where given), GPU and driver, nvidia-smi  30 / 30
#   wheels     .whl/*.whl -> a temporary site folder on PYTHONPATH (before the    60 / 60
#              machine's site-packages: the carried versions win)
#   bench_bf16 4 ops x fwd/bwd, bf16, normbook, torch, liger: the goal's rows      150 / 90
#   bench_compile  the same, torch.compile's (the goal's third rival)               75 / 60
#   host       normbook-bench host --goal: host time per call, real launches (the    45 / 45
#              dry run: the driver stubbed)
#   plans      normbook-bench plans: the backward of few rows as one program against    45 / 30
#              the grid and its finish; the forward of short rows on tiles against a row
#              a program; device time (the dry run: in the interpreter)
#   gpu_tests  pytest -m "gpu or gpu_too" over the kernel and benchmark tests  120 / 60
#   shapes     normbook-bench shapes: wide rows (D 32768..131072) in candidate block     75 / 40
#              shapes beside the shape in force, LayerNorm forward and backward, device
#              time (the dry run: two shapes, in the interpreter)
#   report     the static compile report, compiled here (Triton of this machine)   120 / 60
#   llama      a Llama-shaped bf16 training step, HF's norms against normbook's     90 / 60
#   chapter    chapter 9 executed here, its tensors on this GPU (book/_ext/notebooks.py --run;
#              the dry run: in the interpreter)                                     60 / 90
#   bench_fp32 layer_norm in fp32 beside its rivals, with what is left              60 / 40
#   merge, summary, plots, overview (the report predicts no speed since 2026-12-05: see
#              normbook.bench.model; --model-check reads the recorded predictions)
#
# The budget. Every step's limit is cut from one total, BUDGET_S seconds (default 480; the
# device tool's run gets `timeout_s: 540`): a step gets its cap or what the budget leaves,
# whichever is less, after RESERVE_S for the last publish (and, for the benchmarks, POST_S for
# the steps that turn their rows into the summary and figures). So the run ends inside BUDGET_S
# even when every step hangs; a step the budget has no time for is recorded as not run.
#
# What is measured is kept. After every step, $OUT gets summary.txt, results.json (the rows
# so far, merged), report.json and logs.tar.gz; a run stopped from outside (SIGTERM, SIGINT,
# SIGHUP) stops its running step and writes them once more before it exits. SIGKILL cannot be
# caught: then $OUT holds what the last finished step published.
#
# A step runs in its own process group (timeout makes one); at its limit timeout sends SIGTERM
# to the group, SIGKILL KILL_AFTER_S later, and after every step the group is killed whatever
# is left in it, so a hanging grandchild cannot outlive its step. (A process that starts its own
# session escapes any process group; none of these steps does.)
#
# What comes back is at most 8 files, none in a folder (the device tool returns no more):
#   $OUT/results.json   every benchmark row, merged, with provenance
#   $OUT/summary.txt    steps, host times, the plans, the Llama step, the tables, the goal check
#   $OUT/report.json    the compile report of this machine
#   $OUT/overview.png   fraction of copy bandwidth, every op, bf16
#   $OUT/logs.tar.gz    every log, every per-run JSON, every plot
#
# Exit status: 0 when every step passed; 1 when one failed, timed out or was not run for lack
# of budget; 2 when the setup failed (nothing run); 128 + N when stopped by signal N.
#
# Settings, from the environment:
#   DRY_RUN=1   the same steps on the CPU (Triton's interpreter, M = 64, small D, torch.compile's
#               aot_eager backend), in about a minute and a half: `make gpu-dry-run`.
#   OUT         the output folder (default benchmarks/results/gpu-<date>/); this script's five
#               file names in it are replaced, nothing else is touched.
#   PYTHON      the interpreter (default python3).
#   BUDGET_S (480), RESERVE_S (20), KILL_AFTER_S (5): the budget above; MIN_STEP_S (10): a
#               step that would get less is recorded as not run.
#   ONLY=env,host,...   run only these steps (the others are not run and not counted): for
#               rerunning a part, and for tests/test_gpu_check.py.
set -u -o pipefail

die() { echo "gpu_check: $*; nothing run" >&2; exit 2; }
whole() { [[ $2 =~ ^[0-9]+$ ]] || die "$1=$2: expected a whole number of seconds"; }

T0=$(date +%s)
cd "$(dirname "$0")/.." || die "cannot enter the repository root"
DRY=${DRY_RUN:-0}
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-480}; whole BUDGET_S "$BUDGET_S"
RESERVE_S=${RESERVE_S:-20}; whole RESERVE_S "$RESERVE_S"
KILL_AFTER_S=${KILL_AFTER_S:-5}; whole KILL_AFTER_S "$KILL_AFTER_S"
# a limit shorter than MIN_STEP_S is no chance to run (Python and torch take 3-8 s to start; a
# benchmark's 1 s warm-up copy comes first): the step is not run
MIN_STEP_S=${MIN_STEP_S:-10}; whole MIN_STEP_S "$MIN_STEP_S"
ALL_STEPS=" env wheels bench_bf16 bench_compile host plans gpu_tests shapes report llama chapter"
ALL_STEPS+=" bench_fp32"
ALL_STEPS+=" merge summary plots overview "
ONLY=${ONLY:-}
IFS=, read -ra only_steps <<< "$ONLY"
for s in "${only_steps[@]}"; do   # a misspelt step would silently run nothing
  [[ $ALL_STEPS == *" $s "* ]] || die "ONLY: no step '$s' (steps:$ALL_STEPS)"
done
PUBLISHED="results.json summary.txt report.json overview.png logs.tar.gz"

# Setup. Every failure stops here, before anything is written: an unchecked mkdir or mktemp
# would leave OUT or WORK empty, and the paths below would then point into /.
OUT=${OUT:-benchmarks/results/gpu-$(date +%F)}
[ -n "$OUT" ] || die "OUT is empty"
mkdir -p -- "$OUT" || die "cannot create OUT=$OUT"
OUT=$(cd -- "$OUT" && pwd) && [ -w "$OUT" ] || die "OUT=$OUT is not a writable folder"
for f in $PUBLISHED; do    # a previous run's files must not pass for this run's
  rm -f -- "$OUT/$f" "$OUT/$f.part" || die "cannot replace $OUT/$f"
done
WORK=$(mktemp -d -t gpu_check.XXXXXX) && [ -d "$WORK" ] || die "mktemp -d failed (TMPDIR=${TMPDIR:-/tmp})"
LOGS="$WORK/logs"
mkdir "$LOGS" && : > "$LOGS/steps.txt" || { rm -rf -- "$WORK"; die "cannot write into $WORK"; }

export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PIP_NO_INDEX=1 PYTHONUNBUFFERED=1    # nothing here may reach for the network
unset TRITON_INTERPRET                     # compiled kernels (the dry run's bench sets it itself)

FAILED=()          # steps that did not pass: the exit status
STEP_PID=          # the running command's process group (timeout's pid), while one runs
CURRENT=           # the running step's name and start time, for the record if it is stopped
CURRENT_T=0
STOPPED_BY=        # the signal that stopped the run, if one did

elapsed() { echo $(( $(date +%s) - T0 )); }
budget_left() { echo $(( BUDGET_S - $(elapsed) )); }

# step_limit CAP [KEEP]: the limit of a step that starts now: its CAP, or what the budget
# leaves after the reserve, KEEP seconds for later steps, and the kill grace (a step that
# ignores SIGTERM runs KILL_AFTER_S past its limit), whichever is less.
step_limit() {
  local cap=$1 left=$(( $(budget_left) - RESERVE_S - ${2:-0} - KILL_AFTER_S ))
  echo $(( cap < left ? cap : left ))
}

selected() { [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]]; }

# record NAME RC SECONDS [NOTE]: one line of logs/steps.txt, the summary's list of steps
record() {
  echo "$1 rc=$2 $3s${4:+ ($4)}" >> "$LOGS/steps.txt"
  [ "$2" = 0 ] || FAILED+=("$1")
}

# bounded LIMIT LOG CMD...: CMD under `timeout` in the background, output into LOG. timeout
# puts itself and CMD into a new process group (its pid); at LIMIT it signals the whole group.
# Waiting with `wait` (not a foreground command) lets a trapped signal interrupt at once.
# Afterwards the group is killed: whatever the command left running dies with it. Returns rc.
bounded() {
  local limit=$1 log=$2 rc; shift 2
  timeout -k "$KILL_AFTER_S" "$limit" "$@" > "$log" 2>&1 < /dev/null &
  STEP_PID=$!
  wait "$STEP_PID"; rc=$?
  kill -KILL -- "-$STEP_PID" 2>/dev/null
  STEP_PID=
  return "$rc"
}

# stop_running: end the running command's group (on a signal): SIGTERM, which timeout passes
# on and follows with SIGKILL after KILL_AFTER_S, then SIGKILL to anything left in the group.
stop_running() {
  [ -n "$STEP_PID" ] || return 0
  kill -TERM -- "-$STEP_PID" 2>/dev/null || kill -TERM "$STEP_PID" 2>/dev/null
  wait "$STEP_PID" 2>/dev/null
  kill -KILL -- "-$STEP_PID" 2>/dev/null
  STEP_PID=
}

# step NAME CAP CMD...: run CMD as step NAME, its output in logs/NAME.txt, its limit cut from
# the budget (step_limit); show the last lines; record rc and time; publish what is known.
# rc 124: timed out; 137: killed KILL_AFTER_S after that.
step() {
  local name=$1 limit t rc; limit=$(step_limit "$2"); shift 2
  selected "$name" || return 0
  if [ "$limit" -lt "$MIN_STEP_S" ]; then
    echo "=== [$(elapsed)s] $name: not run, $(budget_left)s of the ${BUDGET_S}s budget left"
    record "$name" none 0 "not run: budget spent"
    publish; return 1
  fi
  echo "=== [$(elapsed)s] $name (limit ${limit}s)"
  CURRENT=$name; CURRENT_T=$(date +%s); t=$CURRENT_T
  bounded "$limit" "$LOGS/$name.txt" "$@"; rc=$?
  CURRENT=
  tail -n 8 "$LOGS/$name.txt"
  echo "=== $name: rc=$rc in $(( $(date +%s) - t ))s"
  case $rc in
    124|137) record "$name" "$rc" $(( $(date +%s) - t )) "timed out at ${limit}s" ;;
    *) record "$name" "$rc" $(( $(date +%s) - t )) ;;
  esac
  publish
  return "$rc"
}

# bench_results: RESULTS=( the benchmark steps' results.json files so far )
bench_results() {
  local f; RESULTS=()
  for f in "$WORK"/bench-*/results.json; do [ -f "$f" ] && RESULTS+=("$f"); done
}

# copy_in FILE: FILE into $OUT under its own name, whole or not at all (rename in the folder)
copy_in() {
  local name; name=$(basename "$1")
  cp -- "$1" "$OUT/$name.part" && mv -f -- "$OUT/$name.part" "$OUT/$name"
}

# publish [STATE]: what is known so far into $OUT, the quick files first (a stopped run may
# have seconds): summary.txt, report.json and the figures, logs.tar.gz, then results.json. The
# benchmark writes its results.json after every shape, so the merge here also keeps the rows of
# a benchmark step that was cut short.
publish() {
  local state=${1:-"in progress, $(elapsed)s"} f stale=0 lim items=()
  write_summary "$state" > "$WORK/summary.txt" && copy_in "$WORK/summary.txt"
  for f in report.json overview.png; do
    if [ -f "$WORK/$f" ] && [ "$WORK/$f" -nt "$OUT/$f" ]; then copy_in "$WORK/$f"; fi
  done
  # the archive: the pieces that exist, side by side, so that it unpacks into one folder
  for f in logs plots host.json plans.json shapes.json llama.json report.json summary.txt \
      "$WORK"/bench-*; do
    [ -e "$WORK/${f#"$WORK"/}" ] && items+=("${f#"$WORK"/}")
  done
  tar -czf "$OUT/logs.tar.gz.part" -C "$WORK" "${items[@]}" 2>> "$LOGS/tar.txt" \
    && mv -f -- "$OUT/logs.tar.gz.part" "$OUT/logs.tar.gz"
  bench_results
  for f in "${RESULTS[@]}"; do [ "$f" -nt "$WORK/results.json" ] && stale=1; done
  if [ "$stale" = 1 ]; then
    lim=$(budget_left); lim=$(( lim > 30 ? 30 : lim < 5 ? 5 : lim ))
    bounded "$lim" "$LOGS/merge-partial.txt" \
      "$PY" -m normbook.bench --merge "${RESULTS[@]}" --out "$WORK/results.json" --force
  fi
  if [ -f "$WORK/results.json" ] && [ "$WORK/results.json" -nt "$OUT/results.json" ]; then
    copy_in "$WORK/results.json"
  fi
}

write_summary() {
  local dry=""
  [ "$DRY" = 1 ] && dry=" (DRY RUN on the CPU: no figure here is a GPU measurement)"
  echo "normbook GPU check$dry, $(date -u +%FT%TZ)"
  echo "$1; budget ${BUDGET_S}s${ONLY:+; only the steps $ONLY}"
  if [ "$DRY" != 1 ] && [ -z "${NORMBOOK_COMMIT:-}" ]; then
    echo "WARNING: NORMBOOK_COMMIT unset: the provenance names the GPU machine's own commit of"
    echo "the copied tree, no commit of this repository (benchmarks/README.md, step 2)"
  fi
  echo; echo "== steps (rc 0 = ok, 124 = timed out, 137 = killed after it, none = not run)"
  cat "$LOGS/steps.txt"
  echo; echo "== versions"; head -n 7 "$LOGS/env.txt" 2>/dev/null
  echo; echo "== GPU tests"; tail -n 3 "$LOGS/gpu_tests.txt" 2>/dev/null
  echo; echo "== compile report"; tail -n 1 "$LOGS/report.txt" 2>/dev/null
  echo; echo "== host time per call"; cat "$LOGS/host.txt" 2>/dev/null
  echo; echo "== the backward of few rows: one program or a grid and its finish"
  cat "$LOGS/plans.txt" 2>/dev/null
  echo; echo "== wide rows in candidate block shapes (normbook-bench shapes)"
  cat "$LOGS/shapes.txt" 2>/dev/null
  echo; echo "== a Llama-shaped training step: Hugging Face's norms, normbook's, Liger's"
  cat "$LOGS/llama.txt" 2>/dev/null
  echo; echo "== benchmark"; cat "$LOGS/summary.txt" 2>/dev/null || echo "no summary (yet)"
  return 0
}

# On any exit: stop a running step (a signal came), publish for the last time, clean up, and
# say in the exit status whether every step passed. Signals during this are ignored, so that a
# second SIGTERM cannot cut the last publish short (children get their own handlers: timeout).
on_exit() {
  local rc=$? state
  trap '' TERM INT HUP
  trap - EXIT
  if [ -n "$STEP_PID" ]; then
    stop_running
    [ -n "$CURRENT" ] && record "$CURRENT" "$rc" $(( $(date +%s) - CURRENT_T )) \
      "stopped by SIG$STOPPED_BY"
    CURRENT=
  fi
  if [ -n "$STOPPED_BY" ]; then state="STOPPED by SIG$STOPPED_BY after $(elapsed)s: partial results"
  elif [ "$rc" != 0 ]; then state="ended by an error (rc $rc) after $(elapsed)s: partial results"
  else state="done in $(elapsed)s"
  fi
  [ "${#FAILED[@]}" -gt 0 ] && state="$state; not passed: ${FAILED[*]}"
  publish "$state"
  rm -rf -- "$WORK"
  rm -f -- "$OUT"/*.part
  echo "=== $state"
  echo "=== in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
  [ "$rc" = 0 ] && [ "${#FAILED[@]}" -gt 0 ] && rc=1
  exit "$rc"
}
on_signal() { STOPPED_BY=$1; echo "=== [$(elapsed)s] SIG$1: stopping"; exit $(( 128 + $2 )); }
trap on_exit EXIT
trap 'on_signal TERM 15' TERM
trap 'on_signal INT 2' INT
trap 'on_signal HUP 1' HUP

if [ "$DRY" = 1 ]; then
  BENCH=("$PY" -m normbook.bench --dry-run --no-plots --no-progress)
  BF16=(--dtypes bf16 --D 256,1024)
  FP32=(--dtypes fp32 --D 1024)
  CAP_TESTS=60; CAP_CHAPTER=90; CAP_REPORT=60; CAP_BF16=90; CAP_FP32=40; CAP_COMPILE=60; POST_S=30
  REPORT=(--quick)                  # make triton36 runs the full report in make test
else
  # D in an order that spreads coverage if a time budget cuts a run short
  BENCH=("$PY" -m normbook.bench --device cuda --M 32768 --modes fwd,bwd
         --warmup-ms 10 --rep-ms 50 --no-plots --no-progress)
  BF16=(--dtypes bf16 --D 1024,32768,131072,4096,16384,65536,2048,8192)
  FP32=(--dtypes fp32 --D 1024,32768,4096,16384,65536,2048,8192,131072)
  CAP_TESTS=120; CAP_CHAPTER=60; CAP_REPORT=120; CAP_BF16=150; CAP_FP32=60; CAP_COMPILE=75; POST_S=60
  REPORT=()                         # 608 compiles, single-threaded: about a minute
fi
OPS=(--ops layer_norm,rms_norm,add_layer_norm,add_rms_norm)
# Liger may not import (no .whl/), and quack cannot travel (the CUTLASS DSL's 92 MB wheel): each
# recorded as not measured, with the reason, not an error before measuring
LIGER=(--skip-unavailable)
BENCH_SLACK=30     # of a benchmark step's limit: start-up, the copy bandwidth, writing

# env: the python part's status is the step's (git and nvidia-smi only inform)
ENV_PY='import sys, platform, torch, triton
print("python", sys.version.split()[0], platform.platform())
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
print("triton", triton.__version__)
print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)'
step env 30 bash -c '"$1" -c "$2"; rc=$?
  # NORMBOOK_COMMIT: the commit the tree came from (the machine commits its own copy)
  if [ -n "${NORMBOOK_COMMIT:-}" ]; then echo "commit $NORMBOOK_COMMIT (NORMBOOK_COMMIT)"
  else echo "commit $(git rev-parse HEAD 2>/dev/null || echo unknown) (this checkout)"; fi
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null \
    | sed "s/^/gpu, driver: /"
  if command -v nvidia-smi >/dev/null; then nvidia-smi 2>&1; else echo "nvidia-smi: none"; fi
  exit $rc' env "$PY" "$ENV_PY"

# Liger-Kernel and transformers travel as wheels in .whl/ (make gpu-wheels); installed apart,
# never into python3's site. A folder on PYTHONPATH comes before site-packages, so the carried
# wheels win over the machine's own copies of the same packages (transformers at
# requirements.txt's pin with its dependencies, one consistent set: a pinned transformers beside
# the machine's older huggingface_hub would not be)
if ls .whl/*.whl >/dev/null 2>&1; then
  step wheels 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:$WORK/site"
elif selected wheels; then
  echo "no .whl/ (make gpu-wheels): Liger-Kernel is recorded as not measured" | tee "$LOGS/wheels.txt"
fi

# judged CMD...: CMD --goal, its status 1 (a goal not met) made 0: the verdict is a finding,
# printed in its log and the summary, not a failed step; any other status stays the step's
JUDGED='"$@" --goal; rc=$?; [ "$rc" = 1 ] && exit 0; exit "$rc"'

# The benchmarks first, right after the setup: they are what the run is for (the goal check
# reads bf16's rows beside torch.compile's), and a later step that hangs or runs long must not
# cut them short; the checks follow, then float32.
# bench STEP CAP ARGS...: a benchmark step. Its limit keeps POST_S for the steps after the
# benchmarks; the benchmark's own --time-budget ends it BENCH_SLACK before that limit, with
# the rows past it recorded as skipped.
bench() {
  local name=$1 limit; limit=$(step_limit "$2" "$POST_S"); shift 2
  step "$name" "$limit" "${BENCH[@]}" "$@" --out "$WORK/bench-${name#bench_}" \
    --time-budget $(( limit > BENCH_SLACK ? limit - BENCH_SLACK : 1 ))
}
bench bench_bf16 "$CAP_BF16" "${OPS[@]}" "${BF16[@]}" --providers normbook,torch,liger,quack "${LIGER[@]}"
# torch.compile of bf16, the goal's third rival (the goal check reads its rows): a compile
# takes seconds per shape, so it runs with a cap of its own, and only where 40 s are left
if [ "$(step_limit "$CAP_COMPILE" "$POST_S")" -ge 40 ]; then
  bench bench_compile "$CAP_COMPILE" "${OPS[@]}" "${BF16[@]}" --providers compile
elif selected bench_compile; then
  # not run, as a step the budget has no time for: the goal check reads its rows
  echo "only $(budget_left)s left: torch.compile bf16 benchmark not run"
  record bench_compile none 0 "not run: budget spent"
fi

# the host and the plans next: issue 45's and 46's measurements
step host 45 bash -c "$JUDGED" judged "$PY" -m normbook.bench host --json "$WORK/host.json"
# the device time of _config.ONE_PROGRAM_ROWS's choice, the finish's share at large M, and the
# forward of rows of 1024 and 2048 on tiles against a row a program (_config.ROW_FROM)
if [ "$DRY" = 1 ]; then
  step plans 30 env TRITON_INTERPRET=1 "$PY" -m normbook.bench plans --dims 2048 --rows 1,4 \
    --share-rows 64 --forward-dims 1024 --json "$WORK/plans.json"
else
  step plans 45 "$PY" -m normbook.bench plans --json "$WORK/plans.json"
fi

# only the kernel test files and the benchmark's (its graph timer): the others import test-only
# packages the GPU machine may lack.
# Without pytest this fails (No module named pytest): a GPU check without its tests is no pass.
step gpu_tests "$CAP_TESTS" "$PY" -m pytest -m "gpu or gpu_too" -q -p no:cacheprovider \
  tests/test_kernels_launchers.py tests/test_kernels_ops.py tests/test_kernels_ops_residual.py tests/test_kernels_gpu.py \
  tests/test_bench.py

# the wide rows' block shapes, each candidate beside the shape in force (issue 46: the forward
# above D = 32768, the sharing backward's slice); its own --time-budget ends it inside its limit.
# Here it gets what the steps above leave of 75 s; all of it takes a call of its own, where
# ONLY names it (benchmarks/README.md, step 5)
if [ "$DRY" = 1 ]; then
  step shapes 40 env TRITON_INTERPRET=1 "$PY" -m normbook.bench shapes --dims 20000 --rows 3 \
    --forward 16384x32x1x1 --backward 16384x16x1 --time-budget 20 --json "$WORK/shapes.json"
else
  # 75 s in the whole run, POST_S kept for the steps after it; in a call of its own (ONLY
  # naming no step after it), what the budget leaves. (Any ONLY took it all: ONLY=shapes,report
  # gave shapes 455 of 480 s, and the report the 25 s left)
  cap=75 keep=$POST_S
  if [ -n "$ONLY" ]; then
    cap=$BUDGET_S keep=0
    for s in ${ALL_STEPS#* shapes }; do selected "$s" && { cap=75 keep=$POST_S; }; done
  fi
  limit=$(step_limit "$cap" "$keep")
  # the backward first: its candidates are fewer, and the one row behind is the one to time
  step shapes "$limit" "$PY" -m normbook.bench shapes --modes bwd,fwd --json "$WORK/shapes.json" \
    --time-budget $(( limit > 40 ? limit - 30 : 10 ))
fi

step report "$CAP_REPORT" "$PY" -m normbook.kernels.report "${REPORT[@]}" --json "$WORK/report.json"
# a Llama-shaped bf16 training step with Hugging Face's norms, normbook's (strict and not) and
# Liger's (issue 47's goal: normbook strict >= 1.25x hf). transformers travels in .whl/ with
# Liger (make gpu-wheels) where the machine lacks it; without it the step fails in one line.
if [ "$DRY" = 1 ]; then
  step llama 60 "$PY" -m normbook.bench step --quick --json "$WORK/llama.json"
else
  step llama 90 bash -c "$JUDGED" judged "$PY" -m normbook.bench step --json "$WORK/llama.json"
fi
# chapter 9 as a reader with this GPU runs it: every cell, its claims asserted, the kernel cells'
# tensors on the GPU (booktools.kernel_device), its "measure it on your GPU" cell included.
# The dry run has no GPU: the same cells in Triton's interpreter.
if [ "$DRY" = 1 ]; then CHAPTER_ENV=(env TRITON_INTERPRET=1 MPLBACKEND=Agg); else CHAPTER_ENV=(env MPLBACKEND=Agg); fi
step chapter "$CAP_CHAPTER" "${CHAPTER_ENV[@]}" "$PY" book/_ext/notebooks.py --run "$WORK/chapter-claims.json" book/09-kernels.md

# float32 LayerNorm beside its rivals: no goal reads it, so it takes what the budget leaves last
bench bench_fp32 "$CAP_FP32" --ops layer_norm "${FP32[@]}" \
  --providers normbook,torch,compile,liger "${LIGER[@]}"

bench_results
if [ "${#RESULTS[@]}" -gt 0 ]; then
  # --force: $WORK/results.json is this run's merge so far (publish), made again with every step
  step merge 30 "$PY" -m normbook.bench --merge "${RESULTS[@]}" --out "$WORK/results.json" --force
  step summary 30 bash -c "$JUDGED" judged "$PY" -m normbook.bench --summary "$WORK/results.json"
  step plots 60 "$PY" -m normbook.bench --plot "${RESULTS[@]}" --out "$WORK/plots"
  step overview 30 "$PY" -m normbook.bench --overview "$WORK/results.json" --out "$WORK/overview.png"
elif [ -z "$ONLY" ]; then
  echo "no benchmark results: nothing to merge, summarize or plot" | tee -a "$LOGS/steps.txt"
  FAILED+=(no-results)
fi
exit 0   # on_exit publishes the last time and sets the status from the steps
