#!/usr/bin/env bash
# Real network partitions. Each etcd member (3) and each cohortd replica (3)
# is a host of its own: a network namespace joined to a bridge by a veth
# pair (tests/robustness/cluster_lib.sh). Recorded clients (6 over gRPC,
# spread over the replicas; PyTorch's TCPStore client on a replica's
# listener) run throughout, and these faults are injected in turn, each
# healed before the next:
#   replica_cut_from_etcd   the cohortd leader loses etcd while its clients
#                           still reach it: another replica must lead, and
#                           the cut-off one must acknowledge nothing;
#   leader_cut_from_replicas the leader loses the other replicas (not etcd):
#                           calls a follower forwards to it fail with a
#                           clear error, and work again after the heal;
#   etcd_minority           the etcd leader loses the other two members:
#                           they elect another; replicas fail over;
#   loss                    10% of the cohortd leader's packets dropped.
# Packets are dropped silently (nftables, no RST or ICMP). Delay and
# reordering need the kernel's netem qdisc; where it is missing that case
# is skipped with the reason. Afterwards porcupine checks the whole history
# (tests/robustness/lincheck) and history_windows.py reports, per fault,
# what the cut-off replica answered and when a new leader took over.
# The test runs in a network namespace of its own, so it touches nothing of
# the machine's network; it skips (passes, printing why) where namespaces,
# veth or nftables are not permitted.
set -uo pipefail

if [[ -z "${COHORT_PARTITION_NETNS:-}" ]]; then
  source tests/robustness/cluster_lib.sh
  why=$(netns_unavailable)
  if [[ -n "$why" ]]; then
    echo "SKIP: partition_test needs network namespaces: $why"
    exit 0
  fi
  COHORT_PARTITION_NETNS=1 exec unshare -n -- bash "$0" "$@"
fi

COHORTD=server/cohortd
CTL=client/cohortctl
HISTORY=tests/testing/store_history
TORCH_CLIENT=tests/robustness/torch_store_history.py
root=$(dirname "$(dirname "$(readlink -f tools/requirements.txt)")")
VENV_PYTHON=${PYTHON:-$root/.venv/bin/python}
export TORCH_CPP_LOG_LEVEL=ERROR ETCDCTL_API=3
HOLD=${PARTITION_HOLD_S:-6}
KEY_GROUPS=4  # at a time (store_history's header)
TMP=${TEST_TMPDIR:-$(mktemp -d)}
OUT=${TEST_UNDECLARED_OUTPUTS_DIR:-$TMP}
source tests/robustness/cluster_lib.sh
trap cluster_cleanup EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

bash tests/robustness/lincheck/build.sh "$TMP/lincheck" || exit 1
cluster_init netns 3 3
for i in 0 1 2; do start_etcd "$i"; done
wait_etcd || exit 1
for r in 0 1 2; do start_cohortd "$r"; done
wait_serving || exit 1
wait_for cohortd_leader "" >/dev/null || { fail "no cohortd leader"; exit 1; }

# Clients: target i < 3 is replica i alone; target 3 fails over across all.
"$HISTORY" --targets="$(replica_addr 0);$(replica_addr 1);$(replica_addr 2);$ADDRS" \
  --clients=8 --groups="$KEY_GROUPS" --seconds=0 --rpc_timeout_ms=3000 --out="$TMP/grpc.jsonl" \
  >"$TMP/grpc.out" 2>&1 &
client_pids=($!)
"$VENV_PYTHON" "$TORCH_CLIENT" --host="${replica_ip[2]}" --port="${tcpstore_port[2]}" \
  --clients=1 --client-base=50 --groups="$KEY_GROUPS" --seconds=0 --out="$TMP/torch2.jsonl" \
  >"$TMP/torch2.out" 2>&1 &
client_pids+=($!)
sleep 2

windows=$TMP/windows.txt
: >"$windows"
# window NAME REPLICA START END [KEY=VALUE...]: a fault's record for the report.
window() { echo "$*" >>"$windows"; }
# The etcd leader as seen by the members other than $EXCLUDE.
EXCLUDE=
majority_etcd_leader() {
  local i
  for ((i = 0; i < ETCD_MEMBERS; i++)); do
    [[ "$i" == "$EXCLUDE" ]] && continue
    ETCDCTL_API=3 etcdctl --endpoints="${etcd_ip[$i]}:${etcd_client_port[$i]}" \
      --command-timeout=1s endpoint status -w json 2>/dev/null | python3 -c '
import json, sys
s = json.load(sys.stdin)[0]["Status"]
print(s["leader"])' 2>/dev/null && return
  done
}
member_id() {
  ETCDCTL_API=3 etcdctl --endpoints="${etcd_ip[$1]}:${etcd_client_port[$1]}" \
    --command-timeout=1s endpoint status -w json | python3 -c '
import json, sys; print(json.load(sys.stdin)[0]["Status"]["header"]["member_id"])'
}

# The cohortd leader, once there is one.
leader() { wait_for cohortd_leader "" >/dev/null && cohortd_leader; }

