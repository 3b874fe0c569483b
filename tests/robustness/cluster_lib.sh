# Sourced by the robustness campaigns (linearizability_test.sh,
# partition_test.sh): a cohortd cluster of etcd members and cohortd replicas,
# started, killed, stopped and cut apart by the test.
#
# Two layouts:
#   loopback  every process on 127.0.0.1, ports picked free;
#   netns     every etcd member and cohortd replica is a host of its own: a
#             network namespace (unshare -n) with one veth to a bridge in the
#             test's namespace, which the clients use (10.77.0.1). Hosts are
#             cut apart by dropping their packets in nftables (silently: no
#             RST, no ICMP), as a failed switch or route would.
#
# Before sourcing: TMP (a scratch folder), COHORTD (the binary), CTL
# (cohortctl). Then cluster_init LAYOUT ETCD_MEMBERS REPLICAS.

# Members' state, indexed by member or replica number.
etcd_pid=() cohortd_pid=() host_pid=()
etcd_ip=() etcd_client_port=() etcd_peer_port=()
replica_ip=() replica_port=() tcpstore_port=()
LAYOUT=loopback
COHORTD_ARGS=()

cluster_cleanup() {
  kill -9 "${etcd_pid[@]}" "${cohortd_pid[@]}" 2>/dev/null
  kill -9 "${host_pid[@]}" 2>/dev/null
  wait 2>/dev/null
}

# The reason netns layouts cannot run here, or nothing when they can.
netns_unavailable() {
  [[ $(id -u) == 0 ]] || { echo "not root"; return; }
  command -v unshare >/dev/null || { echo "no unshare (util-linux)"; return; }
  command -v nft >/dev/null || { echo "no nft (Debian's nftables: run tools/setup.sh)"; return; }
  unshare -n true 2>/dev/null || { echo "unshare -n is not permitted"; return; }
  unshare -n sh -c 'ip link add cprobe0 type veth peer name cprobe1' 2>/dev/null ||
    { echo "veth links cannot be made"; return; }
  unshare -n sh -c 'nft add table inet probe' 2>/dev/null ||
    { echo "nftables is not available in this kernel"; return; }
}

free_ports() {  # N -> N free loopback ports
  python3 -c '
import socket, sys
ss = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in ss: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in ss))' "$1"
}

