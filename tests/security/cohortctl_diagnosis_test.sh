#!/usr/bin/env bash
# What cohortctl says when it cannot connect (issue 24, finding 7): each
# failure named for what it is, with what to do, against real processes:
#   - cohortd at --max_connections (held by a watch): its GOAWAY's text;
#   - a plaintext cohortd out of file descriptors (its hard RLIMIT_NOFILE
#     lowered while it serves, and connections held open): out of file
#     descriptors, not "answers in TLS" (what it said before);
#   - a listening socket that is never accepted, what any server whose
#     accept() fails looks like from outside: accepts but never answers;
#   - a TLS cohortd: a plaintext client is told it answers in TLS, a TLS
#     client against a plaintext cohortd that it serves plaintext;
#   - a TLS cohortd out of file descriptors (gRPC's own listener): never
#     answers, for plaintext and TLS clients alike, not TLS.
set -uo pipefail

COHORTD=server/cohortd
CTL=client/cohortctl
PYTHON=/usr/bin/python3
TMP=${TEST_TMPDIR:-$(mktemp -d)}
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
expect_has() { grep -qF -- "$3" <<<"$2" || fail "$1: expected '$3' in: $2"; }
expect_not() { grep -qF -- "$3" <<<"$2" && fail "$1: did not expect '$3' in: $2"; }

command -v openssl >/dev/null || { echo "FAIL: no openssl: run tools/setup.sh"; exit 1; }
command -v prlimit >/dev/null || { echo "FAIL: no prlimit (util-linux)"; exit 1; }

PIDS=()
trap 'for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null; done' EXIT

# start_cohortd NAME ARGS...: sets PID, PORT (gRPC) and LOG.
start_cohortd() {
  local name=$1
  shift
  LOG=$TMP/$name.log
  "$COHORTD" --listen=127.0.0.1:0 --tcpstore_listen=127.0.0.1:0 \
    --engine=memory "$@" 2>"$LOG" &
  PID=$!
  PIDS+=("$PID")
  PORT=
  for _ in $(seq 600); do
    PORT=$(sed -n 's/.*serving cohort.v1.Store on [^;]*:\([0-9]*\);.*/\1/p' "$LOG")
    [[ -n "$PORT" ]] && break
    kill -0 "$PID" 2>/dev/null || break
    sleep 0.05
  done
  [[ -n "$PORT" ]] || { cat "$LOG"; echo "FAIL: cohortd $name did not start"; exit 1; }
}

# A client that must fail: cohortctl's error (also shown in the test's log).
# Failures that waiting can mend are reported once the connect timeout has
# passed, the others as soon as they are seen; the timeout only leaves a
# loaded machine time to answer the probes.
ctl() {
  local out rc
  out=$(timeout 120 "$CTL" --connect_timeout="${CONNECT_TIMEOUT:-8}" "$@" 2>&1)
  rc=$?
  echo "cohortctl $*: $out" >&2
  echo "$out"
  return $rc
}

# hold N ARGS...: N watches, each holding a connection to cohortd as long
# as it gets one (they retry for a minute).
hold() {
  local n=$1
  shift
  for _ in $(seq "$n"); do
    "$CTL" --connect_timeout=60 "$@" watch held/ >/dev/null 2>&1 &
    PIDS+=("$!")
  done
}

# exhaust_fds LOG_LINE CLIENT_FLAGS...: runs cohortd ($PID) out of file
# descriptors: lowers its limit, hard and soft, to the ones it has open now
# and three more, as though it had been started so, has watches take them,
# and waits for LOG_LINE in its log.
exhaust_fds() {
  local line=$1 open
  shift
  open=$(ls "/proc/$PID/fd" | wc -l)
  prlimit --pid "$PID" --nofile=$((open + 3)):$((open + 3)) ||
    { echo "FAIL: prlimit on cohortd"; exit 1; }
  hold 5 "$@"
  for _ in $(seq 1200); do
    grep -q "$line" "$LOG" && return
    sleep 0.05
  done
  fail "cohortd never logged '$line' out of file descriptors: $(cat "$LOG")"
}

# --- Over --max_connections: the GOAWAY's text reaches the user. ---
start_cohortd limited --max_connections=1 --metrics_listen=127.0.0.1:0
METRICS=
for _ in $(seq 600); do
  METRICS=$(sed -n 's|.*serving Prometheus metrics on \(http://[^ ]*\)$|\1|p' "$LOG")
  [[ -n "$METRICS" ]] && break
  sleep 0.05
done
hold 1 --addr="127.0.0.1:$PORT"
held=
for _ in $(seq 1200); do
  curl -s "$METRICS" | grep -q '^cohort_connections{protocol="grpc"} 1$' &&
    { held=1; break; }
  sleep 0.05
