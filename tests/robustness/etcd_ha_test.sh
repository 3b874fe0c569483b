#!/usr/bin/env bash
# High availability on loopback: 3 etcd members (Debian's etcd-server) and
# 2 cohortd replicas (--engine=etcd), under a write load whose checker
# (tests/testing/ha_writer.cc) keeps every acknowledged write. At random
# moments, HA_TRIALS times each (default 20):
#   - kill -9 the cohortd leader, then restart it;
#   - kill -9 the etcd leader, then restart it;
#   - SIGSTOP an etcd member for 1-2 s (a partition), then SIGCONT.
# Then: zero acknowledged writes lost, and the counter equals the
# acknowledged Adds (plus at most those whose answer was lost). Also:
#   - a get blocked on a replica that is killed reconnects to the other
#     and is released by a write there;
#   - a rendezvous in progress (one of two nodes joined) completes after
#     the cohortd leader is killed, and the nodes' exit barrier passes;
#   - PyTorch's TCPStore client on one replica is woken by a write through
#     the other (both protocols work on the etcd engine);
#   - a watch resumes from a past revision on a replica started later.
#
# With the argument "participants" (tests/robustness:etcd_ha_participants_test),
# the same cluster without faults or load, for the raw methods a follower passes
# to the leader as bytes: ListParticipants and GetParticipants through the
# follower answer exactly as the leader, errors included
# (tests/testing/ha_participants.cc), and so does cohortctl participants.
set -uo pipefail

MODE=${1:-faults}

COHORTD=server/cohortd
CTL=client/cohortctl
RUN=worker/launch/cohortrun
WRITER=tests/testing/ha_writer
PARTICIPANTS=tests/testing/ha_participants
PYTHON=/usr/bin/python3
TRIALS=${HA_TRIALS:-20}
TMP=${TEST_TMPDIR:-$(mktemp -d)}
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
command -v etcd >/dev/null && command -v etcdctl >/dev/null ||
  { echo "FAIL: no etcd/etcdctl: run tools/setup.sh (Debian's etcd-server, etcd-client)"; exit 1; }
export ETCDCTL_API=3

read -r -a ports <<<"$(python3 -c '
import socket
ss = [socket.socket() for _ in range(10)]
for s in ss: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in ss))')"
client_port=("${ports[0]}" "${ports[1]}" "${ports[2]}")
peer_port=("${ports[3]}" "${ports[4]}" "${ports[5]}")
replica_port=("${ports[6]}" "${ports[7]}")
tcpstore_port=("${ports[8]}" "${ports[9]}")
ENDPOINTS=127.0.0.1:${client_port[0]},127.0.0.1:${client_port[1]},127.0.0.1:${client_port[2]}
CLUSTER=e0=http://127.0.0.1:${peer_port[0]},e1=http://127.0.0.1:${peer_port[1]},e2=http://127.0.0.1:${peer_port[2]}
ADDRS=127.0.0.1:${replica_port[0]},127.0.0.1:${replica_port[1]}

etcd_pid=() cohortd_pid=()
cleanup() {
  kill -9 "${etcd_pid[@]}" "${cohortd_pid[@]}" 2>/dev/null
  [[ -n "${WPID:-}" ]] && kill -9 "$WPID" 2>/dev/null
}
trap cleanup EXIT

start_etcd() {
  local i=$1
  etcd --name "e$i" --data-dir "$TMP/e$i" \
    --listen-client-urls "http://127.0.0.1:${client_port[$i]}" \
    --advertise-client-urls "http://127.0.0.1:${client_port[$i]}" \
    --listen-peer-urls "http://127.0.0.1:${peer_port[$i]}" \
    --initial-advertise-peer-urls "http://127.0.0.1:${peer_port[$i]}" \
    --initial-cluster "$CLUSTER" --initial-cluster-state new \
    >>"$TMP/e$i.log" 2>&1 &
  etcd_pid[$i]=$!
}
start_cohortd() {
  local r=$1
  "$COHORTD" --listen="127.0.0.1:${replica_port[$r]}" \
    --tcpstore_listen="127.0.0.1:${tcpstore_port[$r]}" \
    --engine=etcd --etcd_endpoints="$ENDPOINTS" --election_ttl=2s \
    >>"$TMP/c$r.log" 2>&1 &
  cohortd_pid[$r]=$!
}
rand() { awk -v lo="$1" -v hi="$2" 'BEGIN { srand(); printf "%.2f", lo + rand() * (hi - lo) }'; }
ctl() { timeout 60 "$CTL" --addr="$ADDRS" --connect_timeout=30 "$@"; }

for i in 0 1 2; do start_etcd "$i"; done
for _ in $(seq 100); do
  etcdctl --endpoints="$ENDPOINTS" endpoint health >/dev/null 2>&1 && break
  sleep 0.1
done
for r in 0 1; do start_cohortd "$r"; done
ctl set ha/ready 1 >/dev/null || { cat "$TMP"/c*.log; echo "FAIL: the replicas did not serve"; exit 1; }