# 1. The cohortd leader cut off from every etcd member; its clients still
# reach it.
L=$(leader)
echo "== replica_cut_from_etcd: replica $L (the leader)"
for i in 0 1 2; do cut "r$L" "e$i"; done
start=$(now_ns)  # Once every link is cut.
took=$(wait_for cohortd_leader "$L" 30) || fail "replica_cut_from_etcd: no other replica took over"
new=$(cohortd_leader)
echo "   new leader: replica $new after ${took:-?} ms"
sleep "$HOLD"
end=$(now_ns)
for i in 0 1 2; do heal "r$L" "e$i"; done
window replica_cut_from_etcd "$L" "$start" "$end" "new_leader_ms=${took:-none}" "new_leader=${new:-none}"
timeout 60 "$CTL" --addr="$(replica_addr "$L")" --connect_timeout=30 set part/healed 1 >/dev/null ||
  fail "replica_cut_from_etcd: replica $L did not serve after the heal"
sleep 2

# 2. The leader cut off from the other replicas, not from etcd.
L=$(leader)
F=$(((L + 1) % 3))
echo "== leader_cut_from_replicas: replica $L (the leader), follower $F"
direct=$(timeout 30 "$CTL" --addr="$(replica_addr "$L")" participants part-none 2>&1)
for r in 0 1 2; do [[ $r != "$L" ]] && cut "r$L" "r$r"; done
start=$(now_ns)
sleep 1
via=$(timeout 40 "$CTL" --addr="$(replica_addr "$F")" participants part-none 2>&1); rc=$?
[[ $rc != 0 && $rc != 124 ]] ||
  fail "leader_cut_from_replicas: a call forwarded through follower $F: rc $rc: $via"
echo "   through the follower meanwhile (rc $rc): ${via//$'\n'/ }"
[[ "$(cohortd_leader)" == "$L" ]] || echo "   note: the leadership moved to $(cohortd_leader)"
sleep "$HOLD"
end=$(now_ns)
for r in 0 1 2; do [[ $r != "$L" ]] && heal "r$L" "r$r"; done
window leader_cut_from_replicas "$L" "$start" "$end" "follower_answer_rc=$rc"
healed=
for _ in $(seq 40); do
  healed=$(timeout 30 "$CTL" --addr="$(replica_addr "$F")" participants part-none 2>&1)
  [[ "$healed" == "$direct" ]] && break
  sleep 0.25
done
[[ "$healed" == "$direct" ]] ||
  fail "leader_cut_from_replicas: after the heal the follower answers '$healed', the leader '$direct'"
echo "   after the heal the follower answers as the leader: ${direct//$'\n'/ }"
sleep 2

# 3. A minority partition of etcd: its leader loses the other two members.
M=$(etcd_leader)
old_id=$(member_id "$M")
echo "== etcd_minority: etcd member $M (the leader) cut from the others"
EXCLUDE=$M
for i in 0 1 2; do [[ $i != "$M" ]] && cut "e$M" "e$i"; done
start=$(now_ns)
took=$(wait_for majority_etcd_leader "$old_id" 30) || fail "etcd_minority: the majority elected no leader"
echo "   the majority elected a leader after ${took:-?} ms"
sleep "$HOLD"
end=$(now_ns)
for i in 0 1 2; do [[ $i != "$M" ]] && heal "e$M" "e$i"; done
EXCLUDE=
window etcd_minority none "$start" "$end" "new_etcd_leader_ms=${took:-none}"
sleep 2

# 4. Packet loss on the cohortd leader's link.
L=$(leader)
echo "== loss: 10% of replica $L's packets dropped"
loss "r$L" 10
start=$(now_ns)
sleep "$HOLD"
loss "r$L" 0
end=$(now_ns)
window loss "$L" "$start" "$end"
if on r0 tc qdisc add dev lo root netem delay 1ms 2>/dev/null; then
  on r0 tc qdisc del dev lo root
  echo "== delay: 50 ms (+-20 ms, 25% reordered) on replica $L's link"
  start=$(now_ns)
  on "r$L" tc qdisc add dev "$(on "r$L" ip -o link show | awk -F': ' '/eth/{print $2}' | cut -d@ -f1)" \
    root netem delay 50ms 20ms reorder 25% 50%
  sleep "$HOLD"
  on "r$L" sh -c 'for d in /sys/class/net/eth*; do tc qdisc del dev ${d##*/} root; done'
  window delay "$L" "$start" "$(now_ns)"
else
  echo "SKIP delay and reordering: this kernel has no netem qdisc (tc qdisc ... netem: unknown qdisc)"
fi
sleep 2

kill -TERM "${client_pids[@]}"
for p in "${client_pids[@]}"; do wait "$p" || fail "a recorded client exited with an error"; done
cat "$TMP"/grpc.out "$TMP"/torch2.out | grep "history:"
"$TMP/lincheck" --json --html="$OUT" "$TMP"/grpc.jsonl "$TMP"/torch2.jsonl \
  >"$TMP/lincheck.json" 2>"$TMP/lincheck.err"
rc=$?
echo "lincheck: $(cat "$TMP/lincheck.json")"
((rc == 0)) || {
  head -40 "$TMP/lincheck.err"; cp "$TMP"/*.jsonl "$TMP/windows.txt" "$OUT"/ 2>/dev/null
  fail "lincheck exited $rc: the history is not linearizable (histories kept in the test's outputs)"
}
python3 tests/robustness/history_windows.py "$windows" "$TMP"/grpc.jsonl "$TMP"/torch2.jsonl ||
  fail "a cut-off replica acknowledged what it could not commit"

if ((failures)); then
  for f in "$TMP"/c*.log; do echo "--- $f"; tail -15 "$f"; done
  echo "partition_test: $failures check(s) failed"
  exit 1
fi
echo "partition_test: every check passed"
