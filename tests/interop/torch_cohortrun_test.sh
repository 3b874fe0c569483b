#!/usr/bin/env bash
# Unmodified PyTorch scripts under cohortrun against a real cohortd:
# dist.init_process_group("gloo") with the default env:// bootstraps through the
# node's proxy and cohortd's TCPStore listener, and no rank hosts a store. The
# scripts are tests/interop/torch/tutorial_*.py, written as PyTorch's tutorials
# write them. Usage: torch_cohortrun_test.sh MODE, where MODE is
#   ddp       two cohortrun nodes x 2 workers train the DDP tutorial's
#             model; every rank ends with the same parameters
#   two_jobs  two jobs at once on one cohortd (the all_reduce tutorial and
#             the DDP one) both end right, each job's keys under
#             /cohortrun/<run id>/ and nowhere else
#   restart   a worker exits 1 in the first round (--max-restarts=1); the
#             second round starts with none of the first round's keys and
#             completes
# and with the torch.distributed backend "cohort" (cohort_torch.so, which Bazel
# built, on PYTHONPATH as tests/interop/torch_backend_test.sh puts it):
#   backend_ddp      the ddp job twice, with --backend=gloo then
#                    --backend=cohort: in each every rank ends with the same
#                    parameters, and cohort's equal gloo's (allclose, rtol
#                    1e-5, atol 1e-6)
#   backend_restart  the ddp job on "cohort" with --max-restarts=1; in the first
#                    round rank 1 SIGKILLs itself mid-training
#                    (tests/interop/torch/kill_first_round.py): the other ranks'
#                    next op fails at once with an error naming it, round 1
#                    starts within seconds and completes with the same
#                    parameters on every rank
set -uo pipefail

PYTHON=/usr/bin/python3
COHORTD=server/cohortd
RUN=worker/launch/cohortrun
CTL=client/cohortctl
SCRIPTS=tests/interop/torch
mode=${1:?usage: torch_cohortrun_test.sh ddp|two_jobs|restart|backend_ddp|backend_restart}
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
if [[ $mode == backend_* ]]; then
  module_dir="$PWD/worker/torch"
  if [[ ! -f "$module_dir/cohort_torch.so" ]]; then
    echo "FAIL: no cohort_torch.so in $module_dir (a data dependency of this test)"
    exit 1
  fi
  export PYTHONPATH="$module_dir"  # cohortrun passes it on to the workers
fi

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
# under /cohort/, and cohortrun's request for flight records, when a round
# failed, is runs/<run>/flight/request.
expect_keys_only_under() {
  local stray
  "$CTL" --addr="$ADDR" list >"$TMP/keys" || fail "cohortctl list failed"
  stray=$(grep -v -e '^/cohort/' -e '^runs/[^/]*/flight/request$' \
    "${@/#/-e^}" "$TMP/keys")
  [[ -z $stray ]] || fail "keys outside $*:"$'\n'"$stray"
}

expect_keys_under() {
  local prefix=$1 n
  n=$("$CTL" --addr="$ADDR" list "$prefix" | wc -l)
  [[ $n -gt 0 ]] || fail "no keys under $prefix"
}