# host_add NAME IP: a namespace of its own joined to the bridge.
declare -A host_ns_pid=() host_ip=()
host_add() {
  local name=$1 ip=$2 n=${#host_pid[@]}
  unshare -n sleep 1000000 &
  local pid=$!
  host_pid+=("$pid")
  host_ns_pid[$name]=$pid
  host_ip[$name]=$ip
  for _ in $(seq 50); do
    [[ "$(readlink /proc/$pid/ns/net)" != "$(readlink /proc/self/ns/net)" ]] && break
    sleep 0.02
  done
  ip link add "vb$n" type veth peer name "eth$n"
  ip link set "eth$n" netns "$pid"
  nsenter -t "$pid" -n sh -c "ip link set lo up && ip addr add $ip/24 dev eth$n && ip link set eth$n up && ip route add default dev eth$n"
  ip link set "vb$n" master cbr0 up
  # The rules cut and heal fill.
  nsenter -t "$pid" -n nft -f - <<EOF
table inet cohort_faults {
  set cut { type ipv4_addr; }
  chain input { type filter hook input priority 0; ip saddr @cut drop; }
  chain output { type filter hook output priority 0; }
}
EOF
}
# on NAME CMD...: runs CMD in host NAME's namespace (as is, on loopback).
on() {
  local name=$1; shift
  if [[ $LAYOUT == netns ]]; then nsenter -t "${host_ns_pid[$name]}" -n -- "$@"; else "$@"; fi
}
# The words that put a command in host NAME's namespace (none on loopback):
# a background job started as "${pre[@]}" CMD & has CMD's own pid in $!
# (nsenter enters a network namespace without forking).
ns_prefix() {
  [[ $LAYOUT == netns ]] && echo "nsenter -t ${host_ns_pid[$1]} -n --"
  return 0
}

cluster_init() {  # LAYOUT ETCD_MEMBERS REPLICAS
  LAYOUT=$1
  local members=$2 replicas=$3 i
  if [[ $LAYOUT == netns ]]; then
    ip link set lo up
    ip link add cbr0 type bridge
    ip addr add 10.77.0.1/24 dev cbr0
    ip link set cbr0 up
    for ((i = 0; i < members; i++)); do
      host_add "e$i" "10.77.0.$((11 + i))"
      etcd_ip[$i]=10.77.0.$((11 + i)) etcd_client_port[$i]=2379 etcd_peer_port[$i]=2380
    done
    for ((i = 0; i < replicas; i++)); do
      host_add "r$i" "10.77.0.$((21 + i))"
      replica_ip[$i]=10.77.0.$((21 + i)) replica_port[$i]=7000 tcpstore_port[$i]=29400
    done
  else
    local ports
    read -r -a ports <<<"$(free_ports $((2 * members + 2 * replicas)))"
    for ((i = 0; i < members; i++)); do
      etcd_ip[$i]=127.0.0.1 etcd_client_port[$i]=${ports[$((2 * i))]}
      etcd_peer_port[$i]=${ports[$((2 * i + 1))]}
    done
    for ((i = 0; i < replicas; i++)); do
      replica_ip[$i]=127.0.0.1 replica_port[$i]=${ports[$((2 * members + 2 * i))]}
      tcpstore_port[$i]=${ports[$((2 * members + 2 * i + 1))]}
    done
  fi
  ETCD_MEMBERS=$members REPLICAS=$replicas
  local eps=() peers=() addrs=()
  for ((i = 0; i < members; i++)); do
    eps+=("${etcd_ip[$i]}:${etcd_client_port[$i]}")
    peers+=("e$i=http://${etcd_ip[$i]}:${etcd_peer_port[$i]}")
  done
  for ((i = 0; i < replicas; i++)); do addrs+=("$(replica_addr "$i")"); done
  ENDPOINTS=$(IFS=,; echo "${eps[*]}")
  ETCD_CLUSTER=$(IFS=,; echo "${peers[*]}")
  ADDRS=$(IFS=,; echo "${addrs[*]}")
}

replica_addr() { echo "${replica_ip[$1]}:${replica_port[$1]}"; }

start_etcd() {  # I
  local i=$1 url=http://${etcd_ip[$1]} pre
  read -r -a pre <<<"$(ns_prefix "e$i")"
  "${pre[@]}" etcd --name "e$i" --data-dir "$TMP/e$i" \
    --listen-client-urls "$url:${etcd_client_port[$i]}" \
    --advertise-client-urls "$url:${etcd_client_port[$i]}" \
    --listen-peer-urls "$url:${etcd_peer_port[$i]}" \
    --initial-advertise-peer-urls "$url:${etcd_peer_port[$i]}" \
    --initial-cluster "$ETCD_CLUSTER" --initial-cluster-state new \
    --heartbeat-interval 100 --election-timeout 1000 \
    >>"$TMP/e$i.log" 2>&1 &
  etcd_pid[$i]=$!
}
wait_etcd() {
  for _ in $(seq 200); do
    ETCDCTL_API=3 etcdctl --endpoints="$ENDPOINTS" endpoint health >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "FAIL: etcd did not become healthy"; tail -5 "$TMP"/e*.log; return 1
}
start_cohortd() {  # R [BINARY]
  local r=$1 bin=${2:-$COHORTD} pre
  read -r -a pre <<<"$(ns_prefix "r$r")"
  "${pre[@]}" "$bin" --listen="$(replica_addr "$r")" \
    --tcpstore_listen="${replica_ip[$r]}:${tcpstore_port[$r]}" \
    --engine=etcd --etcd_endpoints="$ENDPOINTS" --election_ttl=2s \
    "${COHORTD_ARGS[@]}" >>"$TMP/c$r.log" 2>&1 &
  cohortd_pid[$r]=$!
}
wait_serving() {  # waits until every replica answers a read
  local r
  for ((r = 0; r < REPLICAS; r++)); do
    timeout 60 "$CTL" --addr="$(replica_addr "$r")" --connect_timeout=30 \
      check cluster/none >/dev/null 2>&1 ||
      { echo "FAIL: replica $r does not serve"; tail -20 "$TMP/c$r.log"; return 1; }
  done
}

cohortd_leader() {  # -> replica index, or nothing
  local at r
  at=$(ETCDCTL_API=3 etcdctl --endpoints="$ENDPOINTS" --command-timeout=2s \
    get /cohort/leader --print-value-only 2>/dev/null)
  for ((r = 0; r < REPLICAS; r++)); do
    [[ "$at" == "$(replica_addr "$r")" ]] && { echo "$r"; return; }
  done
}
etcd_leader() {  # -> member index, or nothing
  local i
  for ((i = 0; i < ETCD_MEMBERS; i++)); do
    ETCDCTL_API=3 etcdctl --endpoints="${etcd_ip[$i]}:${etcd_client_port[$i]}" \
      --command-timeout=1s endpoint status -w json 2>/dev/null | python3 -c '
import json, sys
s = json.load(sys.stdin)[0]["Status"]
sys.exit(0 if s["header"]["member_id"] == s["leader"] else 1)' 2>/dev/null &&
      { echo "$i"; return; }
  done
}
now_ns() { date +%s%N; }
# wait_for FN NOT [LIMIT_S]: waits until FN prints something other than NOT
# (and not nothing); prints the milliseconds taken. Gives up after LIMIT_S
# (default 60) so that a failover that never ends fails the case.
wait_for() {
  local fn=$1 not=$2 limit=${3:-60} start got
  start=$(now_ns)
  while (($(now_ns) - start < limit * 1000000000)); do
    got=$($fn)
    [[ -n "$got" && "$got" != "$not" ]] && { echo $((($(now_ns) - start) / 1000000)); return 0; }
    sleep 0.05
  done
  return 1
}

# cut A B / heal A B: drop every packet between hosts A and B (both ways),
# or stop dropping them. A host is e<i>, r<i> or "clients" (the test's own
# namespace, where no rule is kept: cutting clients from a host drops at the
# host only, which is enough both ways for TCP).
cut() { _faults add "$1" "$2"; }
heal() { _faults delete "$1" "$2"; }
_faults() {
  local verb=$1 a=$2 b=$3
  local ip_a=${host_ip[$a]:-10.77.0.1} ip_b=${host_ip[$b]:-10.77.0.1}
  [[ $a != clients ]] && nsenter -t "${host_ns_pid[$a]}" -n nft "$verb" element inet cohort_faults cut "{ $ip_b }"
  [[ $b != clients ]] && nsenter -t "${host_ns_pid[$b]}" -n nft "$verb" element inet cohort_faults cut "{ $ip_a }"
  return 0
}
# loss HOST PERCENT: drop that share of HOST's outgoing packets (0: none).
loss() {
  local host=$1 pct=$2
  nsenter -t "${host_ns_pid[$host]}" -n nft flush chain inet cohort_faults output
  ((pct > 0)) && nsenter -t "${host_ns_pid[$host]}" -n nft add rule inet cohort_faults output \
    numgen random mod 100 "<" "$pct" drop
  return 0
}
