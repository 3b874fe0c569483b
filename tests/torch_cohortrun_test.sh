#!/usr/bin/env bash
# Unmodified PyTorch scripts under cohortrun against a real cohortd:
# dist.init_process_group("gloo") with the default env:// bootstraps through
# the node's proxy and cohortd's TCPStore listener, and no rank hosts a
# store. The scripts are tests/torch/tutorial_*.py, written as PyTorch's
# tutorials write them. Usage: torch_cohortrun_test.sh MODE, where MODE is
#   ddp       two cohortrun nodes x 2 workers train the DDP tutorial's
#             model; every rank ends with the same parameters
#   two_jobs  two jobs at once on one cohortd (the all_reduce tutorial and
#             the DDP one) both end right, each job's keys under
#             /cohortrun/<run id>/ and nowhere else
#   restart   a worker exits 1 in the first round (--max-restarts=1); the
#             second round starts with none of the first round's keys and
#             completes
set -uo pipefail

PYTHON=/usr/bin/python3
COHORTD=server/cohortd
RUN=worker/launch/cohortrun
CTL=client/cohortctl
SCRIPTS=tests/torch
mode=${1:?usage: torch_cohortrun_test.sh ddp|two_jobs|restart}
TMP=${TEST_TMPDIR:-$(mktemp -d)}
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# A machine without torch fails here: CI installs python3-torch.
if ! "$PYTHON" -c 'import torch.distributed as d; assert d.is_available()' 2>"$TMP/torch_import.err"; then
  echo "FAIL: $PYTHON cannot import torch.distributed (install Debian's python3-torch):"
  cat "$TMP/torch_import.err"
  exit 1
fi
export PYTHONDONTWRITEBYTECODE=1

"$COHORTD" --listen=127.0.0.1:0 --tcpstore_listen=127.0.0.1:0 --engine=memory 2>"$TMP/cohortd.log" &
CPID=$!
trap 'kill $CPID 2>/dev/null' EXIT
for _ in $(seq 300); do
  PORT=$(sed -n 's/.*serving cohort.v1.Store on 127.0.0.1:\([0-9]*\);.*/\1/p' "$TMP/cohortd.log")
  TSPORT=$(sed -n 's/.*serving the TCPStore protocol on 127.0.0.1:\([0-9]*\).*/\1/p' "$TMP/cohortd.log")
  [[ -n "$PORT" && -n "$TSPORT" ]] && break
  sleep 0.05
done
[[ -n "$PORT" && -n "$TSPORT" ]] || { cat "$TMP/cohortd.log"; exit 1; }
ADDR=127.0.0.1:$PORT

# node RUN NODE ARGS...: one cohortrun in the background; its stdout
# (lines prefixed "[rank N] "), stderr and exit status go to
# $TMP/RUN.NODE.{out,err,rc}. wait_nodes waits
# for them all.
nodes=()
wait_nodes() { wait "${nodes[@]}"; nodes=(); }
node() {
  local run=$1 name=$2
  shift 2
  ( timeout 120 "$RUN" --coordinator="$ADDR" --tcpstore="127.0.0.1:$TSPORT" \
      --run-id="$run" --node-id="$name" --heartbeat-interval=1s --tee "$@" \
      >"$TMP/$run.$name.out" 2>"$TMP/$run.$name.err"
    echo $? >"$TMP/$run.$name.rc" ) &
  nodes+=($!)
}

expect_ok() {
  local run=$1 name=$2
  local rc
  rc=$(cat "$TMP/$run.$name.rc")
  [[ $rc == 0 ]] || fail "$run node $name exited $rc:"$'\n'"$(cat "$TMP/$run.$name.out" "$TMP/$run.$name.err")"
}