done
[[ -n "$held" ]] || fail "the watch never held cohortd's one connection"
out=$(ctl --addr="127.0.0.1:$PORT" get k)
expect_has "over the limit" "$out" "cannot connect to cohortd at 127.0.0.1:$PORT"
expect_has "over the limit: the GOAWAY" "$out" "turns new connections away with an HTTP/2 GOAWAY saying \"cohortd: too many connections ("
expect_has "over the limit: its reason" "$out" "--max_connections); retry later\""
expect_has "over the limit: what to do" "$out" "raise --max_connections"
expect_not "over the limit" "$out" "TLS"

# --- A plaintext cohortd out of file descriptors. ---
start_cohortd exhausted
exhaust_fds "out of file descriptors" --addr="127.0.0.1:$PORT"
out=$(ctl --addr="127.0.0.1:$PORT" get k)
expect_has "out of fds" "$out" "cannot connect to cohortd at 127.0.0.1:$PORT"
# Closed at once (cohortd's own listener) or never answered: both say so.
expect_has "out of fds: says where to look" "$out" "Too many open files"
expect_has "out of fds: what to do" "$out" "raise its \`ulimit -n\`"
expect_not "out of fds" "$out" "TLS"

# --- A listening socket that is never accepted. ---
"$PYTHON" -c '
import socket, time
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen(16)
print(s.getsockname()[1], flush=True)
time.sleep(3600)
' >"$TMP/silent.port" &
PIDS+=("$!")
for _ in $(seq 600); do [[ -s "$TMP/silent.port" ]] && break; sleep 0.05; done
SILENT=127.0.0.1:$(cat "$TMP/silent.port")
out=$(ctl --addr="$SILENT" get k)
expect_has "never accepted" "$out" "cannot connect to cohortd at $SILENT"
expect_has "never accepted: what it does" "$out" "accepts TCP connections but never answers on them"
expect_has "never accepted: what it usually is" "$out" "out of file descriptors"
expect_not "never accepted" "$out" "TLS"

# --- TLS: a mismatch either way is named at once. ---
C=$TMP/certs
mkdir -p "$C"
ec() { openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes "$@" 2>/dev/null; }
ec -x509 -keyout "$C/ca.key" -out "$C/ca.crt" -days 2 -subj "/CN=cohort test CA"
ec -keyout "$C/server.key" -out "$C/server.csr" -subj "/CN=cohortd"
printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' >"$C/server.ext"
openssl x509 -req -in "$C/server.csr" -CA "$C/ca.crt" -CAkey "$C/ca.key" \
  -CAcreateserial -out "$C/server.crt" -days 1 -extfile "$C/server.ext" 2>/dev/null
start_cohortd plain
PLAIN_PORT=$PORT
start_cohortd tls --tls_cert="$C/server.crt" --tls_key="$C/server.key"
out=$(CONNECT_TIMEOUT=60 ctl --addr="127.0.0.1:$PORT" get k)
expect_has "plaintext client, TLS cohortd" "$out" "accepts connections but answers in TLS"
expect_has "plaintext client, TLS cohortd: what to do" "$out" "set COHORT_TLS_CA (--tls_ca)"
out=$(CONNECT_TIMEOUT=60 ctl --addr="127.0.0.1:$PLAIN_PORT" --tls_ca="$C/ca.crt" get k)
expect_has "TLS client, plaintext cohortd" "$out" "serves plaintext, and this client asks for TLS"
out=$(ctl --addr="127.0.0.1:$PORT" --tls_ca="$C/ca.crt" set k v) ||
  fail "TLS client, TLS cohortd: $out"

# --- A TLS cohortd out of file descriptors: gRPC's own listener stops
# accepting, and nothing tells TLS from anything else. ---
exhaust_fds "Too many open files" --addr="127.0.0.1:$PORT" --tls_ca="$C/ca.crt"
for client in plaintext tls; do
  flags=()
  [[ $client == tls ]] && flags=(--tls_ca="$C/ca.crt")
  out=$(ctl --addr="127.0.0.1:$PORT" "${flags[@]}" get k)
  expect_has "TLS cohortd out of fds, $client client" "$out" "cannot connect to cohortd at 127.0.0.1:$PORT"
  expect_has "TLS cohortd out of fds, $client client" "$out" "Too many open files"
  expect_not "TLS cohortd out of fds, $client client" "$out" "answers in TLS"
  expect_not "TLS cohortd out of fds, $client client" "$out" "TLS handshake"
done

if ((failures)); then echo "$failures check(s) failed"; exit 1; fi
echo "cohortctl diagnosis test passed"
