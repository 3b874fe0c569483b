#!/usr/bin/env bash
# The flight recorder end to end: real worker processes under cohortrun
# against one cohortd, one of them misbehaving on cue
# (tests/testing/flight_worker.cc), and `cohortctl diagnose` naming it:
#  1. a rank that sleeps before an op: the others wait in it for that rank,
#     and, with a short group timeout, fail in it waiting for that rank;
#  2. a rank that skips an op and moves on: the others wait at the last op;
#  3. a rank that issues a Broadcast where the others all-reduce;
#  4. a rank that all-reduces one element more;
#  5. a rank that SIGKILLs itself: it sent no records;
#  6. a rank that enters every op late: the straggler;
#  7. a node frozen (SIGSTOP) mid-job: membership declares it failed, its
#     peer's cohortrun asks for dumps before stopping its workers, and the
#     diagnosis of that round names the frozen ranks, dead in membership.
# Also `cohortctl dump` (who answered) and its errors. Asserts states, never
# durations: each wait polls until a deadline far beyond need.
set -uo pipefail

COHORTD=server/cohortd
RUN=worker/launch/cohortrun
CTL=client/cohortctl
WORKER=tests/testing/flight_worker
TMP=${TEST_TMPDIR:-$(mktemp -d)}
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do
    pkill -CONT -P "$p" 2>/dev/null; kill -CONT "$p" 2>/dev/null
    pkill -KILL -P "$p" 2>/dev/null; kill -KILL "$p" 2>/dev/null
  done
}
trap cleanup EXIT

# No TCPStore listener: its default port would collide with other tests'.
"$COHORTD" --listen=127.0.0.1:0 --tcpstore_listen= --engine=memory \
  2>"$TMP/cohortd.log" &
PIDS+=($!)
PORT=
for _ in $(seq 600); do
  PORT=$(sed -n 's/.*serving cohort.v1.Store on 127.0.0.1:\([0-9]*\);.*/\1/p' "$TMP/cohortd.log")
  [[ -n "$PORT" ]] && break
  sleep 0.1
done
[[ -n "$PORT" ]] || { cat "$TMP/cohortd.log"; exit 1; }
export COHORT_ADDR=127.0.0.1:$PORT

# job RUN NPROC FAULT RANK STEP [WORKER FLAGS...]: one node of 4 (NPROC)
# workers in the background; its pid in JOB, output in $TMP/RUN.{out,err}.
job() {
  local run=$1 nproc=$2 fault=$3 rank=$4 step=$5; shift 5
  "$RUN" --coordinator="$COHORT_ADDR" --run-id="$run" --nproc-per-node="$nproc" \
    --heartbeat-interval=1s -- "$WORKER" --fault="$fault" --fault_rank="$rank" \
    --fault_step="$step" "$@" >"$TMP/$run.out" 2>"$TMP/$run.err" &
  JOB=$!
  PIDS+=($JOB)
}

# until_diagnosed RUN PATTERN: runs `cohortctl diagnose RUN` (fresh dumps)
# until its output matches PATTERN (grep -E); leaves it in $TMP/RUN.diag.
until_diagnosed() {
  local run=$1 pattern=$2
  for _ in $(seq 120); do
    "$CTL" diagnose "$run" --answer_timeout=5 >"$TMP/$run.diag" 2>&1
    grep -Eq "$pattern" "$TMP/$run.diag" && return 0
    sleep 1
  done
  fail "$run: diagnosis never matched '$pattern':"; cat "$TMP/$run.diag"
  return 1
}

# finished RUN PID: waits for a job that fails by itself, then diagnoses
# the records its ranks left (no fresh dump: they are gone).
finished() {
  wait "$2"
  "$CTL" diagnose "$1" --request_dump=false >"$TMP/$1.diag" 2>&1 ||
    fail "$1: diagnose failed: $(cat "$TMP/$1.diag")"
}

expect() {  # expect RUN PATTERN: the diagnosis matches PATTERN (grep -E)
  grep -Eq "$2" "$TMP/$1.diag" ||
    fail "$1: diagnosis lacks '$2':"$'\n'"$(cat "$TMP/$1.diag")"
}

# 1. Rank 2 sleeps before op 7.
job sleep 4 sleep 2 7
until_diagnosed sleep 'in AllReduce #7' &&
  expect sleep '^ranks 0-1,3 are in AllReduce #7 of group 0 \(AVG, f32, 4096 elements\) since [0-9:]{8}; rank 2 last completed #6 and has not entered #7 \(its last heartbeat was [0-9]+ s ago\)$'
"$CTL" dump sleep >"$TMP/sleep.dump" 2>&1 || fail "dump: $(cat "$TMP/sleep.dump")"
grep -Eq '^round 0 group 0: ranks 0-3 dumped \(request [0-9]+\)$' "$TMP/sleep.dump" ||
  fail "dump: not every rank answered: $(cat "$TMP/sleep.dump")"
kill "$JOB"

# 1b. Rank 2 sleeps and the group times out after 5 s: the others' op
# fails, each dumps as it fails, and cohortrun collects rank 2's records
# before it stops the round.
job timeout 4 sleep 2 7 --timeout_s=5
finished timeout "$JOB"
expect timeout '^ranks 0-1,3 failed in AllReduce #7 of group 0 \(AVG, f32, 4096 elements\), entered at [0-9:]{8}; rank 2 last completed #6 and has not entered #7'
expect timeout '^AllReduce #7 failed on ranks 0-1,3; rank 0.s error: DEADLINE_EXCEEDED'

