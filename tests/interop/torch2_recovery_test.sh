#!/usr/bin/env bash
# Unmodified PyTorch 2.x programs (the project venv's torch, tools/venv.sh)
# as torch's tutorials write them, under cohortrun against a real cohortd
# (--engine=memory, its TCPStore listener given with --tcpstore), once on
# the backend "cohort" (//worker/torch:cohort_torch2, imported from its
# folder on PYTHONPATH) and once on torch's "gloo"; then the program's
# --check compares what the runs left, bit for bit (each program's
# docstring says why bit equality is the right test). Usage:
# torch2_recovery_test.sh NAME, where NAME is
#   pipeline  tests/interop/torch/program2_pipeline.py:
#             torch.distributed.pipelining with ScheduleGPipe and Schedule1F1B,
#             manual and traced stages, 2 nodes x 1 worker; both backends and a
#             single process end with the same parameters and losses
#   dcp       tests/interop/torch/program2_dcp.py: DCP save and async_save of an
#             FSDP2 model and its Adam state at world 4 (2 nodes x 2), loaded at
#             world 2 (1 node x 2); what each backend loads, of its own
#             checkpoints and of the other's, is what was saved
#   elastic   tests/interop/torch/program2_elastic.py: DDP training with a DCP
#             checkpoint after every step, 2 nodes x 1 worker, --max-restarts=1;
#             in the first round rank 1 SIGKILLs itself after step 2
#             (tests/interop/torch/torch2_kill_worker.py), both nodes restart,
#             the program resumes from step 1's checkpoint and ends with the
#             state of an uninterrupted run, on both backends
# Fails, not skips, when the venv, its torch or the module is missing.
set -uo pipefail

COHORTD=server/cohortd
RUN=worker/launch/cohortrun
SCRIPTS=tests/interop/torch
name=${1:?usage: torch2_recovery_test.sh pipeline|dcp|elastic}
TMP=${TEST_TMPDIR:-$(mktemp -d)}
OUT=$TMP/out
mkdir -p "$OUT"
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# The checkout: requirements.txt is a runfile linked to its source.
requirements=$(readlink -f tools/requirements.txt)
root=$(dirname "$(dirname "$requirements")")
PYTHON=${PYTHON:-$root/.venv/bin/python}
[[ -x "$PYTHON" ]] || { echo "FAIL: no venv python at $PYTHON: run tools/setup.sh"; exit 1; }
if ! "$PYTHON" -c 'import torch, torch.distributed as d; assert d.is_available(); assert int(torch.__version__.split(".")[0]) >= 2, torch.__version__' 2>"$TMP/torch_import.err"; then
  echo "FAIL: $PYTHON cannot import torch 2.x with torch.distributed (tools/setup.sh makes the venv):"
  cat "$TMP/torch_import.err"
  exit 1
fi
module_dir="$PWD/worker/torch/torch2"
if [[ ! -f "$module_dir/cohort_torch.so" ]]; then
  echo "FAIL: no torch2/cohort_torch.so in $PWD/worker/torch (a data dependency of this test)"
  [[ -f "$module_dir/MISSING" ]] && echo "Bazel built none: $(cat "$module_dir/MISSING")"
  exit 1
fi
# One thread per worker: 2 to 4 workers share this machine's cores, and the
# pipeline's single-process reference runs on as many threads as its stages.
export PYTHONPATH="$module_dir" OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1 TORCH_CPP_LOG_LEVEL=ERROR

"$COHORTD" --listen=127.0.0.1:0 --tcpstore_listen=127.0.0.1:0 --engine=memory 2>"$TMP/cohortd.log" &
CPID=$!
trap 'kill $CPID 2>/dev/null' EXIT
for _ in $(seq 300); do
  PORT=$(sed -n 's/.*serving cohort.v1.Store on 127.0.0.1:\([0-9]*\);.*/\1/p' "$TMP/cohortd.log" 2>/dev/null)
  TSPORT=$(sed -n 's/.*serving the TCPStore protocol on 127.0.0.1:\([0-9]*\).*/\1/p' "$TMP/cohortd.log" 2>/dev/null)
  [[ -n "$PORT" && -n "$TSPORT" ]] && break
  sleep 0.05
done
[[ -n "$PORT" && -n "$TSPORT" ]] || { echo "FAIL: cohortd did not start:"; cat "$TMP/cohortd.log"; exit 1; }

