#!/usr/bin/env bash
# The worker data plane across hosts with network stacks of their own: two
# "hosts", each a network namespace with one veth to a bridge (the link,
# capped at 1 Gbit/s each way by tc's tbf), two ranks each under a cohortrun
# of its own, cohortd in the test's namespace on the bridge (10.77.0.1).
# The ranks take their host ids from COHORT_HOST_ID, so AllReduce is
# hierarchical (shared memory within a host, TCP between the hosts'
# leaders), and listen on their host's address.
#   1. Every collective is exact across the two hosts (multihost_worker's
#      checks: all_reduce direct and ring, sum/max/min/prod, broadcast,
#      reduce, all_gather(v), gather, scatter, all_to_all, reduce_scatter,
#      barrier, a send/recv ring).
#   2. Host b's link is dropped silently (nftables drops its packets at both
#      ends: no RST, no FIN, no ICMP) while every rank runs ops: every rank
#      fails its op with an error naming the other host, while the link is
#      still down (the op deadline, not a hang).
#   3. Once the link is back, both cohortruns restart the round, every
#      collective is exact again, and both exit 0.
# The whole test runs in a network namespace of its own, so it never
# touches the machine's network; it skips, saying why, where namespaces,
# veth links or nftables are not permitted (not root, a sandbox).
set -uo pipefail

if [[ -z "${MULTIHOST_NETNS_INNER:-}" ]]; then
  if [[ $(id -u) != 0 ]]; then echo "SKIP: not root"; exit 0; fi
  if ! unshare -n true 2>/dev/null; then
    echo "SKIP: unshare -n is not permitted"; exit 0
  fi
  MULTIHOST_NETNS_INNER=1 exec unshare -n -- bash "$0" "$@"
fi

COHORTD=server/cohortd
RUN=worker/launch/cohortrun
WORKER=tests/testing/multihost_worker
TMP=${TEST_TMPDIR:-$(mktemp -d)}
source tests/robustness/cluster_lib.sh

why=$(netns_unavailable)
if [[ -n "$why" ]]; then echo "SKIP: $why"; exit 0; fi

failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null; cluster_cleanup' EXIT

cluster_init netns 0 0
host_add a 10.77.0.11
host_add b 10.77.0.12
# The link of each host: capped both ways, at the host's end (egress of its
# eth) and at the bridge's (egress of its vb port).
for i in 0 1; do
  tc qdisc add dev "vb$i" root tbf rate 1gbit burst 256kb latency 50ms
done
on a tc qdisc add dev eth0 root tbf rate 1gbit burst 256kb latency 50ms
on b tc qdisc add dev eth1 root tbf rate 1gbit burst 256kb latency 50ms

"$COHORTD" --listen=10.77.0.1:0 --engine=memory 2>"$TMP/cohortd.log" &
PIDS+=($!)
PORT=
for _ in $(seq 300); do
  PORT=$(sed -n 's/.*serving cohort.v1.Store on 10.77.0.1:\([0-9]*\);.*/\1/p' "$TMP/cohortd.log")
  [[ -n "$PORT" ]] && break
  sleep 0.05
done
[[ -n "$PORT" ]] || { cat "$TMP/cohortd.log"; exit 1; }

# One cohortrun per host, in its namespace, two workers each; the workers
# hold on the first attempt (run ops until one fails) and exit after the
# checks on the second. cohortrun gives a silent peer node 3 heartbeats
# (15 s) before it stops its own workers: longer than a rank takes to fail
# (the 4 s op timeout; twice that for a rank waiting on its host's leader),
# so every rank reports its error first.
declare -A node_pid=()
for h in a b; do
  read -r -a pre <<<"$(ns_prefix "$h")"
  COHORT_HOST_ID="host-$h" "${pre[@]}" "$RUN" --coordinator="10.77.0.1:$PORT" \
    --run-id=multihost --node-id="node-$h" --nnodes=2:2 --nproc-per-node=2 \
    --max-restarts=1 --heartbeat-interval=5s --tee -- \
    "$WORKER" --bind="${host_ip[$h]}" --timeout=4s --hold_on_attempt=0 \
    >"$TMP/$h.out" 2>"$TMP/$h.err" &
  node_pid[$h]=$!
  PIDS+=($!)
done

# wait_lines PATTERN N: waits until N lines of both hosts' output match.
wait_lines() {
  for _ in $(seq 1200); do
    (($(cat "$TMP"/a.out "$TMP"/b.out | grep -c -- "$1") >= $2)) && return 0
    sleep 0.1
  done
  return 1
}
dump() {
  for h in a b; do
    echo "--- host $h stdout"; cat "$TMP/$h.out"
    echo "--- host $h stderr"; tail -30 "$TMP/$h.err"
  done
}

# 1. Correct across the hosts, then every rank holds (runs ops).
if ! wait_lines ': holding$' 4; then
  fail "round 0: four ranks did not pass the checks and hold"; dump; exit 1
fi
for h in a b; do
  [[ $(grep -c "host host-$h: 20 ops correct" "$TMP/$h.out") == 2 ]] ||
    fail "round 0: host $h's two ranks should each report 20 ops correct"
done

# 2. Host b's link goes down silently: its packets from a and from cohortd's
# host are dropped at both ends.
cut b a
cut b clients
if ! wait_lines ': op failed: ' 4; then
  fail "with host b's link down, not every rank's op failed (a hang)"; dump
fi
for h in a b; do
  other=$([[ $h == a ]] && echo b || echo a)
  while read -r line; do
    [[ "$line" == *"host-$other"* ]] ||
      fail "host $h: the error does not name host-$other: $line"
    [[ "$line" == *DEADLINE_EXCEEDED* || "$line" == *UNAVAILABLE* ]] ||
      fail "host $h: expected DEADLINE_EXCEEDED or UNAVAILABLE: $line"
  done < <(grep ': op failed: ' "$TMP/$h.out")
done

# 3. The link comes back: both nodes restart the round, and pass.
heal b a
heal b clients
for h in a b; do
  if ! timeout 120 tail --pid="${node_pid[$h]}" -f /dev/null; then
    fail "cohortrun on host $h did not exit after the link came back"; dump
  fi
  wait "${node_pid[$h]}"
  rc=$?
  [[ $rc == 0 ]] || fail "cohortrun on host $h exited $rc"
done
for h in a b; do
  [[ $(grep -c "host host-$h: 20 ops correct" "$TMP/$h.out") == 4 ]] ||
    fail "host $h: both rounds should pass the checks on both ranks"
done
grep -q "restarting" "$TMP/a.err" "$TMP/b.err" ||
  fail "no cohortrun said it restarted the round"

if ((failures > 0)); then dump; echo "$failures failure(s)"; exit 1; fi
echo "PASS"
