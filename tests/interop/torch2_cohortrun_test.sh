#!/usr/bin/env bash
# PyTorch 2.x scripts (the project venv's torch, tools/venv.sh) under
# cohortrun against a real cohortd: dist.init_process_group("gloo") with the
# default env:// bootstraps through the node's proxy and cohortd's TCPStore
# listener (cohortrun is given it with --tcpstore). Usage:
# torch2_cohortrun_test.sh MODE, where MODE is
#   ddp       two cohortrun nodes x 2 workers train the DDP tutorial
#             (tests/interop/torch/tutorial_ddp.py); every rank ends with the
#             same parameters, and the job's keys are under /cohortrun/ddp/0/
#             and nowhere else
#   two_jobs  two jobs at once on one cohortd (the all_reduce tutorial and
#             the DDP one) both end right, each job's keys under
#             /cohortrun/<run id>/0/ and nowhere else, though torch names
#             the same keys in both
#   env       a script that uses torchrun's environment
#             (tests/interop/torch/torch2_torchrun_worker.py: RANK, WORLD_SIZE,
#             MASTER_ADDR/PORT, init_process_group from env://), 2 nodes x 2
#             workers: the environment is torchrun's with the workers' store on
#             the node (TORCHELASTIC_USE_AGENT_STORE=True), the all_reduce is
#             right on every rank
#   restart   2 nodes x 2 workers of the DDP tutorial, --max-restarts=1; in the
#             first round rank 0 leaves a key in the job's store and rank 1
#             SIGKILLs itself mid-training
#             (tests/interop/torch/torch2_kill_worker.py); both nodes restart,
#             and round 1 starts without the first round's keys (torch 2.x names
#             the same keys in every round) and completes
set -uo pipefail

COHORTD=server/cohortd
RUN=worker/launch/cohortrun
CTL=client/cohortctl
SCRIPTS=tests/interop/torch
mode=${1:?usage: torch2_cohortrun_test.sh ddp|two_jobs|env|restart}
TMP=${TEST_TMPDIR:-$(mktemp -d)}
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# The checkout: requirements.txt is a runfile linked to its source.
requirements=$(readlink -f tools/requirements.txt)
root=$(dirname "$(dirname "$requirements")")
PYTHON=${PYTHON:-$root/.venv/bin/python}
if ! "$PYTHON" -c 'import torch.distributed as d; assert d.is_available()' 2>"$TMP/torch_import.err"; then
  echo "FAIL: $PYTHON cannot import torch.distributed (tools/setup.sh makes the venv):"
  cat "$TMP/torch_import.err"
  exit 1