# job RUN NNODES NPROC [cohortrun flags] -- PROGRAM ARGS...: one cohortrun
# per node (a, b, ...), all at once; waits for them. Each node's stdout
# (the workers' lines prefixed "[rank N] "), stderr and exit status are
# $TMP/RUN.NODE.{out,err,rc}. Fails the test unless every node exits 0.
job() {
  local run=$1 nnodes=$2 nproc=$3 n pids=() rc
  shift 3
  local nodes=(a b c d)
  echo "== $run: $nnodes node(s) x $nproc worker(s): cohortrun ${*//$OUT/OUT}"
  for n in "${nodes[@]:0:$nnodes}"; do
    ( timeout 400 "$RUN" --coordinator="127.0.0.1:$PORT" --tcpstore="127.0.0.1:$TSPORT" \
        --run-id="$run" --node-id="$n" --heartbeat-interval=1s --tee \
        --nnodes="$nnodes" --nproc-per-node="$nproc" "$@" \
        >"$TMP/$run.$n.out" 2>"$TMP/$run.$n.err"
      echo $? >"$TMP/$run.$n.rc" ) &
    pids+=($!)
  done
  wait "${pids[@]}"
  for n in "${nodes[@]:0:$nnodes}"; do
    rc=$(cat "$TMP/$run.$n.rc")
    [[ $rc == 0 ]] || fail "$run: node $n exited $rc (timeout's 124: it hung):"$'\n'"$(cat "$TMP/$run.$n.out" "$TMP/$run.$n.err" | tail -60)"
  done
}

# check PROGRAM: the program's --check over $OUT.
check() {
  "$PYTHON" "$SCRIPTS/$1" --check --out "$OUT" || fail "$1 --check (above)"
}

start=$SECONDS
case $name in
  pipeline)
    for backend in gloo cohort; do
      job "pipe-$backend" 2 1 -- "$PYTHON" "$SCRIPTS/program2_pipeline.py" --backend="$backend" --out="$OUT"
    done
    check program2_pipeline.py
    ;;
  dcp)
    for backend in gloo cohort; do
      job "dcp-save-$backend" 2 2 -- "$PYTHON" "$SCRIPTS/program2_dcp.py" --backend="$backend" --out="$OUT" --phase=save
    done
    # Each load phase loads the other backend's checkpoint too.
    for backend in gloo cohort; do
      job "dcp-load-$backend" 1 2 -- "$PYTHON" "$SCRIPTS/program2_dcp.py" --backend="$backend" --out="$OUT" --phase=load
    done
    check program2_dcp.py
    ;;
  elastic)
    for backend in gloo cohort; do
      job "elastic-kill-$backend" 2 1 --max-restarts=1 -- "$PYTHON" "$SCRIPTS/torch2_kill_worker.py" \
        "$SCRIPTS/program2_elastic.py" --backend="$backend" --out="$OUT/$backend-kill"
      run=elastic-kill-$backend
      out=$(cat "$TMP/$run".*.out)
      grep -q "^\[rank 1\] rank 1: SIGKILL after step 2 at " <<<"$out" ||
        fail "$run: rank 1 did not kill itself after step 2 in round 0:"$'\n'"$out"
      # Each node restarts for the first failure it sees: rank 1's SIGKILL,
      # rank 0 exiting 1 after its error, or the other node's report.
      for n in a b; do
        grep -q "restarting: .* (restart 1 of 1)" "$TMP/$run.$n.err" ||
          fail "$run: node $n did not restart after round 0:"$'\n'"$(cat "$TMP/$run.$n.err")"
      done
      grep -q "^\[rank 0\] rank 0: round 1 starts after step 1$" <<<"$out" ||
        fail "$run: rank 0 did not resume from step 1's checkpoint in round 1:"$'\n'"$out"
      echo "round 0's end and round 1's start:"
      grep -e "SIGKILL after" -e "round 0 failed at" -e "round . starts after" <<<"$out" | cut -c1-240
    done
    for backend in gloo cohort; do
      job "elastic-whole-$backend" 2 1 --max-restarts=1 -- "$PYTHON" \
        "$SCRIPTS/program2_elastic.py" --backend="$backend" --out="$OUT/$backend-whole"
      ! grep -q "restarting:" "$TMP/elastic-whole-$backend".*.err ||
        fail "elastic-whole-$backend restarted:"$'\n'"$(cat "$TMP/elastic-whole-$backend".*.err)"
    done
    check program2_elastic.py
    ;;
  *)
    echo "unknown test $name"
    exit 2
    ;;
esac
echo "$name: $((SECONDS - start)) s"

if [[ $failures -gt 0 ]]; then
  echo "$failures failures; cohortd's log:"; tail -40 "$TMP/cohortd.log"
  exit 1
fi
echo PASS
