#!/usr/bin/env bash
# cohortd inspected the way a new user would, with a real third-party gRPC
# client: buf curl (npm's @bufbuild/buf; tools/setup.sh installs it) through
# server reflection only, no .proto files. It lists the services, lists
# cohort.v1.Store's methods, does a Set and a Get, and calls the standard
# health check, whose descriptor cohortd must put in the reflection pool
# (gRPC's built-in health service has none of its own).
set -uo pipefail

COHORTD=server/cohortd
BUF=${BUF:-/usr/local/lib/cohort-tools/node_modules/.bin/buf}
TMP=${TEST_TMPDIR:-$(mktemp -d)}
LOG=$TMP/cohortd.log
failures=0

fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
expect_eq() { [[ "$2" == "$3" ]] || fail "$1: expected '$3', got '$2'"; }

[[ -x "$BUF" ]] || { echo "FAIL: no buf at $BUF: run tools/setup.sh"; exit 1; }

"$COHORTD" --listen=127.0.0.1:0 --tcpstore_listen=127.0.0.1:0 --engine=memory 2>"$LOG" &
PID=$!
trap 'kill -9 $PID 2>/dev/null' EXIT
for _ in $(seq 300); do
  ADDR=$(sed -n 's/.*serving cohort.v1.Store on \([^;]*\);.*/\1/p' "$LOG")
  [[ -n "$ADDR" ]] && break
  sleep 0.05
done
[[ -n "$ADDR" ]] || { cat "$LOG"; echo "FAIL: cohortd did not start"; exit 1; }

curl_() { "$BUF" curl --protocol grpc --http2-prior-knowledge "$@"; }
# JSON field of a one-line-per-field reply: "  "name": "value","  -> value
field() { sed -n "s/^ *\"$1\": \"\{0,1\}\([^\",]*\)\"\{0,1\},\{0,1\}$/\1/p"; }

services=$(curl_ --list-services "http://$ADDR" 2>&1)
for s in cohort.v1.Store cohort.v1.Rendezvous cohort.v1.Membership \
         grpc.health.v1.Health grpc.reflection.v1alpha.ServerReflection; do
  grep -qx "$s" <<<"$services" || fail "--list-services lacks $s: $services"
done

methods=$(curl_ --list-methods "http://$ADDR" 2>&1)
for m in Set Get Add CompareSet Wait MultiGet Watch; do
  grep -qx "cohort.v1.Store/$m" <<<"$methods" || fail "Store lacks $m: $methods"
done

# Keys and values are bytes: base64 in JSON ("greeting" and "hello").
set_reply=$(curl_ -d '{"key":"Z3JlZXRpbmc=","value":"aGVsbG8="}' \
  "http://$ADDR/cohort.v1.Store/Set" 2>&1)
expect_eq "Set's revision" "$(field revision <<<"$set_reply")" "1"
get_reply=$(curl_ -d '{"key":"Z3JlZXRpbmc="}' "http://$ADDR/cohort.v1.Store/Get" 2>&1)
expect_eq "Get's value" "$(field value <<<"$get_reply")" "aGVsbG8="
expect_eq "Get's revision" "$(field revision <<<"$get_reply")" "1"

health=$(curl_ -d '{"service":""}' "http://$ADDR/grpc.health.v1.Health/Check" 2>&1)
expect_eq "health check" "$(field status <<<"$health")" "SERVING"

# A bad request gets its status through the same client.
bad=$(curl_ -d '{"key":""}' "http://$ADDR/cohort.v1.Store/Get" 2>&1)
grep -q "invalid_argument" <<<"$bad" || fail "an empty key: $bad"

if ((failures)); then
  echo "buf_curl_test: $failures check(s) failed"
  exit 1
fi
echo "buf_curl_test: every check passed (buf $("$BUF" --version))"
