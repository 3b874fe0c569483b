#!/usr/bin/env bash
# The foundation's acceptance walk-through with the real binaries: cohortctl
# against cohortd, a blocked get released by another client, a clear error
# for an oversized key, the participants of a rendezvous round (and clear
# errors for a bad range or an unknown run), and every acknowledged write
# back after kill -9.
set -uo pipefail

COHORTD=server/cohortd
CTL=client/cohortctl
JOIN=tests/testing/join_main
TMP=${TEST_TMPDIR:-$(mktemp -d)}
DATA=$TMP/data
LOG=$TMP/cohortd.log
failures=0

fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
expect_eq() { [[ "$2" == "$3" ]] || fail "$1: expected '$3', got '$2'"; }

start_cohortd() {  # [port]
  # The log is appended to across restarts: wait for this start's line.
  local before
  before=$(grep -c "serving cohort.v1.Store on" "$LOG" 2>/dev/null)
  "$COHORTD" --listen="127.0.0.1:${1:-0}" --tcpstore_listen=127.0.0.1:0 --data_dir="$DATA" 2>>"$LOG" &
  PID=$!
  PORT=
  for _ in $(seq 600); do
    if (($(grep -c "serving cohort.v1.Store on" "$LOG") > ${before:-0})); then
      PORT=$(sed -n 's/.*serving cohort.v1.Store on 127.0.0.1:\([0-9]*\);.*/\1/p' "$LOG" | tail -1)
      break
    fi
    kill -0 "$PID" 2>/dev/null || break
    sleep 0.05
  done
  [[ -n "$PORT" ]] || { cat "$LOG"; echo "cohortd did not start"; exit 1; }
  export COHORT_ADDR=127.0.0.1:$PORT
}
trap 'kill -9 $PID 2>/dev/null' EXIT

start_cohortd

"$CTL" set greeting hello || fail "set"
expect_eq "get" "$("$CTL" get greeting)" "hello"
expect_eq "add" "$("$CTL" add counter 5)" "5"
expect_eq "add again" "$("$CTL" add counter 2)" "7"
expect_eq "a negative delta, as typed" "$("$CTL" add counter -9)" "-2"
expect_eq "a negative delta before a flag" "$("$CTL" add counter -3 --addr="127.0.0.1:$PORT")" "-5"
expect_eq "and back" "$("$CTL" add counter 12)" "7"
expect_eq "get counter" "$("$CTL" get counter)" "7"
expect_eq "cas missing+empty" "$("$CTL" cas lock '' owner-a)" "owner-a"
expect_eq "cas mismatch" "$("$CTL" cas lock owner-b owner-c)" "owner-a"
expect_eq "cas match" "$("$CTL" cas lock owner-a owner-b)" "owner-b"
expect_eq "cas missing+expected" "$("$CTL" cas nokey guess x)" "guess"
expect_eq "check" "$("$CTL" check greeting counter)" "true"
expect_eq "check missing" "$("$CTL" check greeting nokey)" "false"
"$CTL" wait greeting counter --timeout=1 || fail "wait on existing keys"
expect_eq "num-keys" "$("$CTL" num-keys)" "3"
expect_eq "list" "$("$CTL" list | tr '\n' ' ')" "counter greeting lock "
expect_eq "--addr flag wins" "$(COHORT_ADDR=127.0.0.1:1 "$CTL" --addr="127.0.0.1:$PORT" get greeting)" "hello"

# A blocked get returns when another client sets the key.
"$CTL" get late --timeout=30 >"$TMP/late.out" &
GETTER=$!
sleep 0.5
kill -0 $GETTER 2>/dev/null || fail "get returned before the key existed"
"$CTL" set late "it arrived" || fail "set late"
wait $GETTER || fail "blocked get failed"
expect_eq "released get" "$(cat "$TMP/late.out")" "it arrived"

# A timeout names the key; the exit status says it failed.
err=$("$CTL" wait absent1 absent2 --timeout=0.2 2>&1 >/dev/null); rc=$?
expect_eq "wait timeout rc" "$rc" "1"
[[ "$err" == *DEADLINE_EXCEEDED*'"absent1", "absent2"'* ]] || fail "timeout message: $err"

# An oversized key is a clear error and the server keeps serving.
err=$("$CTL" set "$(head -c 5000 /dev/zero | tr '\0' k)" v 2>&1); rc=$?
expect_eq "oversized rc" "$rc" "1"
[[ "$err" == *INVALID_ARGUMENT*max_key_bytes* ]] || fail "oversized message: $err"
err=$("$CTL" add greeting 1 2>&1); rc=$?
[[ $rc == 1 && "$err" == *FAILED_PRECONDITION*"not a decimal int64"* ]] || fail "add on text: $err"
expect_eq "still serving" "$("$CTL" get greeting)" "hello"

