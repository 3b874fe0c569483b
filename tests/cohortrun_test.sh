#!/usr/bin/env bash
# cohortrun end to end: two launchers ("nodes") against one cohortd, with
# real worker processes. Checks ranks and environment, a restart after a
# worker failure, and giving up with the failing rank named.
set -uo pipefail

COHORTD=server/cohortd
RUN=worker/launch/cohortrun
TMP=${TEST_TMPDIR:-$(mktemp -d)}
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

"$COHORTD" --listen=127.0.0.1:0 --tcpstore_listen=127.0.0.1:0 --engine=memory 2>"$TMP/cohortd.log" &
CPID=$!
trap 'kill $CPID 2>/dev/null' EXIT
for _ in $(seq 300); do
  PORT=$(sed -n 's/.*serving cohort.v1.Store on 127.0.0.1:\([0-9]*\);.*/\1/p' "$TMP/cohortd.log")
  [[ -n "$PORT" ]] && break
  sleep 0.05
done
[[ -n "$PORT" ]] || { cat "$TMP/cohortd.log"; exit 1; }
ADDR=127.0.0.1:$PORT

# Runs two nodes of run $1 with the remaining arguments; leaves each node's
# stdout, stderr and exit status in $TMP/$1.{out,err,rc}.{a,b}.
two_nodes() {
  local id=$1; shift
  local pids=()
  for n in a b; do
    ( "$RUN" --coordinator="$ADDR" --run-id="$id" --node-id="node-$n" \
        --heartbeat-interval=1s "$@" >"$TMP/$id.out.$n" 2>"$TMP/$id.err.$n"
      echo $? >"$TMP/$id.rc.$n" ) &
    pids+=($!)
  done
  wait "${pids[@]}"
}

# 1. Four workers on two nodes get ranks 0-3 exactly once, world size 4.
two_nodes env --nnodes=2:2 --nproc-per-node=2 -- /bin/sh -c \
  'echo "rank=$RANK local=$LOCAL_RANK world=$WORLD_SIZE lws=$LOCAL_WORLD_SIZE group=$GROUP_RANK groups=$GROUP_WORLD_SIZE round=$COHORT_ROUND restarts=$COHORT_RESTART_COUNT run=$COHORT_RUN_ID master=$MASTER_ADDR:$MASTER_PORT addr=$COHORT_ADDR prefix=$COHORT_STORE_PREFIX"'
for n in a b; do
  [[ $(cat "$TMP/env.rc.$n") == 0 ]] || fail "node $n exited $(cat "$TMP/env.rc.$n"): $(cat "$TMP/env.err.$n")"
done
ranks=$(cat "$TMP"/env.out.* | sed -n 's/^rank=\([0-9]*\) .*/\1/p' | sort -n | tr '\n' ' ')
[[ "$ranks" == "0 1 2 3 " ]] || fail "ranks: expected '0 1 2 3 ', got '$ranks'"
[[ $(grep -c "world=4 lws=2 .*groups=2 round=0 restarts=0 run=env master=127.0.0.1:[0-9][0-9]* addr=$ADDR prefix=runs/env/0" "$TMP"/env.out.* | awk -F: '{s+=$2} END {print s}') == 4 ]] ||
  fail "environment: $(cat "$TMP"/env.out.*)"
for n in a b; do
  group=$(sed -n 's/.*local=\([0-9]\) .*group=\([0-9]\) .*/\2/p' "$TMP/env.out.$n" | sort -u | tr -d '\n')
  locals=$(sed -n 's/.*local=\([0-9]\) .*/\1/p' "$TMP/env.out.$n" | sort | tr -d '\n')
  [[ ${#group} == 1 && "$locals" == "01" ]] || fail "node $n: group '$group', local ranks '$locals'"
done

# 2. Rank 3 fails on the first attempt; both nodes restart and succeed.
two_nodes once --nnodes=2:2 --nproc-per-node=2 --max-restarts=1 --tee -- /bin/sh -c \
  'echo "restart=$COHORT_RESTART_COUNT"
   if [ "$COHORT_RESTART_COUNT" = 0 ] && [ "$RANK" = 3 ]; then exit 1; fi
   if [ "$COHORT_RESTART_COUNT" = 0 ]; then exec sleep 30; fi'
for n in a b; do
  [[ $(cat "$TMP/once.rc.$n") == 0 ]] || fail "fail-once node $n exited $(cat "$TMP/once.rc.$n"): $(cat "$TMP/once.err.$n")"
done
[[ $(cat "$TMP"/once.out.* | grep -c "^\[rank [0-3]\] restart=1$") == 4 ]] ||
  fail "every rank should run again with COHORT_RESTART_COUNT=1 (and --tee prefixes): $(cat "$TMP"/once.out.*)"

# 3. Rank 3 always fails: both nodes give up, and the failing rank is named.
two_nodes always --nnodes=2:2 --nproc-per-node=2 --max-restarts=1 -- /bin/sh -c \
  'if [ "$RANK" = 3 ]; then exit 3; fi; exec sleep 30'
for n in a b; do
  [[ $(cat "$TMP/always.rc.$n") != 0 ]] || fail "always-failing node $n exited 0"
done
grep -q "rank 3 .*exit code 3" "$TMP"/always.err.* || fail "no message naming rank 3: $(cat "$TMP"/always.err.*)"

# 4. A C++ worker initialising its process group from env:// (Gloo over
#    loopback): the four ranks of two nodes sum 1..4.
two_nodes gloo --nnodes=2:2 --nproc-per-node=2 -- worker/collective/examples/allreduce
for n in a b; do
  [[ $(cat "$TMP/gloo.rc.$n") == 0 ]] || fail "allreduce node $n exited $(cat "$TMP/gloo.rc.$n"): $(cat "$TMP/gloo.err.$n")"
done
[[ $(cat "$TMP"/gloo.out.* | grep -c "of 4: sum of 1..4 = 10$") == 4 ]] ||
  fail "allreduce output: $(cat "$TMP"/gloo.out.*)"

if ((failures)); then
  cat "$TMP/cohortd.log"
  echo "$failures check(s) failed"
  exit 1
fi
echo "cohortrun end to end passed"