fi
export PYTHONDONTWRITEBYTECODE=1 TORCH_CPP_LOG_LEVEL=ERROR

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
# $TMP/RUN.NODE.{out,err,rc}. wait_nodes waits for them all.
nodes=()
wait_nodes() { wait "${nodes[@]}"; nodes=(); }
node() {
  local run=$1 name=$2
  shift 2
  ( timeout 240 "$RUN" --coordinator="$ADDR" --tcpstore="127.0.0.1:$TSPORT" \
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

# expect_keys PREFIX KEY...: the keys under PREFIX are exactly these.
expect_keys() {
  local prefix=$1 got want
  shift
  got=$("$CTL" --addr="$ADDR" list "$prefix")
  want=$(printf '%s\n' "$@")
  [[ $got == "$want" ]] || fail "keys under $prefix:"$'\n'"$got"$'\n'"expected:"$'\n'"$want"
}

# gloo's bootstrap keys of a 2.x group of N ranks under env:// (torch 2.x
# puts no /worker/attempt_N before them, as 1.13 did), under PREFIX.
gloo_keys() {
  local prefix=$1 n=$2 r
  for ((r = 0; r < n; r++)); do echo "$prefix/default_pg/0//cpu//0/$r"; done
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
    # shellcheck disable=SC2046
    expect_keys /cohortrun/ddp/0//default_pg/ $(gloo_keys /cohortrun/ddp/0/ 4)
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
    # Both jobs named the same torch keys; each job's are under its run id
    # (the all_reduce tutorial's new_group adds group 1's, inside group 0's).
    # shellcheck disable=SC2046
    expect_keys /cohortrun/train/0//default_pg/ $(gloo_keys /cohortrun/train/0/ 2)
    expect_keys /cohortrun/sum/0//default_pg/ \
      /cohortrun/sum/0//default_pg/0//1//cpu//0/{0,1} $(gloo_keys /cohortrun/sum/0/ 2)
    expect_keys_only_under /cohortrun/sum/0/ /cohortrun/train/0/
    ;;
  env)
    out=$TMP/reports
    mkdir -p "$out"
    touch "$out/go"  # the worker's signal to leave at once
    for n in a b; do
      node env "$n" --nnodes=2 --nproc-per-node=2 -- "$PYTHON" "$SCRIPTS/torch2_torchrun_worker.py" "$out"
    done
    wait_nodes
    for n in a b; do expect_ok env "$n"; done
    # The proxy port each node's cohortrun logged for round 0.
    ports=$(sed -n 's/.*round 0: workers'"'"' torch store 127.0.0.1:\([0-9]*\) .*/\1/p' "$TMP"/env.*.err | sort -u | tr '\n' ' ')
    "$PYTHON" - "$out" "$ports" <<'PY' || fail "the workers' reports (above)"
import glob, json, sys
reports = sorted((json.load(open(p)) for p in glob.glob(sys.argv[1] + "/rank*.json")),
                 key=lambda r: r["rank"])
ports = set(sys.argv[2].split())
ok = [r["rank"] for r in reports] == [0, 1, 2, 3]
for r in reports:
    e = r["env"]
    print(f"rank {r['rank']}: all_reduce {r['all_reduce']} env {e}")
    ok &= r["world_size"] == 4 and r["all_reduce"] == r["expected"] == 10.0
    ok &= (e["RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) == (str(r["rank"]), "4", "2")
    ok &= e["LOCAL_RANK"] == str(r["rank"] % 2) and e["GROUP_RANK"] == str(r["rank"] // 2)
    ok &= e["MASTER_ADDR"] == "127.0.0.1" and e["MASTER_PORT"] in ports
    ok &= e["TORCHELASTIC_USE_AGENT_STORE"] == "True" and e["TORCHELASTIC_RUN_ID"] == "env"
    ok &= e["TORCHELASTIC_RESTART_COUNT"] == "0"
# Each node's workers use that node's proxy.
ok &= len({r["env"]["MASTER_PORT"] for r in reports}) == len(ports) == 2
sys.exit(0 if ok else 1)
PY
    # shellcheck disable=SC2046
    expect_keys /cohortrun/env/0//default_pg/ $(gloo_keys /cohortrun/env/0/ 4)
    expect_keys_only_under /cohortrun/env/0/
    ;;
  restart)
    for n in a b; do
      node kill "$n" --nnodes=2 --nproc-per-node=2 --max-restarts=1 -- "$PYTHON" \
        "$SCRIPTS/torch2_kill_worker.py" "$SCRIPTS/tutorial_ddp.py"
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
    grep -q "^\[rank 1\] rank 1: SIGKILL after step 2 at " <<<"$out" ||
      fail "rank 1 did not kill itself in round 0"
    grep -q "^\[rank 0\] rank 0: round 1 starts with fresh keys at " <<<"$out" ||
      fail "round 1 did not start with fresh keys"
    echo "round 0's ends, and round 1's start:"
    grep -e "SIGKILL after" -e "round 0 failed at" -e "round 1 starts" <<<"$out" | cut -c1-240
    expect_same_params kill 4
    [[ $("$CTL" --addr="$ADDR" get /cohortrun/kill/0//first_round) == "was here" ]] ||
      fail "the first round's key is not under /cohortrun/kill/0/"
    # shellcheck disable=SC2046
    expect_keys /cohortrun/kill/1//default_pg/ $(gloo_keys /cohortrun/kill/1/ 4)
    expect_keys_only_under /cohortrun/kill/0/ /cohortrun/kill/1/
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
