#!/usr/bin/env bash
# cohortd inspected with grpcurl, the gRPC command-line client most users
# know (tools/setup.sh builds it with `go install`), through server
# reflection only, no .proto files: docs/coordination.md's examples. It lists
# the services and cohort.v1.Store's methods, describes a method and a message,
# does a Set and a Get, calls the standard health check, and checks that a
# bad request and a timed-out blocking Get come back with their gRPC codes
# while cohortd keeps serving. Then it watches a prefix (a server stream):
# the replayed change, a live one, and not the key outside the prefix.
# cohort.v1.Info tells where the TCPStore listener is: its bound address,
# or --tcpstore_advertise's (also through `cohortctl info`); a bad
# --tcpstore_advertise stops cohortd at start-up, saying why.
# tests/interop/buf_curl_test.sh is its twin with buf curl.
set -uo pipefail

COHORTD=server/cohortd
CTL=client/cohortctl
GRPCURL=${GRPCURL:-/usr/local/lib/cohort-tools/bin/grpcurl}
TMP=${TEST_TMPDIR:-$(mktemp -d)}
LOG=$TMP/cohortd.log
failures=0

fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
expect_eq() { [[ "$2" == "$3" ]] || fail "$1: expected '$3', got '$2'"; }

[[ -x "$GRPCURL" ]] || { echo "FAIL: no grpcurl at $GRPCURL: run tools/setup.sh"; exit 1; }

"$COHORTD" --listen=127.0.0.1:0 --tcpstore_listen=127.0.0.1:0 --engine=memory 2>"$LOG" &
PID=$!
WATCH_PID=
ADVERTISED_PID=
trap 'kill -9 $PID $WATCH_PID $ADVERTISED_PID 2>/dev/null' EXIT
for _ in $(seq 300); do
  ADDR=$(sed -n 's/.*serving cohort.v1.Store on \([^;]*\);.*/\1/p' "$LOG")
  TCPSTORE=$(sed -n 's/.*serving the TCPStore protocol on \([^ ]*\) .*/\1/p' "$LOG")
  [[ -n "$ADDR" && -n "$TCPSTORE" ]] && break
  sleep 0.05
done
[[ -n "$ADDR" && -n "$TCPSTORE" ]] || { cat "$LOG"; echo "FAIL: cohortd did not start"; exit 1; }

# -max-time bounds every call (reflection included) so that a hung cohortd
# fails the test instead of stalling it; no call here comes near it.
grpcurl_() { "$GRPCURL" -plaintext -max-time 60 "$@"; }
# JSON field of a one-line-per-field reply: "  "name": "value","  -> value
field() { sed -n "s/^ *\"$1\": \"\{0,1\}\([^\",]*\)\"\{0,1\},\{0,1\}$/\1/p"; }

services=$(grpcurl_ "$ADDR" list 2>&1)
for s in cohort.v1.Store cohort.v1.Rendezvous cohort.v1.Membership cohort.v1.Info \
         grpc.health.v1.Health grpc.reflection.v1alpha.ServerReflection; do
  grep -qx "$s" <<<"$services" || fail "list lacks $s: $services"
done

methods=$(grpcurl_ "$ADDR" list cohort.v1.Store 2>&1)
for m in Set Get Add CompareSet Wait MultiGet Watch; do
  grep -qx "cohort.v1.Store.$m" <<<"$methods" || fail "Store lacks $m: $methods"
done

# The descriptors cohortd serves are proto/cohort/v1/store.proto's.
method=$(grpcurl_ "$ADDR" describe cohort.v1.Store.Set 2>&1)
grep -qF "rpc Set ( .cohort.v1.SetRequest ) returns ( .cohort.v1.SetResponse );" \
  <<<"$method" || fail "describe cohort.v1.Store.Set: $method"
message=$(grpcurl_ "$ADDR" describe cohort.v1.GetRequest 2>&1)
for f in "bytes key = 1;" "int64 timeout_ms = 2;"; do
  grep -qF "$f" <<<"$message" || fail "GetRequest lacks '$f': $message"
done

