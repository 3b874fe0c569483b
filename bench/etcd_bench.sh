#!/usr/bin/env bash
# The etcd engine against the RocksDB engine, side by side in one session,
# on loopback: store_bench's ops (set/get/add, 8 clients) and the 256-rank
# init storm against
#   rocksdb   one cohortd on RocksDB (in-process, as store_bench runs it),
#   etcd x1   one cohortd replica over a 3-member etcd cluster,
#   etcd x3   three replicas over it (clients go through the first; the
#             other two follow every change through their watch),
# then the time from killing the leader replica to a new leader, ROUNDS
# times. Prints store_bench's lines and a failover line per round.
#   bench/etcd_bench.sh [ROUNDS]     (from the repository root, after
#   bazel build //bench:store_bench //server:cohortd)
set -uo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-5}
BIN=bazel-bin
TMP=$(mktemp -d)
export ETCDCTL_API=3
pids=()
trap 'kill -9 "${pids[@]}" 2>/dev/null; rm -rf "$TMP"' EXIT

read -r -a ports <<<"$(python3 -c '
import socket
ss = [socket.socket() for _ in range(9)]
for s in ss: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in ss))')"
cluster=""
for i in 0 1 2; do cluster+="${cluster:+,}e$i=http://127.0.0.1:${ports[$((3 + i))]}"; done
endpoints=127.0.0.1:${ports[0]},127.0.0.1:${ports[1]},127.0.0.1:${ports[2]}
for i in 0 1 2; do
  etcd --name "e$i" --data-dir "$TMP/e$i" \
    --listen-client-urls "http://127.0.0.1:${ports[$i]}" \
    --advertise-client-urls "http://127.0.0.1:${ports[$i]}" \
    --listen-peer-urls "http://127.0.0.1:${ports[$((3 + i))]}" \
    --initial-advertise-peer-urls "http://127.0.0.1:${ports[$((3 + i))]}" \
    --initial-cluster "$cluster" >"$TMP/e$i.log" 2>&1 &
  pids+=($!)
  disown $!
done
for _ in $(seq 100); do
  etcdctl --endpoints="$endpoints" endpoint health >/dev/null 2>&1 && break
  sleep 0.1
done

replica_pids=()
start_replica() {  # INDEX
  "$BIN/server/cohortd" --listen="127.0.0.1:${ports[$((6 + $1))]}" --tcpstore_listen= \
    --engine=etcd --etcd_endpoints="$endpoints" >>"$TMP/c$1.log" 2>&1 &
  replica_pids[$1]=$!
  disown $!
  pids+=($!)
}
bench() {  # LABEL ARGS...
  local label=$1
  shift
  for mode in "--mode=ops --clients=8 --ops=1000" "--mode=init_storm --ranks=256 --storm_gets=multi"; do
    # shellcheck disable=SC2086
    "$BIN/bench/store_bench" $mode "$@" 2>/dev/null | sed "s/^/$label: /"
  done
}

bench rocksdb
start_replica 0
sleep 1.5
bench "etcd x1" --addr="127.0.0.1:${ports[6]}"
start_replica 1
start_replica 2
sleep 1.5
bench "etcd x3" --addr="127.0.0.1:${ports[6]}"

leader() { etcdctl --endpoints="$endpoints" get /cohort/leader --print-value-only 2>/dev/null; }
for round in $(seq "$ROUNDS"); do
  old=$(leader)
  for r in 0 1 2; do
    [[ "$old" == "127.0.0.1:${ports[$((6 + r))]}" ]] || continue
    start=$(date +%s%N)
    kill -9 "${replica_pids[$r]}"
    while :; do
      now=$(leader)
      [[ -n "$now" && "$now" != "$old" ]] && break
      sleep 0.02
    done
    end=$(date +%s%N)
    echo "failover round=$round killed=$old new_leader=$now ms=$(((end - start) / 1000000))"
    start_replica "$r"
    sleep 1
  done
done