# Misuse is exit status 2.
"$CTL" frobnicate >/dev/null 2>&1; expect_eq "unknown command rc" "$?" "2"
"$CTL" set onlykey >/dev/null 2>&1; expect_eq "missing arg rc" "$?" "2"

# participants prints the nodes of a run's last completed round, a
# "NODE_RANK NODE_ID ADDRESS LOCAL_WORLD_SIZE FIRST_GLOBAL_RANK" a line;
# nodes rank by node id.
for i in 2 0 1; do
  "$JOIN" --addr="$COHORT_ADDR" --run=job --node="n$i" --address="host$i:2950$i" \
    --local_world_size=$((i + 1)) --nnodes=3 >"$TMP/join.$i.out" 2>&1 &
  joiner[i]=$!
done
for i in 0 1 2; do
  wait "${joiner[i]}" || fail "join n$i: $(cat "$TMP/join.$i.out")"
  expect_eq "join n$i" "$(cat "$TMP/join.$i.out")" "round 0 node_rank $i"
done
expect_eq "participants" "$("$CTL" participants job | tr '\n' '|')" \
  "0 n0 host0:29500 1 0|1 n1 host1:29501 2 1|2 n2 host2:29502 3 3|"
expect_eq "participants 1 3" "$("$CTL" participants job 1 3 | tr '\n' '|')" \
  "1 n1 host1:29501 2 1|2 n2 host2:29502 3 3|"
expect_eq "participants 0 1" "$("$CTL" participants job 0 1)" "0 n0 host0:29500 1 0"
for range in "2 4" "-1 2" "2 2" "2 1" "1 -1"; do
  # shellcheck disable=SC2086 # START END, split.
  err=$("$CTL" participants job $range 2>&1 >"$TMP/range.out"); rc=$?
  [[ $rc == 1 && "$err" == *INVALID_ARGUMENT*"[${range/ /, })"*"3 node ranks"* ]] ||
    fail "participants job $range: rc $rc, '$err'"
  expect_eq "participants job $range prints nothing" "$(cat "$TMP/range.out")" ""
done
err=$("$CTL" participants nojob 2>&1); rc=$?
[[ $rc == 1 && "$err" == *NOT_FOUND*"no run 'nojob'"* ]] || fail "participants of an unknown run: rc $rc, '$err'"
"$JOIN" --addr="$COHORT_ADDR" --run=pending --node=a --nnodes=2 >/dev/null 2>&1 &
PENDING=$!
for _ in $(seq 600); do  # until the join is in
  err=$("$CTL" participants pending 2>&1); rc=$?
  [[ "$err" != *NOT_FOUND* ]] && break
  sleep 0.05
done
[[ $rc == 1 && "$err" == *FAILED_PRECONDITION*"no completed round"* ]] ||
  fail "participants of a run still collecting: rc $rc, '$err'"
kill -9 $PENDING; wait $PENDING 2>/dev/null
"$CTL" participants job 1 >/dev/null 2>&1; expect_eq "participants START alone rc" "$?" "2"
"$CTL" participants job one 2 >/dev/null 2>&1; expect_eq "participants bad START rc" "$?" "2"

# Watch prints changes as they happen.
"$CTL" watch w/ >"$TMP/watch.out" &
WATCHER=$!
# Registered once it prints a change made after it started.
for i in $(seq 60); do
  "$CTL" set "w/probe$i" p >/dev/null
  grep -q " w/probe" "$TMP/watch.out" && break
  sleep 0.5
done
"$CTL" set w/a 1 >/dev/null; "$CTL" delete w/a >/dev/null; "$CTL" set other 1
for _ in $(seq 1200); do
  grep -q "DELETE w/a" "$TMP/watch.out" && break
  sleep 0.05
done
kill -TERM $WATCHER; wait $WATCHER || fail "watch exit status"
expect_eq "watch output" "$(grep -v " w/probe" "$TMP/watch.out" | cut -d' ' -f2- | tr '\n' '|')" "PUT w/a 1|DELETE w/a|"

# kill -9, restart on the same data dir: every acknowledged write is there.
for i in $(seq 50); do "$CTL" set "k/$i" "v$i" || fail "set k/$i"; done
kill -9 $PID; wait $PID 2>/dev/null
start_cohortd "$PORT"
expect_eq "counter after kill -9" "$("$CTL" get counter --timeout=1)" "7"
expect_eq "cas value after kill -9" "$("$CTL" get lock --timeout=1)" "owner-b"
for i in $(seq 50); do
  expect_eq "k/$i after kill -9" "$("$CTL" get "k/$i" --timeout=1)" "v$i"
done

kill -TERM $PID; wait $PID; expect_eq "cohortd exit status on SIGTERM" "$?" "0"
grep -q "stopped cleanly" "$LOG" || fail "no clean stop log line"

if ((failures)); then echo "$failures check(s) failed"; exit 1; fi
echo "cohortctl walk-through passed"
