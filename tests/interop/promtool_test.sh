#!/usr/bin/env bash
# cohortd's Prometheus metrics checked by Prometheus' own linter: start the
# real cohortd with --metrics_listen, drive real traffic (cohortctl over
# gRPC, Debian's PyTorch TCPStore client over the TCPStore protocol), scrape
# /metrics, and fail on anything `promtool check metrics` says (it prints
# some warnings with exit status 0). Then check values that must move: the
# Set counter by exactly the Sets made, the TCPStore query counters, the
# keys gauge against num-keys, the write-ahead-log sync histogram. Last, a
# busy metrics address must fail startup, naming it.
set -uo pipefail

COHORTD=server/cohortd
CTL=client/cohortctl
PROMTOOL=${PROMTOOL:-/usr/bin/promtool}
TORCH_PYTHON=/usr/bin/python3
TMP=${TEST_TMPDIR:-$(mktemp -d)}
LOG=$TMP/cohortd.log
failures=0

fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
expect_eq() { [[ "$2" == "$3" ]] || fail "$1: expected '$3', got '$2'"; }

[[ -x "$PROMTOOL" ]] || { echo "FAIL: no promtool at $PROMTOOL (Debian's prometheus; tools/setup.sh)"; exit 1; }
"$TORCH_PYTHON" -c 'import torch.distributed' 2>/dev/null ||
  { echo "FAIL: $TORCH_PYTHON cannot import torch.distributed (Debian's python3-torch)"; exit 1; }

"$COHORTD" --listen=127.0.0.1:0 --tcpstore_listen=127.0.0.1:0 \
  --metrics_listen=127.0.0.1:0 --data_dir="$TMP/data" --sync_writes 2>"$LOG" &
PID=$!
trap 'kill -9 $PID 2>/dev/null' EXIT
for _ in $(seq 300); do
  METRICS=$(sed -n 's|.*serving Prometheus metrics on \(http://[^ ]*\)$|\1|p' "$LOG")
  [[ -n "$METRICS" ]] && break
  sleep 0.05
done
[[ -n "$METRICS" ]] || { cat "$LOG"; echo "FAIL: cohortd did not log its metrics address"; exit 1; }
ADDR=$(sed -n 's/.*serving cohort.v1.Store on \([^;]*\);.*/\1/p' "$LOG")
TCPSTORE_PORT=$(sed -n 's/.*serving the TCPStore protocol on [^ ]*:\([0-9]*\) .*/\1/p' "$LOG")
export COHORT_ADDR=$ADDR

# curl where there is one; Python's urllib otherwise (a bare Debian image).
scrape() {
  if command -v curl >/dev/null; then
    curl -sf "$METRICS"
  else
    "$TORCH_PYTHON" -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())' "$METRICS"
  fi
}

# The value of the series NAME{...} whose labels include each of LABELS
# (as written in the scrape, e.g. 'method="Set"'); 0 when there is none.
value() {  # FILE NAME [LABEL...]
  local file=$1 name=$2
  shift 2
  awk -v name="$name" -v want="$*" '
    BEGIN { n = split(want, labels, " ") }
    /^#/ { next }
    {
      series = $1
      base = series; sub(/\{.*/, "", base)
      if (base != name) next
      for (i = 1; i <= n; i++) if (index(series, labels[i]) == 0) next
      print $2; found = 1; exit
    }
    END { if (!found) print 0 }' "$file"
}

scrape >"$TMP/before.txt" || fail "first scrape of $METRICS"
grep -q '^# TYPE cohort_store_keys gauge' "$TMP/before.txt" ||
  fail "the first scrape lacks cohort_store_keys"

SETS=7
for i in $(seq $SETS); do "$CTL" set "metrics/k$i" "v$i" || fail "set $i"; done
expect_eq "get" "$("$CTL" get metrics/k1)" "v1"
expect_eq "add" "$("$CTL" add metrics/n 3)" "3"
"$CTL" wait metrics/k1 metrics/n --timeout=5 || fail "wait"
"$CTL" get metrics/missing --timeout=0.2 2>/dev/null && fail "get of a missing key succeeded"

OMP_NUM_THREADS=1 "$TORCH_PYTHON" - "$TCPSTORE_PORT" <<'EOF' || fail "the torch TCPStore client failed"
import sys
from datetime import timedelta
import torch.distributed as dist

s = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False,
                  timeout=timedelta(seconds=20))
