#!/usr/bin/env bash
# Linearizability under faults, as etcd's robustness suite checks it:
# concurrent clients record every operation's invocation and completion
# (tests/testing/store_history over gRPC; PyTorch's own TCPStore clients,
# torch 2.x and 1.13, through the listener: torch_store_history.py), and
# porcupine (tests/robustness/lincheck) checks that the whole history is
# consistent with one order of operations of a c10d store: reads, blocking
# gets and waits, add's counter, compare_set, delete, multi_get/multi_set.
#
#   linearizability_test.sh single    one cohortd on RocksDB, kill -9 and
#                                     restart at random moments
#   linearizability_test.sh ha        3 etcd members, 3 cohortd replicas:
#                                     cohortd and etcd leaders killed, an
#                                     etcd member and a replica stopped
#   linearizability_test.sh planted   the planted bug (a replica serves reads
#                                     from a stale view): the checker must
#                                     find a violation
# LIN_SECONDS (per run) and LIN_FAULTS (faults per kind) lengthen a run;
# bench/linearizability.sh runs the long campaign.
set -uo pipefail

MODE=${1:-single}
COHORTD=server/cohortd
PLANTED=server/cohortd_planted_stale_reads
CTL=client/cohortctl
HISTORY=tests/testing/store_history
TORCH_CLIENT=tests/robustness/torch_store_history.py
# The checkout's venv (PyTorch 2.x): requirements.txt is a runfile linked
# to its source.
root=$(dirname "$(dirname "$(readlink -f tools/requirements.txt)")")
VENV_PYTHON=${PYTHON:-$root/.venv/bin/python}
# torch's client logs a warning for every timed-out wait.
export TORCH_CPP_LOG_LEVEL=ERROR
# Under a sanitizer (COHORT_TEST_TIME_SCALE, .bazelrc) every process is
# slower: the clients run longer, so that the faults all fit in.
SECONDS_PER_RUN=${LIN_SECONDS:-$((20 * ${COHORT_TEST_TIME_SCALE:-1}))}
FAULTS=${LIN_FAULTS:-4}
# Key groups at a time (the clients move to fresh ones every 5 s, so a
# long run stays cheap to check: store_history's header).
KEY_GROUPS=${LIN_GROUPS:-4}
TMP=${TEST_TMPDIR:-$(mktemp -d)}
OUT=${TEST_UNDECLARED_OUTPUTS_DIR:-$TMP}
export ETCDCTL_API=3
source tests/robustness/cluster_lib.sh
trap cluster_cleanup EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
rand() { awk -v lo="$1" -v hi="$2" 'BEGIN { srand(); printf "%.2f", lo + rand() * (hi - lo) }'; }

bash tests/robustness/lincheck/build.sh "$TMP/lincheck" || exit 1