# in_order T1 T2...: each wall-clock time (seconds, fractional; printed by
# processes of this host, so read off one clock) is at or after the one
# before it.
in_order() { awk 'BEGIN { for (i = 2; i < ARGC; i++) if (ARGV[i] < ARGV[i - 1]) exit 1 }' "$@"; }

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
    # Rank 1 exits 1; rank 0's barrier then fails at once ("connection
    # closed by peer") and it exits 1 too, so either exit may be the one
    # cohortrun sees first (under ASan rank 0's often is).
    grep -qE "restarting: rank [01] \(local rank [01]\) failed with exit code 1 \(restart 1 of 1\)" "$TMP/again.a.err" ||
      fail "no restart after rank 1's failure:"$'\n'"$(cat "$TMP/again.a.err")"
    grep -q "^\[rank 0\] rank 0: round 1 starts with fresh keys" "$TMP/again.a.out" ||
      fail "round 1 did not start with fresh keys:"$'\n'"$(cat "$TMP/again.a.out")"
    expect_same_params again 2
    [[ $("$CTL" --addr="$ADDR" get /cohortrun/again/0//first_round) == "was here" ]] ||
      fail "the first round's key is not under /cohortrun/again/0/"
    expect_keys_under /cohortrun/again/1///worker/attempt_1/default_pg/
    expect_keys_only_under /cohortrun/again/0/ /cohortrun/again/1/
    ;;
  backend_ddp)
    # One job after the other (2 cores), each rank 0 saving its parameters.
    for backend in gloo cohort; do
      for n in a b; do
        node "ddp_$backend" "$n" --nnodes=2 --nproc-per-node=2 -- "$PYTHON" \
          "$SCRIPTS/tutorial_ddp.py" --backend="$backend" --save="$TMP/$backend.pt"
      done
      wait_nodes
      for n in a b; do expect_ok "ddp_$backend" "$n"; done
      expect_same_params "ddp_$backend" 4
      grep -q "^\[rank 0\] rank 0: saved the $backend job's parameters" "$TMP/ddp_$backend.a.out" ||
        fail "ddp_$backend: rank 0 saved no parameters:"$'\n'"$(cat "$TMP/ddp_$backend".*.out)"
    done
    "$PYTHON" - "$TMP/gloo.pt" "$TMP/cohort.pt" <<'PY' || fail "the cohort job's parameters are not the gloo job's"
import sys
import torch
gloo, cohort = torch.load(sys.argv[1]), torch.load(sys.argv[2])
assert gloo.keys() == cohort.keys(), (list(gloo), list(cohort))
ok = True
for key, value in gloo.items():
    same = torch.allclose(cohort[key], value, rtol=1e-5, atol=1e-6)
    diff = (cohort[key] - value).abs().max().item()
    print(f"{key}: cohort - gloo: max |diff| {diff:.3g}{'' if same else ' (too far)'}")
    ok = ok and same
sys.exit(0 if ok else 1)
PY
    # cohort's group bootstraps through the store torch hands it: the job's.
    expect_keys_under /cohortrun/ddp_cohort/0///worker/attempt_0/default_pg/
    expect_keys_only_under /cohortrun/ddp_gloo/0/ /cohortrun/ddp_cohort/0/
    ;;
  backend_restart)
    for n in a b; do
      node kill "$n" --nnodes=2 --nproc-per-node=2 --max-restarts=1 -- "$PYTHON" \
        "$SCRIPTS/kill_first_round.py" "$SCRIPTS/tutorial_ddp.py" --backend=cohort \
        --save="$TMP/restart.pt"
    done
    wait_nodes
    for n in a b; do expect_ok kill "$n"; done
    out=$(cat "$TMP"/kill.*.out)
    # Each node restarts for the first failure it sees: rank 1's SIGKILL,
    # a survivor exiting 1 after its error, or (node b) node a's report.
    for n in a b; do
      grep -q "restarting: .* (restart 1 of 1)" "$TMP/kill.$n.err" ||
        fail "node $n did not restart after round 0:"$'\n'"$(cat "$TMP/kill.$n.err")"
    done
    killed=$(sed -n 's/^\[rank 1\] rank 1: SIGKILL after step [0-9]* at \([0-9.]*\)$/\1/p' <<<"$out")
    if [[ -z $killed ]]; then
      fail "rank 1 did not kill itself in round 0"
    else
      # The ops' timeout is the tutorial's default, 30 minutes: no error in
      # this test comes from it. A survivor fails on the broken connection
      # and prints its error; cohortrun SIGKILLs one still running 5 s
      # (--stop-grace) after its SIGTERM, so one that printed nothing hung in
      # its op. Order: the kill, each survivor's error, then round 1 (which
      # starts only once every worker of round 0 has exited).
      started=$(sed -n 's/^\[rank 0\] rank 0: round 1 starts at \([0-9.]*\)$/\1/p' <<<"$out")
      [[ -n $started ]] || fail "round 1 did not start after the kill at $killed"
      for r in 0 2 3; do
        failed=$(sed -n "s/^\[rank $r\] rank $r: round 0 failed at \([0-9.]*\): .*AllReduce.*/\1/p" <<<"$out")
        if [[ -z $failed ]]; then
          fail "rank $r printed no error naming its AllReduce in round 0"
        elif ! in_order "$killed" "$failed" ${started:+"$started"}; then
          fail "rank $r's AllReduce failed at $failed: not between the kill at $killed and round 1's start at ${started:-never}"
        fi
      done
      echo "round 0's errors (rank 1 killed at $killed), and round 1's start:"
      grep -e "round 0 failed at" -e "round 1 starts at" <<<"$out" | cut -c1-240
    fi
    expect_same_params kill 4
    grep -q "^\[rank 0\] rank 0: saved the cohort job's parameters" <<<"$out" ||
      fail "round 1's rank 0 saved no parameters of the cohort job"
    [[ $failures == 0 ]] || echo "the job's output:"$'\n'"$out"
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