# expect_same_params RUN N: N ranks printed one parameter digest.
expect_same_params() {
  local run=$1 n=$2 lines digests
  lines=$(cat "$TMP/$run".*.out | grep -c "^\[rank [0-9]*\] rank [0-9]* of $n: params ")
  digests=$(cat "$TMP/$run".*.out | sed -n 's/.* of [0-9]*: params //p' | sort -u | wc -l)
  [[ $lines == "$n" && $digests == 1 ]] ||
    fail "$run: expected $n ranks with one parameter digest, got:"$'\n'"$(cat "$TMP/$run".*.out)"
}

# Every key torch wrote is under a run's namespace; cohortd's own are
# under /cohort/.
expect_keys_only_under() {
  local stray
  "$CTL" --addr="$ADDR" list >"$TMP/keys" || fail "cohortctl list failed"
  stray=$(grep -v -e '^/cohort/' "${@/#/-e^}" "$TMP/keys")
  [[ -z $stray ]] || fail "keys outside $*:"$'\n'"$stray"
}

expect_keys_under() {
  local prefix=$1 n
  n=$("$CTL" --addr="$ADDR" list "$prefix" | wc -l)
  [[ $n -gt 0 ]] || fail "no keys under $prefix"
}

start=$SECONDS
case $mode in
  ddp)
    for n in a b; do
      node ddp "$n" --nnodes=2 --nproc-per-node=2 -- "$PYTHON" "$SCRIPTS/tutorial_ddp.py"
    done
    wait_nodes
    for n in a b; do expect_ok ddp "$n"; done
    expect_same_params ddp 4
    expect_keys_under /cohortrun/ddp/0///worker/attempt_0/default_pg/
    expect_keys_only_under /cohortrun/ddp/0/
    ;;
  two_jobs)
    node sum a --nproc-per-node=2 -- "$PYTHON" "$SCRIPTS/tutorial_allreduce.py"
    node train a --nproc-per-node=2 -- "$PYTHON" "$SCRIPTS/tutorial_ddp.py"
    wait_nodes
    expect_ok sum a
    expect_ok train a
    [[ $(grep -c "^\[rank [01]\] Rank  [01]  has data  tensor(2.)$" "$TMP/sum.a.out") == 2 ]] ||
      fail "sum: expected 2 ranks with data 2:"$'\n'"$(cat "$TMP/sum.a.out")"
    expect_same_params train 2
    # Both named the same torch keys ("//worker/attempt_0/default_pg/...":
    # 1.13's client puts "/" before PrefixStore's "/worker/attempt_0/");
    # each job's are under its own run id.
    expect_keys_under /cohortrun/sum/0///worker/attempt_0/default_pg/
    expect_keys_under /cohortrun/train/0///worker/attempt_0/default_pg/
    expect_keys_only_under /cohortrun/sum/0/ /cohortrun/train/0/
    ;;
  restart)
    node again a --nproc-per-node=2 --max-restarts=1 -- \
      "$PYTHON" "$SCRIPTS/fail_first_round.py" "$SCRIPTS/tutorial_ddp.py"
    wait_nodes
    expect_ok again a
    grep -q "restarting: rank 1 (local rank 1) failed with exit code 1 (restart 1 of 1)" "$TMP/again.a.err" ||
      fail "no restart after rank 1's failure:"$'\n'"$(cat "$TMP/again.a.err")"
    grep -q "^\[rank 0\] rank 0: round 1 starts with fresh keys" "$TMP/again.a.out" ||
      fail "round 1 did not start with fresh keys:"$'\n'"$(cat "$TMP/again.a.out")"
    expect_same_params again 2
    [[ $("$CTL" --addr="$ADDR" get /cohortrun/again/0//first_round) == "was here" ]] ||
      fail "the first round's key is not under /cohortrun/again/0/"
    expect_keys_under /cohortrun/again/1///worker/attempt_1/default_pg/
    expect_keys_only_under /cohortrun/again/0/ /cohortrun/again/1/
    ;;
  *)
    echo "unknown mode $mode"
    exit 2
    ;;
esac
echo "$mode: $((SECONDS - start)) s"

if [[ $failures -gt 0 ]]; then
  echo "cohortd's log:"; cat "$TMP/cohortd.log"
  exit 1
fi
echo PASS