# clients TCPSTORE_PORT TARGETS...: starts the recorded clients, in the
# background, for SECONDS_PER_RUN: 6 gRPC clients spread over TARGETS, two
# torch 2.x clients and one torch 1.13 client on TCPSTORE_PORT.
client_pids=()
clients() {
  local port=$1; shift
  local targets
  targets=$(IFS=';'; echo "$*")
  "$HISTORY" --targets="$targets" --clients=6 --client_base=0 --groups="$KEY_GROUPS" \
    --seconds="$SECONDS_PER_RUN" --out="$TMP/grpc.jsonl" >"$TMP/grpc.out" 2>&1 &
  client_pids=($!)
  if [[ -x "$VENV_PYTHON" ]]; then
    torch_clients "$VENV_PYTHON" "$port" 2 50 torch2 &
    client_pids+=($!)
  else
    fail "no PyTorch 2.x venv (tools/setup.sh makes it)"
  fi
  torch_clients /usr/bin/python3 "$port" 1 60 torch113 &
  client_pids+=($!)
}
# torch_clients PYTHON PORT N BASE NAME: N torch clients for the rest of the
# run, into $TMP/NAME.jsonl. When torch aborts the process (1.13's client
# can, on a connection cohortd's kill reset), the operations it had in
# flight go into the history as unknown and the clients start again as new
# ones (client numbers BASE + 100 per restart).
torch_clients() {
  local python=$1 port=$2 n=$3 base=$4 name=$5 end=$((SECONDS + SECONDS_PER_RUN)) restarts=0 rc
  : >"$TMP/$name.jsonl"
  while ((SECONDS < end)); do
    "$python" "$TORCH_CLIENT" --port="$port" --clients="$n" --groups="$KEY_GROUPS" \
      --client-base=$((base + 100 * restarts)) --seconds=$((end - SECONDS)) \
      --out="$TMP/$name.jsonl" >>"$TMP/$name.out" 2>&1
    rc=$?
    cat "$TMP/$name.jsonl".inflight.* >>"$TMP/$name.jsonl" 2>/dev/null
    rm -f "$TMP/$name.jsonl".inflight.*
    ((rc == 0)) && break
    restarts=$((restarts + 1))
    echo "torch_store_history ($name) exited $rc; restarted as new clients ($restarts)" >>"$TMP/$name.out"
  done
  grep -h "restarted as new" "$TMP/$name.out" | tail -1
  return 0
}
# Waits for the clients; true while any runs.
clients_running() { local p; for p in "${client_pids[@]}"; do kill -0 "$p" 2>/dev/null && return 0; done; return 1; }
clients_wait() {
  local p
  for p in "${client_pids[@]}"; do wait "$p" || fail "a client exited with an error"; done
  grep -h "history:" "$TMP"/grpc.out "$TMP"/torch*.out
}