# 2. Rank 1 skips op 5 of 12: its ops pair with the others' next ones, so
# it ends one early and the others wait for it in the last.
job skip 4 skip 1 5 --steps=12
until_diagnosed skip 'in AllReduce #11' &&
  expect skip '^ranks 0,2-3 are in AllReduce #11 .*; rank 1 last completed #10 and has not entered #11 '
kill "$JOB"

# 3. Rank 3 broadcasts where the others all-reduce (op 4).
job other 4 other_op 3 4
finished other "$JOB"
expect other '^ops differ at #4 of group 0: ranks 0-2 issued AllReduce \(AVG, f32, 4096 elements\); rank 3 issued Broadcast \(root 0, f32, 4096 elements\)$'
expect other '^AllReduce #4 failed on ranks 0-2; rank 0.s error: INVALID_ARGUMENT'

# 4. Rank 2 all-reduces 4097 elements at op 3.
job count 4 count 2 3
finished count "$JOB"
expect count '^arguments differ at #3 of group 0: ranks 0-1,3 issued AllReduce \(AVG, f32, 4096 elements\); rank 2 issued AllReduce \(AVG, f32, 4097 elements\)$'

# 5. Rank 1 SIGKILLs itself before op 6; cohortrun asks the others for
# their records before stopping them.
job die 4 die 1 6
finished die "$JOB"
grep -q 'round 0: flight records in cohortd' "$TMP/die.err" ||
  fail "die: cohortrun did not collect the flight records: $(cat "$TMP/die.err")"
expect die 'rank 1 sent no flight records'
expect die '(ranks 0,2-3 are in AllReduce #6|AllReduce #6 failed on ranks 0,2-3)'

# 6. Rank 2 enters every op 50 ms late; every rank then waits to be asked.
job slow 4 slow 2 0 --steps=60 --slow_ms=50 --linger
for _ in $(seq 600); do
  [[ $(grep -c lingering "$TMP/slow.out") == 4 ]] && break
  sleep 0.2
done
until_diagnosed slow 'straggler' &&
  expect slow '^rank 2 is the straggler of group 0: it entered last in [0-9]+ of the last 50 collectives'
kill "$JOB"

# 7. Two nodes of two workers; node b (ranks 2-3) freezes.
for n in a b; do
  "$RUN" --coordinator="$COHORT_ADDR" --run-id=frozen --node-id="node-$n" \
    --nnodes=1:2 --nproc-per-node=2 --max-restarts=1 --heartbeat-interval=1s \
    --last-call-timeout=1s -- "$WORKER" --steps=1000000 --pause_ms=20 \
    >"$TMP/frozen.out.$n" 2>"$TMP/frozen.err.$n" &
  PIDS+=($!)
  eval "NODE_$n=$!"
done
for _ in $(seq 600); do
  [[ $(grep -c '^step 5$' "$TMP/frozen.out.b") -ge 2 ]] && break
  sleep 0.2
done
kill -STOP "$NODE_b"; pkill -STOP -P "$NODE_b"
for _ in $(seq 600); do
  grep -q 'round 0: flight records in cohortd' "$TMP/frozen.err.a" && break
  sleep 0.2
done
grep -q 'round 0: flight records in cohortd' "$TMP/frozen.err.a" ||
  fail "frozen: node a never collected round 0's records: $(cat "$TMP/frozen.err.a")"
# Node a goes on alone in round 1, so its member is alive; node b's failed.
for _ in $(seq 600); do
  grep -q 'round 1: running ranks 0-1' "$TMP/frozen.err.a" && break
  sleep 0.2
done
"$CTL" diagnose frozen --request_dump=false --round=0 >"$TMP/frozen.diag" 2>&1
expect frozen '^ranks 0-1 are in AllReduce #[0-9]+ of group 0 .*; rank 2 sent no flight records \(dead in membership\); rank 3 sent no flight records \(dead in membership\)$'
expect frozen '^rank 2 is dead in membership$'

# Errors name what is wrong, and the server keeps serving.
"$CTL" diagnose nosuchrun --answer_timeout=0.2 >"$TMP/none.out" 2>&1
rc=$?
[[ $rc == 1 ]] && grep -q 'NOT_FOUND: run nosuchrun has no flight dumps under runs/nosuchrun/flight/' "$TMP/none.out" ||
  fail "no dumps: exit $rc: $(cat "$TMP/none.out")"
"$CTL" diagnose >"$TMP/usage.out" 2>&1
[[ $? == 2 ]] && grep -q 'diagnose takes RUN' "$TMP/usage.out" ||
  fail "no run: $(cat "$TMP/usage.out")"
"$CTL" dump sleep --answer_timeout=0 >"$TMP/bad.out" 2>&1
[[ $? == 2 ]] && grep -q -- '--answer_timeout must be > 0' "$TMP/bad.out" ||
  fail "bad timeout: $(cat "$TMP/bad.out")"

for run in sleep timeout skip other count die slow frozen; do
  echo "== $run"; cat "$TMP/$run.diag"
done
[[ $failures == 0 ]] && echo PASS || { echo "$failures failure(s)"; exit 1; }