cohortd_leader() {  # -> replica index
  local at
  at=$(etcdctl --endpoints="$ENDPOINTS" get /cohort/leader --print-value-only 2>/dev/null)
  for r in 0 1; do [[ "$at" == "127.0.0.1:${replica_port[$r]}" ]] && { echo "$r"; return; }; done
  echo ""
}
etcd_leader() {  # -> member index
  local i status
  for i in 0 1 2; do
    status=$(etcdctl --endpoints="127.0.0.1:${client_port[$i]}" endpoint status -w json 2>/dev/null)
    python3 -c '
import json, sys
s = json.loads(sys.argv[1])[0]["Status"]
sys.exit(0 if s["header"]["member_id"] == s["leader"] else 1)' "$status" 2>/dev/null &&
      { echo "$i"; return; }
  done
  echo ""
}
wait_leader() {  # waits for a cohortd leader; prints the time taken (a figure)
  local start=$SECONDS
  # Gives up after 120 s only so that a failover that never ends fails the
  # trial instead of hanging the test.
  while ((SECONDS - start < 120)); do
    [[ -n "$(cohortd_leader)" ]] && { echo $((SECONDS - start)); return 0; }
    sleep 0.1
  done
  return 1
}
finish() {  # NAME: exits, 1 with the replicas' logs if a check failed
  if ((failures)); then
    for f in "$TMP"/c*.log; do echo "--- $f"; tail -20 "$f"; done
    echo "$1: $failures check(s) failed"
    exit 1
  fi
  echo "$1: every check passed"
  exit 0
}

if [[ "$MODE" == participants ]]; then
  wait_leader >/dev/null || { cat "$TMP"/c*.log; echo "FAIL: no cohortd leader"; exit 1; }
  r=$(cohortd_leader)
  leader=127.0.0.1:${replica_port[$r]}
  follower=127.0.0.1:${replica_port[$((1 - r))]}
  echo "leader $leader, follower $follower"
  # The nodes join through either replica (the first address answering).
  timeout 240 "$PARTICIPANTS" --leader="$leader" --follower="$follower" \
    --join_addr="$ADDRS" --run=ha-peers || fail "ha_participants"
  # Its run is at its second round of 5 nodes now.
  at_leader=$(timeout 60 "$CTL" --addr="$leader" participants ha-peers 2>&1) ||
    fail "cohortctl participants on the leader: $at_leader"
  at_follower=$(timeout 60 "$CTL" --addr="$follower" participants ha-peers 2>&1) ||
    fail "cohortctl participants through the follower: $at_follower"
  [[ "$at_follower" == "$at_leader" && $(wc -l <<<"$at_leader") == 5 ]] ||
    fail "cohortctl participants: the follower printed '$at_follower', the leader '$at_leader'"
  at_leader=$(timeout 60 "$CTL" --addr="$leader" participants ha-peers 1 3 2>&1)
  at_follower=$(timeout 60 "$CTL" --addr="$follower" participants ha-peers 1 3 2>&1)
  [[ "$at_follower" == "$at_leader" && "$at_leader" == "1 node-"*$'\n'"2 node-"* ]] ||
    fail "cohortctl participants 1 3: the follower printed '$at_follower', the leader '$at_leader'"
  err=$(timeout 60 "$CTL" --addr="$follower" participants ha-peers 4 9 2>&1); rc=$?
  [[ $rc == 1 && "$err" == *INVALID_ARGUMENT*"[4, 9)"*"5 node ranks"* ]] ||
    fail "cohortctl participants 4 9 through the follower: rc $rc, '$err'"
  finish "etcd_ha_test participants"
fi

"$WRITER" --addr="$ADDRS" --threads=4 --prefix=ha/ >"$TMP/writer.out" 2>&1 &
WPID=$!
sleep 1

declare -A done_trials=([cohortd_leader]=0 [etcd_leader]=0 [etcd_stop]=0)
# kill_leader cohortd|etcd: kill -9 that kind's current leader (if one is
# known), restart it a moment later, and count the trial.
kill_leader() {
  local kind=$1 n
  n=$("${kind}_leader")
  [[ -n "$n" ]] || return 0
  local -n pids="${kind}_pid"
  kill -9 "${pids[$n]}"; wait "${pids[$n]}" 2>/dev/null
  sleep "$(rand 0.2 0.8)"
  "start_${kind}" "$n"
  done_trials[${kind}_leader]=$((done_trials[${kind}_leader] + 1))
}
for t in $(seq "$TRIALS"); do
  sleep "$(rand 0.1 0.6)"
  kill_leader cohortd
  wait_leader >/dev/null || fail "trial $t: no cohortd leader was elected after killing one"

  sleep "$(rand 0.1 0.6)"
  kill_leader etcd
  sleep "$(rand 0.5 1.0)"

  i=$((RANDOM % 3))
  kill -STOP "${etcd_pid[$i]}"
  sleep "$(rand 1.0 2.0)"
  kill -CONT "${etcd_pid[$i]}"
  done_trials[etcd_stop]=$((done_trials[etcd_stop] + 1))
  sleep "$(rand 0.3 0.8)"