# Keys and values are bytes: base64 in JSON ("greeting" and "hello");
# int64s are strings.
set_reply=$(grpcurl_ -d '{"key":"Z3JlZXRpbmc=","value":"aGVsbG8="}' \
  "$ADDR" cohort.v1.Store/Set 2>&1)
expect_eq "Set's revision" "$(field revision <<<"$set_reply")" "1"
get_reply=$(grpcurl_ -d '{"key":"Z3JlZXRpbmc="}' "$ADDR" cohort.v1.Store/Get 2>&1)
expect_eq "Get's value" "$(field value <<<"$get_reply")" "aGVsbG8="
expect_eq "Get's revision" "$(field revision <<<"$get_reply")" "1"

health=$(grpcurl_ -d '{"service":""}' "$ADDR" grpc.health.v1.Health/Check 2>&1)
expect_eq "health check" "$(field status <<<"$health")" "SERVING"

# A failed call prints its status and exits with 64 + the gRPC code.
bad=$(grpcurl_ -d '{"key":""}' "$ADDR" cohort.v1.Store/Get 2>&1)
expect_eq "an empty key's exit status" "$?" "67"  # INVALID_ARGUMENT is 3
grep -q "Code: InvalidArgument" <<<"$bad" || fail "an empty key: $bad"

# A Get of a missing key blocks until the request's timeout_ms, then fails
# naming the key ("missing").
timed_out=$(grpcurl_ -d '{"key":"bWlzc2luZw==","timeout_ms":"100"}' \
  "$ADDR" cohort.v1.Store/Get 2>&1)
expect_eq "a timed-out Get's exit status" "$?" "68"  # DEADLINE_EXCEEDED is 4
grep -q "Code: DeadlineExceeded" <<<"$timed_out" || fail "a timed-out Get: $timed_out"
grep -qF 'missing: "missing"' <<<"$timed_out" || fail "the timeout names no key: $timed_out"

# Neither failure stopped cohortd.
get_reply=$(grpcurl_ -d '{"key":"Z3JlZXRpbmc="}' "$ADDR" cohort.v1.Store/Get 2>&1)
expect_eq "Get's value after the failures" "$(field value <<<"$get_reply")" "aGVsbG8="

# A watch of "greet" from revision 1: it replays greeting@1, skips
# other@2 and streams greeting@3. Revision 1 is retained, so the stream
# carries the same changes whether it starts before or after the Sets; the
# loop only waits for the last one to arrive.
grpcurl_ -d '{"key":"b3RoZXI=","value":"eA=="}' "$ADDR" cohort.v1.Store/Set >/dev/null 2>&1 ||
  fail "Set of other"
WATCH_OUT=$TMP/watch.out
grpcurl_ -d '{"prefix":"Z3JlZXQ=","from_revision":"1"}' "$ADDR" cohort.v1.Store/Watch \
  >"$WATCH_OUT" 2>&1 &
WATCH_PID=$!
grpcurl_ -d '{"key":"Z3JlZXRpbmc=","value":"Ynll"}' "$ADDR" cohort.v1.Store/Set >/dev/null 2>&1 ||
  fail "Set of greeting to bye"
for _ in $(seq 600); do
  if grep -q '"revision": "3"' "$WATCH_OUT" || ! kill -0 "$WATCH_PID" 2>/dev/null; then break; fi
  sleep 0.05
done
kill "$WATCH_PID" 2>/dev/null
wait "$WATCH_PID" 2>/dev/null
expect_eq "the watch's start revision" "$(field start_revision <"$WATCH_OUT")" "1"
events=$(paste -d ' ' <(field type <"$WATCH_OUT") <(field key <"$WATCH_OUT") \
  <(field value <"$WATCH_OUT") <(field revision <"$WATCH_OUT"))
expect_eq "the watch's events" "$events" \
  "PUT Z3JlZXRpbmc= aGVsbG8= 1
PUT Z3JlZXRpbmc= Ynll 3"

