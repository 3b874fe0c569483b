#!/usr/bin/env bash
# Timelines end to end, with the real binaries (docs/debugging.md): the
# example trainer under cohortrun with 2 workers and COHORT_TRACE set, in
# DDP and in FSDP; cohortctl trace merge; each rank's file and the merged
# one checked against the Trace Event Format's JSON Schema and the nesting
# viewers need (tests/testing/check_trace.py); their contents against the
# ops the job issued and cohortctl trace summary's figures against their
# own recomputation (trace_checks.py); and a job whose rank 1 is killed
# still leaves both files, rank 0's with the op that failed.
set -uo pipefail

COHORTD=server/cohortd
RUN=worker/launch/cohortrun
TRAIN=worker/parallel/examples/train
CTL=client/cohortctl
CHECK_TRACE=tests/testing/check_trace.py
CHECKS=tests/integration/trace_checks.py
TMP=${TEST_TMPDIR:-$(mktemp -d)}
# Debian's python3 with python3-jsonschema (tools/setup.sh).
PYTHON=/usr/bin/python3
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

"$PYTHON" -c 'import jsonschema' 2>/dev/null ||
  { echo "FAIL: $PYTHON cannot import jsonschema (tools/setup.sh installs python3-jsonschema)"; exit 1; }

"$COHORTD" --listen=127.0.0.1:0 --tcpstore_listen=127.0.0.1:0 --data_dir="$TMP/cohortd-data" 2>"$TMP/cohortd.log" &
CPID=$!
trap 'kill $CPID 2>/dev/null' EXIT
for _ in $(seq 300); do
  PORT=$(sed -n 's/.*serving cohort.v1.Store on 127.0.0.1:\([0-9]*\);.*/\1/p' "$TMP/cohortd.log")
  [[ -n "$PORT" ]] && break
  sleep 0.05
done
[[ -n "$PORT" ]] || { cat "$TMP/cohortd.log"; exit 1; }

# traced_job NAME STEPS TRAIN_ARGS...: the job with COHORT_TRACE=$TMP/NAME;
# returns cohortrun's status.
traced_job() {
  local name=$1 steps=$2
  shift 2
  COHORT_TRACE="$TMP/$name" "$RUN" --coordinator="127.0.0.1:$PORT" --run-id="$name" \
    --nnodes=1:1 --nproc-per-node=2 -- "$TRAIN" --steps="$steps" --log_every=1 "$@" \
    >"$TMP/$name.out" 2>"$TMP/$name.err"
}

for mode in ddp fsdp; do
  steps=8
  traced_job "$mode" "$steps" --mode="$mode" ||
    { fail "$mode: the job failed: $(tail -5 "$TMP/$mode.err")"; continue; }
  grep -q "writing a timeline to $TMP/$mode/trace-rank0.json" "$TMP/$mode.err" ||
    fail "$mode: the trainer did not say where its timeline goes: $(cat "$TMP/$mode.err")"
  merged=$TMP/$mode-merged.json
  "$CTL" trace merge "$TMP/$mode" -o "$merged" 2>"$TMP/$mode-merge.err" ||
    { fail "$mode: trace merge failed: $(cat "$TMP/$mode-merge.err")"; continue; }
  "$PYTHON" "$CHECK_TRACE" "$TMP/$mode/trace-rank0.json" "$TMP/$mode/trace-rank1.json" "$merged" ||
    fail "$mode: the files are not well-formed traces"
  "$PYTHON" "$CHECKS" files "$mode" "$steps" "$TMP/$mode" ||
    fail "$mode: the rank files do not match the job's ops"
  "$CTL" trace summary "$merged" >"$TMP/$mode-summary.txt" 2>"$TMP/$mode-summary.err" ||
    { fail "$mode: trace summary failed: $(cat "$TMP/$mode-summary.err")"; continue; }
  echo "== $mode: cohortctl trace summary (abridged)"
  head -6 "$TMP/$mode-summary.txt"
  "$PYTHON" "$CHECKS" summary "$steps" "$merged" "$TMP/$mode-summary.txt" ||
    fail "$mode: the summary's figures: $(cat "$TMP/$mode-summary.txt")"
  # Summarizing the folder (merged in memory) says the same.
  "$CTL" trace summary "$TMP/$mode" >"$TMP/$mode-summary2.txt" 2>&1 &&
    cmp -s "$TMP/$mode-summary.txt" "$TMP/$mode-summary2.txt" ||
    fail "$mode: summary of the folder differs from the merged file's"
done

# Merging a rank twice is refused.
"$CTL" trace merge "$TMP/ddp" "$TMP/ddp/trace-rank1.json" -o "$TMP/twice.json" 2>"$TMP/twice.err" &&
  fail "merging rank 1 twice succeeded"
grep -q "rank 1 is in both" "$TMP/twice.err" || fail "merging rank 1 twice: $(cat "$TMP/twice.err")"

# Rank 1 SIGKILLs itself after step 3: its file is the one written at its
# start (or a later flush). Rank 0's has the op the kill broke, failed, or
# still running if cohortrun's SIGTERM came first (the trainer writes its
# timeline before a stop signal ends it), and the 3 steps before it.
traced_job killed 8 --mode=ddp --fault_kill_after_step=3 &&
  fail "the job with a killed rank succeeded"
"$PYTHON" "$CHECK_TRACE" "$TMP/killed/trace-rank0.json" "$TMP/killed/trace-rank1.json" ||
  fail "killed: the files are not well-formed traces"
grep -qE '"state":"(failed|running)"' "$TMP/killed/trace-rank0.json" ||
  fail "killed: rank 0's timeline has no failed or running op; the job said: $(cat "$TMP/killed.err")"
"$CTL" trace summary "$TMP/killed/trace-rank0.json" >"$TMP/killed-summary.txt" 2>&1 ||
  fail "killed: trace summary failed: $(cat "$TMP/killed-summary.txt")"
grep -qE '^timeline: 1 rank\(s\) \(0\), [3-8] step\(s\).* ([1-9][0-9]* unfinished|[1-9][0-9]* failed)' "$TMP/killed-summary.txt" ||
  fail "killed: rank 0's summary: $(head -1 "$TMP/killed-summary.txt")"

if ((failures > 0)); then
  echo "$failures check(s) failed"
  exit 1
fi
echo "all checks passed"