# check EXPECT: runs the checker on the histories; EXPECT is ok or illegal.
check() {
  local expect=$1 rc
  "$TMP/lincheck" --json --html="$OUT" "$TMP"/grpc.jsonl "$TMP"/torch*.jsonl \
    >"$TMP/lincheck.json" 2>"$TMP/lincheck.err"
  rc=$?
  echo "lincheck: $(cat "$TMP/lincheck.json")"
  case "$expect:$rc" in
    ok:0 | illegal:1) ;;
    *) head -40 "$TMP/lincheck.err"; cp "$TMP"/*.jsonl "$OUT"/ 2>/dev/null
       fail "lincheck exited $rc where $expect was expected (histories kept in the test's outputs)" ;;
  esac
  python3 - "$TMP/lincheck.json" "$TMP"/*.jsonl <<'EOF'
import collections, json, sys
summary = json.load(open(sys.argv[1]))
ok = collections.Counter()
for path in sys.argv[2:]:
    for line in open(path):
        r = json.loads(line)
        ok[(path.rsplit("/", 1)[1].split(".")[0], r["status"])] += 1
print("operations by client kind:", ", ".join("%s %s=%d" % (k[0], k[1], n) for k, n in sorted(ok.items())))
print("checked %d operations: %d unknown, violations %d" % (
    summary["operations"], summary["unknown"], summary["violations"]))
EOF
}

finish() {
  if ((failures)); then
    for f in "$TMP"/c*.log; do [[ -f $f ]] && { echo "--- $f"; tail -15 "$f"; }; done
    echo "linearizability_test $MODE: $failures check(s) failed"
    exit 1
  fi
  echo "linearizability_test $MODE: every check passed"
  exit 0
}

case $MODE in
single)
  read -r grpc_port tcp_port <<<"$(free_ports 2)"
  start_single() {
    "$COHORTD" --listen="127.0.0.1:$grpc_port" --tcpstore_listen="127.0.0.1:$tcp_port" \
      --data_dir="$TMP/db" >>"$TMP/c0.log" 2>&1 &
    cohortd_pid[0]=$!
  }
  start_single
  timeout 60 "$CTL" --addr="127.0.0.1:$grpc_port" --connect_timeout=30 check x >/dev/null ||
    { cat "$TMP/c0.log"; fail "cohortd did not serve"; finish; }
  clients "$tcp_port" "127.0.0.1:$grpc_port"
  kills=0
  sleep 1
  while clients_running && ((kills < FAULTS)); do
    sleep "$(rand 1.0 2.5)"
    kill -9 "${cohortd_pid[0]}"; wait "${cohortd_pid[0]}" 2>/dev/null
    kills=$((kills + 1))
    sleep "$(rand 0.2 0.8)"
    start_single
  done
  clients_wait
  ((kills == FAULTS)) || fail "only $kills of $FAULTS kills ran within the clients' $SECONDS_PER_RUN s"
  echo "faults: cohortd killed with kill -9 and restarted $kills times"
  check ok
  ;;
ha | planted)
  cluster_init loopback 3 3
  for i in 0 1 2; do start_etcd "$i"; done
  wait_etcd || exit 1
  bin=$COHORTD
  [[ $MODE == planted ]] && bin=$PLANTED
  for r in 0 1 2; do start_cohortd "$r" "$bin"; done
  wait_serving || exit 1
  clients "${tcpstore_port[1]}" "$(replica_addr 0)" "$(replica_addr 1)" \
    "$(replica_addr 2)" "$ADDRS"
  if [[ $MODE == planted ]]; then
    # A stale read needs a read on one replica within a moment of a write
    # acknowledged by another: up to 3 runs, until one is caught.
    for round in 1 2 3; do
      ((round > 1)) && clients "${tcpstore_port[1]}" "$(replica_addr 0)" \
        "$(replica_addr 1)" "$(replica_addr 2)" "$ADDRS"
      clients_wait
      "$TMP/lincheck" --json --html="$OUT" "$TMP"/grpc.jsonl "$TMP"/torch*.jsonl \
        >"$TMP/lincheck.json" 2>"$TMP/lincheck.err"
      rc=$?
      echo "run $round: lincheck exited $rc: $(cat "$TMP/lincheck.json")"
      ((rc == 1)) && break
    done
    if ((rc == 1)); then
      sed -n '/None of the operations/,/^$/p' "$TMP/lincheck.err" | head -4
      echo "the checker caught the planted stale read in run $round"
    else
      fail "the checker did not catch the planted stale reads in 3 runs (last exit $rc)"
    fi
    finish
  fi
  declare -A trials=([cohortd_leader]=0 [etcd_leader]=0 [etcd_stop]=0 [replica_stop]=0)
  sleep 1
  while clients_running && ((trials[replica_stop] < FAULTS)); do
    r=$(cohortd_leader)
    if [[ -n "$r" ]]; then
      kill -9 "${cohortd_pid[$r]}"; wait "${cohortd_pid[$r]}" 2>/dev/null
      sleep "$(rand 0.2 0.6)"; start_cohortd "$r"
      trials[cohortd_leader]=$((trials[cohortd_leader] + 1))
    fi
    sleep "$(rand 0.3 0.8)"
    i=$(etcd_leader)
    if [[ -n "$i" ]]; then
      kill -9 "${etcd_pid[$i]}"; wait "${etcd_pid[$i]}" 2>/dev/null
      sleep "$(rand 0.2 0.6)"; start_etcd "$i"
      trials[etcd_leader]=$((trials[etcd_leader] + 1))
    fi
    sleep "$(rand 0.3 0.8)"
    i=$((RANDOM % 3))
    kill -STOP "${etcd_pid[$i]}"; sleep "$(rand 0.5 1.5)"; kill -CONT "${etcd_pid[$i]}"
    trials[etcd_stop]=$((trials[etcd_stop] + 1))
    r=$((RANDOM % 3))
    kill -STOP "${cohortd_pid[$r]}"; sleep "$(rand 0.5 1.5)"; kill -CONT "${cohortd_pid[$r]}"
    trials[replica_stop]=$((trials[replica_stop] + 1))
  done
  clients_wait
  echo "faults: cohortd leader killed ${trials[cohortd_leader]}, etcd leader killed ${trials[etcd_leader]}, etcd member stopped ${trials[etcd_stop]}, replica stopped ${trials[replica_stop]}"
  for k in cohortd_leader etcd_leader etcd_stop replica_stop; do
    ((trials[$k] >= FAULTS)) || fail "only ${trials[$k]} of $FAULTS $k faults ran within the clients' $SECONDS_PER_RUN s"
  done
  check ok
  ;;
*)
  echo "usage: $0 single|ha|planted"; exit 2 ;;
esac
finish