# Where the TCPStore listener is: bound to 127.0.0.1, so that address.
info=$(grpcurl_ "$ADDR" cohort.v1.Info/GetServerInfo 2>&1)
expect_eq "GetServerInfo's engine" "$(field engine <<<"$info")" "memory"
[[ "$(field version <<<"$info")" =~ ^[0-9]+\.[0-9]+\.[0-9]+ ]] || fail "GetServerInfo's version: $info"
[[ "$(field server_id <<<"$info")" =~ ^[0-9a-f]{32}$ ]] || fail "GetServerInfo's server_id: $info"
expect_eq "GetServerInfo's TCPStore address" "$(field address <<<"$info")" "$TCPSTORE"
expect_eq "GetServerInfo's TCPStore source" "$(field source <<<"$info")" "BOUND"

# Behind a Service or a NAT: --tcpstore_advertise is what clients are told,
# through grpcurl and cohortctl info alike.
ADVERTISED_LOG=$TMP/advertised.log
"$COHORTD" --listen=127.0.0.1:0 --tcpstore_listen=127.0.0.1:0 --engine=memory \
  --tcpstore_advertise=tcpstore.example:29400 2>"$ADVERTISED_LOG" &
ADVERTISED_PID=$!
for _ in $(seq 300); do
  ADVERTISED=$(sed -n 's/.*serving cohort.v1.Store on \([^;]*\);.*/\1/p' "$ADVERTISED_LOG")
  [[ -n "$ADVERTISED" ]] && break
  sleep 0.05
done
if [[ -z "$ADVERTISED" ]]; then
  fail "cohortd --tcpstore_advertise did not start: $(cat "$ADVERTISED_LOG")"
else
  grep -q "clients are told to dial tcpstore.example:29400" "$ADVERTISED_LOG" ||
    fail "cohortd's log does not say what it advertises: $(cat "$ADVERTISED_LOG")"
  info=$(grpcurl_ "$ADVERTISED" cohort.v1.Info/GetServerInfo 2>&1)
  expect_eq "the advertised address" "$(field address <<<"$info")" "tcpstore.example:29400"
  expect_eq "the advertised source" "$(field source <<<"$info")" "ADVERTISED"
  ctl_info=$("$CTL" --addr="$ADVERTISED" info 2>&1)
  grep -qx "tcpstore tcpstore.example:29400" <<<"$ctl_info" || fail "cohortctl info: $ctl_info"
  grep -qx "tcpstore_source advertised" <<<"$ctl_info" || fail "cohortctl info: $ctl_info"
  grep -qx "tcpstore_bound 127.0.0.1:[0-9]*" <<<"$ctl_info" || fail "cohortctl info: $ctl_info"
  grep -qx "engine memory" <<<"$ctl_info" || fail "cohortctl info: $ctl_info"
fi

# A bad --tcpstore_advertise stops cohortd before it serves, saying why.
# (Port 0 leaves whatever the machine runs on 29400 alone.)
bad_advertise() {
  local out
  out=$("$COHORTD" --listen=127.0.0.1:0 --tcpstore_listen=127.0.0.1:0 --engine=memory \
    "$@" 2>&1 </dev/null)
  local rc=$?
  [[ $rc == 1 ]] || fail "cohortd $* exited $rc, not 1: $out"
  grep -q "fatal: .*--tcpstore_advertise" <<<"$out" || fail "cohortd $*: $out"
  grep -q "serving cohort.v1.Store" <<<"$out" && fail "cohortd $* served first: $out"
  echo "$out"
}
grep -q "no port" <<<"$(bad_advertise --tcpstore_advertise=tcpstore.example)" ||
  fail "no port: not said"
grep -q "every interface" <<<"$(bad_advertise --tcpstore_advertise=0.0.0.0:29400)" ||
  fail "a wildcard: not said"
grep -q "from 1 to 65535" <<<"$(bad_advertise --tcpstore_advertise=tcpstore.example:0)" ||
  fail "port 0: not said"
grep -q "but it is off" <<<"$(bad_advertise --tcpstore_listen= --tcpstore_advertise=a:1)" ||
  fail "advertising no listener: not said"

if ((failures)); then
  echo "grpcurl_test: $failures check(s) failed"
  exit 1
fi
echo "grpcurl_test: every check passed ($("$GRPCURL" -version 2>&1))"
