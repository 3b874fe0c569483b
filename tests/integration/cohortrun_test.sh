#!/usr/bin/env bash
# cohortrun end to end: two launchers ("nodes") against one cohortd, with
# real worker processes. Checks ranks and environment, a restart after a
# worker failure, and giving up with the failing rank named. Then where the
# workers' torch stores go: cohortd's TCPStore listener on a port of its
# own choosing, found by asking cohortd (no --tcpstore), serves an
# unmodified torch job; the start-up check stops cohortrun before any
# worker runs, naming the address, where it came from and why, when
# --tcpstore points at a closed port or at another cohortd's listener; and
# a cohortd without a listener gives the workers no MASTER_ADDR/PORT.
set -uo pipefail

COHORTD=server/cohortd
RUN=worker/launch/cohortrun
PYTHON=/usr/bin/python3
TMP=${TEST_TMPDIR:-$(mktemp -d)}
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# start_cohortd NAME ARGS...: a cohortd whose log is $TMP/NAME.log; sets
# PORT (gRPC) and CPIDS.
CPIDS=()
trap 'kill "${CPIDS[@]}" 2>/dev/null' EXIT
start_cohortd() {
  local name=$1; shift
  "$COHORTD" --listen=127.0.0.1:0 --engine=memory "$@" 2>"$TMP/$name.log" &
  CPIDS+=($!)
  PORT=
  for _ in $(seq 300); do
    PORT=$(sed -n 's/.*serving cohort.v1.Store on 127.0.0.1:\([0-9]*\);.*/\1/p' "$TMP/$name.log")
    [[ -n "$PORT" ]] && break
    sleep 0.05
  done
  [[ -n "$PORT" ]] || { cat "$TMP/$name.log"; exit 1; }
}

start_cohortd cohortd --tcpstore_listen=127.0.0.1:0
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

# 5. An unmodified torch script (init_process_group("gloo") from env://)
#    on two nodes, no --tcpstore: cohortrun asks cohortd where its listener
#    is (port 0 above: not 29400) and checks it before the workers start.
if ! "$PYTHON" -c 'import torch.distributed as d; assert d.is_available()' 2>"$TMP/torch_import.err"; then
  fail "$PYTHON cannot import torch.distributed (install Debian's python3-torch): $(cat "$TMP/torch_import.err")"
else
  two_nodes torch --nnodes=2:2 --tee -- "$PYTHON" tests/interop/torch/tutorial_allreduce.py
  for n in a b; do
    [[ $(cat "$TMP/torch.rc.$n") == 0 ]] || fail "torch node $n exited $(cat "$TMP/torch.rc.$n"): $(cat "$TMP/torch.out.$n" "$TMP/torch.err.$n")"
    grep -q "torch stores go to the TCPStore listener at 127.0.0.1:[0-9]* (from cohortd at $ADDR, where its listener is bound (--tcpstore_listen)); checked: it serves this cohortd's keys" \
      "$TMP/torch.err.$n" || fail "torch node $n did not say where its torch store is: $(cat "$TMP/torch.err.$n")"
  done
  [[ $(cat "$TMP"/torch.out.* | grep -c "has data  tensor(2.)") == 2 ]] ||
    fail "torch tutorial: expected 2 ranks with data 2: $(cat "$TMP"/torch.out.*)"
fi

# one_node ID ARGS...: one cohortrun whose worker leaves a mark; its output
# goes to $TMP/ID.{err,rc}, and $TMP/ID.ran exists if a worker ran.
one_node() {
  local id=$1; shift
  timeout 60 "$RUN" --coordinator="$ADDR" --run-id="$id" "$@" -- \
    /bin/sh -c "echo \"[\$MASTER_ADDR:\$MASTER_PORT]\" >$TMP/$id.ran" \
    >/dev/null 2>"$TMP/$id.err"
  echo $? >"$TMP/$id.rc"
}
# expect_refused ID TEXT...: cohortrun stopped before joining, every TEXT
# in its message.
expect_refused() {
  local id=$1; shift
  [[ $(cat "$TMP/$id.rc") == 1 ]] || fail "$id: exited $(cat "$TMP/$id.rc"), not 1: $(cat "$TMP/$id.err")"
  [[ -e "$TMP/$id.ran" ]] && fail "$id: a worker ran"
  grep -q "joining run" "$TMP/$id.err" && fail "$id: joined the run before failing: $(cat "$TMP/$id.err")"
  for text in "$@"; do
    grep -qF -- "$text" "$TMP/$id.err" || fail "$id: no '$text' in: $(cat "$TMP/$id.err")"
  done
}

# 6. --tcpstore at a closed port (nothing listens on port 1).
one_node closed --tcpstore=127.0.0.1:1
expect_refused closed "TCPStore listener at 127.0.0.1:1 (from --tcpstore) failed cohortrun's start-up check" \
  "the connection was refused: nothing listens on that port"
COHORT_TCPSTORE=127.0.0.1:1 one_node closed_env
expect_refused closed_env "127.0.0.1:1 (from \$COHORT_TCPSTORE)" "refused"

# 7. --tcpstore at another cohortd's listener: it answers, but not with
#    this cohortd's keys.
start_cohortd other --tcpstore_listen=127.0.0.1:0
OTHER_TCPSTORE=$(sed -n 's/.*serving the TCPStore protocol on \(127.0.0.1:[0-9]*\) .*/\1/p' "$TMP/other.log")
one_node other --tcpstore="$OTHER_TCPSTORE" --tcpstore-check-timeout=2s
expect_refused other "TCPStore listener at $OTHER_TCPSTORE (from --tcpstore) failed" \
  "it answers the TCPStore protocol" "it belongs to a different cohortd"

# 8. A cohortd without a TCPStore listener: the workers run, with no torch
#    store, and cohortrun says why.
start_cohortd plain --tcpstore_listen=
ADDR=127.0.0.1:$PORT one_node plain
[[ $(cat "$TMP/plain.rc") == 0 ]] || fail "no listener: exited $(cat "$TMP/plain.rc"): $(cat "$TMP/plain.err")"
[[ $(cat "$TMP/plain.ran" 2>/dev/null) == "[:]" ]] || fail "no listener: the worker saw $(cat "$TMP/plain.ran" 2>/dev/null)"
grep -q "the workers get no torch store (no MASTER_ADDR, MASTER_PORT): cohortd at 127.0.0.1:$PORT, which serves no TCPStore listener" \
  "$TMP/plain.err" || fail "no listener: $(cat "$TMP/plain.err")"

if ((failures)); then
  cat "$TMP/cohortd.log"
  echo "$failures check(s) failed"
  exit 1
fi
echo "cohortrun end to end passed"