done

kill -TERM "$WPID"
wait "$WPID"
writer_status=$?
WPID=
cat "$TMP/writer.out" | grep -v "^E[0-9]" | tail -8
((writer_status == 0)) || fail "the checker found lost or doubled writes"
echo "trials: cohortd leader killed ${done_trials[cohortd_leader]}, etcd leader killed ${done_trials[etcd_leader]}, etcd member stopped ${done_trials[etcd_stop]}"
for k in cohortd_leader etcd_leader etcd_stop; do
  ((done_trials[$k] >= TRIALS)) || fail "only ${done_trials[$k]} of $TRIALS $k trials ran"
done

# A get blocked on replica 0 (the first address: pick_first uses it) is
# released by a write through replica 1 after replica 0 is killed.
ctl get ha/late --timeout=60 >"$TMP/blocked.out" 2>&1 &
BLOCKED=$!
sleep 0.5
kill -9 "${cohortd_pid[0]}"; wait "${cohortd_pid[0]}" 2>/dev/null
timeout 30 "$CTL" --addr="127.0.0.1:${replica_port[1]}" set ha/late released >/dev/null ||
  fail "set through replica 1"
wait $BLOCKED
[[ "$(cat "$TMP/blocked.out")" == released ]] ||
  fail "the get blocked on the killed replica: $(cat "$TMP/blocked.out")"
start_cohortd 0
wait_leader >/dev/null || fail "no leader after restarting replica 0"

# PyTorch's own TCPStore client on one replica's TCPStore listener sees
# (and is woken by) what cohortctl writes through the other replica (torch
# 1.13's client puts "/" before every key).
"$PYTHON" -c "
import datetime, threading, time, torch.distributed as dist
s = dist.TCPStore('127.0.0.1', ${tcpstore_port[1]}, is_master=False,
                  timeout=datetime.timedelta(seconds=30))
s.set('ha/torch', 'from-torch')
print(s.get('ha/from-ctl').decode())" >"$TMP/torch.out" 2>&1 &
TORCH=$!
sleep 2
timeout 30 "$CTL" --addr="127.0.0.1:${replica_port[0]}" set /ha/from-ctl woken >/dev/null ||
  fail "set through replica 0"
wait $TORCH
[[ "$(tail -1 "$TMP/torch.out")" == woken ]] ||
  fail "torch's TCPStore get on replica 1, woken by a set on replica 0: $(cat "$TMP/torch.out")"
[[ "$(ctl get /ha/torch)" == from-torch ]] || fail "torch's set, read through gRPC"

# A watch resumes from a revision etcd holds on a replica that started
# after it: the replica replays its history from etcd.
now=$(etcdctl --endpoints="$ENDPOINTS" get /cohort/kv/ha/late -w json |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["header"]["revision"])')
from=$((now - 20))
resumed=0
for _ in $(seq 10); do  # while the restarted replica loads and replays
  timeout 2 "$CTL" --addr="127.0.0.1:${replica_port[0]}" watch ha/ \
    --from_revision="$from" >"$TMP/resumed.out" 2>&1
  resumed=$(grep -c "^[0-9]* PUT ha/" "$TMP/resumed.out")
  ((resumed > 0)) && break
  sleep 0.5
done
((resumed > 0)) ||
  fail "a watch from revision $from (etcd at $now) on the restarted replica: $(head -3 "$TMP/resumed.out")"
echo "watch resumed from revision $from on a replica started later: $resumed events"

# A rendezvous in progress across a leader failover: node a joins, the
# leader is killed, node b joins; both run and pass their exit barrier.
node() {
  timeout 90 "$RUN" --coordinator="$ADDRS" --run-id=hajob --node-id="$1" \
    --nnodes=2 --heartbeat-interval=1s --join-timeout=60s -- /bin/true \
    >"$TMP/node.$1.out" 2>&1
  echo $? >"$TMP/node.$1.rc"
}
node a & NA=$!
sleep 1.5
r=$(cohortd_leader)
[[ -n "$r" ]] && { kill -9 "${cohortd_pid[$r]}"; wait "${cohortd_pid[$r]}" 2>/dev/null; }
sleep 0.5
[[ -n "$r" ]] && start_cohortd "$r"
failover=$(wait_leader) || fail "no leader after killing it mid-rendezvous"
node b & NB=$!
wait $NA $NB
for n in a b; do
  [[ "$(cat "$TMP/node.$n.rc")" == 0 ]] ||
    fail "node $n of the rendezvous across the failover: $(cat "$TMP/node.$n.out")"
done
echo "rendezvous across a leader failover: completed (new leader after ${failover:-?} s)"

finish etcd_ha_test
