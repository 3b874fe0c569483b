#!/usr/bin/env bash
# busbw across a link between two hosts, cohort beside torch-gloo: two
# "hosts" (network namespaces, each with one veth to a bridge, as in
# tests/integration/multihost_netns_test.sh), two ranks each, every rank a
# torch 2.x process (.venv) holding both a "cohort" group and torch's own
# "gloo" group (bench/multihost_netns.py). Run twice: with the link capped
# by tc's tbf (--rate, both directions, at both ends of each host's veth)
# and uncapped. Before each, one TCP stream's throughput from host a to
# host b, the link's own figure. Prints figures, asserts nothing. As root;
# the whole run is in a network namespace of its own.
#
#   bazel build //worker/torch:cohort_torch2
#   bench/multihost_netns.sh [--rounds=5] [--rate=1gbit]
#       [--sizes=4096,262144,4194304,16777216] [--ops=all_reduce,...]
#       [--verify_ops=0]   (cohort's per-op check off: what it costs)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

if [[ -z "${MULTIHOST_NETNS_INNER:-}" ]]; then
  [[ $(id -u) == 0 ]] || { echo "multihost_netns: needs root (network namespaces)"; exit 1; }
  MULTIHOST_NETNS_INNER=1 exec unshare -n -- bash "$0" "$@"
fi

ROUNDS=5 RATE=1gbit SIZES=4096,262144,4194304,16777216 OPS= VERIFY=1
for arg in "$@"; do
  case $arg in
    --rounds=*) ROUNDS=${arg#*=} ;;
    --rate=*) RATE=${arg#*=} ;;
    --sizes=*) SIZES=${arg#*=} ;;
    --ops=*) OPS=${arg#*=} ;;
    --verify_ops=*) VERIFY=${arg#*=} ;;
    *) echo "multihost_netns: unknown argument $arg"; exit 2 ;;
  esac
done
PYTHON=.venv/bin/python
TORCH2=bazel-bin/worker/torch/torch2
[[ -e $TORCH2/cohort_torch.so ]] || { echo "multihost_netns: bazel build //worker/torch:cohort_torch2 first"; exit 1; }

TMP=$(mktemp -d)
source tests/robustness/cluster_lib.sh
why=$(netns_unavailable)
[[ -z "$why" ]] || { echo "multihost_netns: $why"; exit 1; }
trap 'cluster_cleanup; rm -rf "$TMP"' EXIT
cluster_init netns 0 0 || exit 1
host_add a 10.77.0.11
host_add b 10.77.0.12
declare -A dev=([a]=eth0 [b]=eth1)

cap() {  # RATE, or "off"
  local i h
  for i in 0 1; do
    tc qdisc del dev "vb$i" root 2>/dev/null || true
    [[ $1 == off ]] || tc qdisc add dev "vb$i" root tbf rate "$1" burst 256kb latency 50ms
  done
  for h in a b; do
    on "$h" tc qdisc del dev "${dev[$h]}" root 2>/dev/null || true
    [[ $1 == off ]] || on "$h" tc qdisc add dev "${dev[$h]}" root tbf rate "$1" burst 256kb latency 50ms
  done
}

# One TCP stream from host a to host b for 2 s: MB/s.
stream() {
  on b python3 -c '
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("10.77.0.12", 29651)); s.listen(1); c, _ = s.accept(); n = 0; t = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    if t is None: t = time.perf_counter()
    n += len(b)
print(f"{n / (time.perf_counter() - t) / 1e6:.0f}")' >"$TMP/stream" &
  local reader=$!
  sleep 0.5
  on a python3 -c '
import socket, time
c = socket.create_connection(("10.77.0.12", 29651)); b = b"x" * (1 << 20)
end = time.perf_counter() + 2
while time.perf_counter() < end: c.sendall(b)
c.close()'
  wait "$reader"
  cat "$TMP/stream"
}

run_ranks() {  # LABEL
  local label=$1 h local_rank rank=0 pids=() extra=()
  [[ -n "$OPS" ]] && extra+=(--ops="$OPS")
  for h in a b; do
    for local_rank in 0 1; do
      read -r -a pre <<<"$(ns_prefix "$h")"
      "${pre[@]}" env RANK=$rank WORLD_SIZE=4 MASTER_ADDR=10.77.0.11 MASTER_PORT=29650 \
        GLOO_SOCKET_IFNAME="${dev[$h]}" COHORT_HOST_ID="host-$h" COHORT_VERIFY_OPS="$VERIFY" \
        PYTHONPATH="$TORCH2:bench" "$PYTHON" bench/multihost_netns.py \
        --label="$label" --rounds="$ROUNDS" --sizes="$SIZES" "${extra[@]}" \
        >"$TMP/$label.$rank.out" 2>"$TMP/$label.$rank.err" &
      pids+=($!)
      rank=$((rank + 1))
    done
  done
  local failed=0 p
  for p in "${pids[@]}"; do wait "$p" || failed=1; done
  if ((failed)); then
    echo "multihost_netns: a rank failed ($label):"; tail -5 "$TMP/$label".*.err; exit 1
  fi
  grep -v '^#' "$TMP/$label.0.out"
}

echo "== $(date -u +%FT%TZ), $(nproc) CPUs, torch $("$PYTHON" -c 'import torch; print(torch.__version__)'), 2 hosts x 2 ranks, medians of $ROUNDS rounds"
echo "== ratio = torch-gloo time / cohort time (> 1: cohort faster); busbw in GB/s; cohort's verify_ops=$VERIFY"
cap "$RATE"
echo "== capped at $RATE each way: one TCP stream a->b $(stream) MB/s"
run_ranks capped
cap off
echo "== uncapped (veth): one TCP stream a->b $(stream) MB/s"
run_ranks uncapped | tail -n +2
