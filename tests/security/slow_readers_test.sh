#!/usr/bin/env bash
# Finding 7 of issue 24: 1,000 TCPStore connections that never read their
# replies, beside a real torch 2.x client (tests/security/slow_readers.py).
# cohortd runs with its defaults, so the bound checked is the one users get
# (--tcpstore_max_unsent_bytes_total, 256 MiB).
set -uo pipefail

COHORTD=server/cohortd
SCRIPT=tests/security/slow_readers.py
requirements=$(readlink -f tools/requirements.txt)
root=$(dirname "$(dirname "$requirements")")
PYTHON=${PYTHON:-$root/.venv/bin/python}
[[ -x "$PYTHON" ]] || { echo "FAIL: no venv python at $PYTHON: run tools/setup.sh"; exit 1; }
TMP=${TEST_TMPDIR:-$(mktemp -d)}
LOG=$TMP/cohortd.log

"$COHORTD" --engine=memory --listen=127.0.0.1:0 --tcpstore_listen=127.0.0.1:0 \
  --data_dir="$TMP/data" 2>"$LOG" &
PID=$!
trap 'kill -9 $PID 2>/dev/null' EXIT
for _ in $(seq 600); do
  PORT=$(sed -n 's/.*serving the TCPStore protocol on [^ ]*:\([0-9]*\) .*/\1/p' "$LOG")
  [[ -n "$PORT" ]] && break
  sleep 0.05
done
[[ -n "$PORT" ]] || { cat "$LOG"; echo "FAIL: cohortd did not log its TCPStore port"; exit 1; }

if ! "$PYTHON" "$SCRIPT" "$PORT" "$PID" 1000 $((256 << 20)); then
  echo "--- cohortd log (tail) ---"; tail -20 "$LOG"
  echo "FAIL: slow readers"
  exit 1
fi
grep -q "over --tcpstore_max_unsent_bytes_total" "$LOG" ||
  { tail -20 "$LOG"; echo "FAIL: cohortd never said why it closed a slow reader"; exit 1; }
kill -0 $PID || { echo "FAIL: cohortd died"; exit 1; }
echo "slow_readers_test: ok"