s.set("torch/a", "1")
s.set("torch/b", "2")
assert s.get("torch/a") == b"1"
assert s.add("torch/n", 5) == 5
s.wait(["torch/a", "torch/b"])
print("torch client: num_keys", s.num_keys())
EOF

scrape >"$TMP/after.txt" || fail "second scrape of $METRICS"

# The linter: any output at all is a failure, whatever its exit status.
lint=$("$PROMTOOL" check metrics <"$TMP/after.txt" 2>&1)
status=$?
if [[ $status -ne 0 || -n "$lint" ]]; then
  fail "promtool check metrics (exit $status): $lint"
fi

set_ok='method="Set" code="OK"'
expect_eq "Set calls counted" \
  "$(( $(value "$TMP/after.txt" cohort_grpc_server_handled_total $set_ok) - \
       $(value "$TMP/before.txt" cohort_grpc_server_handled_total $set_ok) ))" "$SETS"
expect_eq "Set latencies observed" \
  "$(( $(value "$TMP/after.txt" cohort_grpc_server_handling_seconds_count 'method="Set"') - \
       $(value "$TMP/before.txt" cohort_grpc_server_handling_seconds_count 'method="Set"') ))" "$SETS"
expect_eq "the missing get counted as DEADLINE_EXCEEDED" \
  "$(value "$TMP/after.txt" cohort_grpc_server_handled_total 'method="Get"' 'code="DEADLINE_EXCEEDED"')" "1"
expect_eq "TCPStore SETs counted" \
  "$(value "$TMP/after.txt" cohort_tcpstore_queries_total 'query="SET"' 'outcome="ok"')" "2"
expect_eq "TCPStore ADD counted" \
  "$(value "$TMP/after.txt" cohort_tcpstore_queries_total 'query="ADD"' 'outcome="ok"')" "1"
[[ "$(value "$TMP/after.txt" cohort_tcpstore_query_seconds_count 'query="GET"')" -ge 1 ]] ||
  fail "no TCPStore GET latency observed"
KEYS=$("$CTL" num-keys)
expect_eq "keys gauge" "$(value "$TMP/after.txt" cohort_store_keys)" "$KEYS"
expect_eq "keys written" "$KEYS" "$((SETS + 1 + 3))"
# Each gRPC write is a revision; the TCPStore listener may commit several
# writes as one.
[[ "$(value "$TMP/after.txt" cohort_store_revision)" -gt $((SETS + 1)) ]] ||
  fail "revision gauge below the writes made"
[[ "$(value "$TMP/after.txt" cohort_store_wal_sync_seconds_count)" -ge $((SETS + 1)) ]] ||
  fail "--sync_writes: fewer WAL syncs observed than writes"
[[ "$(value "$TMP/after.txt" cohort_store_disk_bytes)" -gt 0 ]] || fail "disk bytes gauge is 0"
[[ "$(value "$TMP/after.txt" cohort_connections 'protocol="grpc"')" =~ ^[0-9]+$ ]] ||
  fail "no gRPC connections gauge"

# A busy metrics address fails startup, naming it.
BUSY=${METRICS#http://}
BUSY=${BUSY%/metrics}
"$COHORTD" --listen=127.0.0.1:0 --tcpstore_listen= --engine=memory \
  --metrics_listen="$BUSY" 2>"$TMP/busy.log" &
BUSY_PID=$!
( sleep 20; kill -9 $BUSY_PID 2>/dev/null ) &
wait $BUSY_PID
status=$?
[[ $status -ne 0 && $status -ne 137 ]] || fail "cohortd on a busy metrics port: exit $status"
grep -q "fatal: .*$BUSY" "$TMP/busy.log" || fail "the busy-port error does not name $BUSY: $(cat "$TMP/busy.log")"

kill -TERM $PID
wait $PID || fail "cohortd did not stop cleanly"

if [[ $failures -gt 0 ]]; then
  echo "--- scrape ---"; cat "$TMP/after.txt"
  echo "--- cohortd log ---"; cat "$LOG"
  exit 1
fi
echo "PASS"
