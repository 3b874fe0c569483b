#!/usr/bin/env bash
# cohortd's status page in a real browser: Debian's chromium driven by
# playwright-core (npm; tools/setup.sh installs both) against live cohortds
# with a job running: a rendezvous round of two nodes (join_main), four
# heartbeating member processes (member_main), two of them waiting at a
# barrier a third never reaches; and a second run, three worker processes
# under cohortrun, one of which sleeps before an op the others wait in.
# browser/status_page_test.js asserts what a user sees: the run and its
# nodes, every member alive, the barrier naming the missing rank, the
# hung run's diagnosis naming the rank behind; then it kill -9s
# a member and waits for its row to turn failed. A second cohortd runs
# with auth: the page asks for a token, and a run's token shows that run
# alone. Screenshots land in $TEST_UNDECLARED_OUTPUTS_DIR
# (bazel-testlogs/tests/interop/status_page_test/test.outputs/).
# Fails, not skips, without chromium or playwright-core.
set -uo pipefail

COHORTD=server/cohortd
CTL=client/cohortctl
MEMBER=tests/testing/member_main
JOIN=tests/testing/join_main
RUN=worker/launch/cohortrun
WORKER=tests/testing/flight_worker
SCRIPT=tests/interop/browser/status_page_test.js
TOOLS=/usr/local/lib/cohort-tools
export PLAYWRIGHT_CORE=${PLAYWRIGHT_CORE:-$TOOLS/node_modules/playwright-core}
export CHROMIUM=${CHROMIUM:-/usr/bin/chromium}
TMP=${TEST_TMPDIR:-$(mktemp -d)}
export OUT_DIR=${TEST_UNDECLARED_OUTPUTS_DIR:-$TMP/outputs}
mkdir -p "$OUT_DIR"
pids=()
cleanup() {
  for p in "${pids[@]}"; do
    pkill -9 -P "$p" 2>/dev/null  # cohortrun's workers
    kill -9 "$p" 2>/dev/null
  done
}
trap cleanup EXIT

die() { echo "FAIL: $*"; exit 1; }

command -v node >/dev/null || die "no node (Debian's nodejs; tools/setup.sh)"
[[ -x "$CHROMIUM" ]] || die "no chromium at $CHROMIUM (Debian's chromium; tools/setup.sh)"
[[ -f "$PLAYWRIGHT_CORE/package.json" ]] ||
  die "no playwright-core at $PLAYWRIGHT_CORE (npm; tools/setup.sh)"

# start_cohortd LOG [FLAGS...]: starts cohortd, waits for its addresses;
# sets ADDR (gRPC) and STATUS_URL.
start_cohortd() {
  local log=$1
  shift
  "$COHORTD" --listen=127.0.0.1:0 --tcpstore_listen= --engine=memory \
    --metrics_listen=127.0.0.1:0 "$@" 2>"$log" &
  pids+=($!)
  ADDR= STATUS_URL=
  for _ in $(seq 600); do
    ADDR=$(sed -n 's/.*serving cohort.v1.Store on \([^;]*\);.*/\1/p' "$log")
    STATUS_URL=$(sed -n 's|.*serving the status page on \(http://[^ ]*\) .*|\1|p' "$log")
    [[ -n "$ADDR" && -n "$STATUS_URL" ]] && return 0
    sleep 0.05
  done
  cat "$log"
  die "cohortd did not log its addresses"
}

# wait_for FILE TEXT: until FILE holds TEXT (a process said it is ready).
wait_for() {
  for _ in $(seq 1200); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    sleep 0.05
  done
  cat "$1"
  die "no '$2' in $1"
}

# member NAME RANK HOST [FLAGS...]: a member process of group "demo",
# heartbeating every 200 ms (failed after 3 missed: 600 ms).
member() {
  local name=$1 rank=$2 host=$3
  shift 3
  "$MEMBER" --addr="$ADDR" --group=demo --name="$name" --rank="$rank" \
    --host="$host" --interval_ms=200 "$@" >"$TMP/$name.out" 2>&1 &
  pids+=($!)
  wait_for "$TMP/$name.out" joined
}

# --- A cohortd without auth, and a job on it.
start_cohortd "$TMP/open.log"
export COHORT_ADDR=$ADDR
"$JOIN" --addr="$ADDR" --run=demo --node=node-a --address=10.0.0.1:29400 \
  --local_world_size=2 --nnodes=2 >"$TMP/join-a.out" 2>&1 &
join_a=$!
"$JOIN" --addr="$ADDR" --run=demo --node=node-b --address=10.0.0.2:29400 \
  --local_world_size=2 --nnodes=2 >"$TMP/join-b.out" 2>&1 ||
  die "node-b's rendezvous: $(cat "$TMP/join-b.out")"
wait $join_a || die "node-a's rendezvous: $(cat "$TMP/join-a.out")"
# m0 and m1 arrive at barrier init once all four are members (a barrier's
# named participants must be); m2 never does.
barrier=(--barrier=init --barrier_participants=m0,m1,m2
         --barrier_after_members=4)
member m0 0 host-a "${barrier[@]}"
member m1 1 host-a "${barrier[@]}"
member m2 2 host-b
member m3 3 host-b
export VICTIM_PID=${pids[-1]}
# A real job that hangs: three flight_worker ranks under cohortrun, rank 1
# asleep before its third all-reduce. cohortctl diagnose asks the ranks for
# their flight records until the hang shows, which leaves them in cohortd
# for the page.
"$RUN" --coordinator="$ADDR" --run-id=hang --node-id=node-h \
  --nproc-per-node=3 --heartbeat-interval=1s -- "$WORKER" --fault=sleep \
  --fault_rank=1 --fault_step=2 >"$TMP/hang.out" 2>&1 &
pids+=($!)
for _ in $(seq 120); do
  "$CTL" diagnose hang --answer_timeout=5 >"$TMP/hang.diag" 2>&1
  grep -q 'in AllReduce #2' "$TMP/hang.diag" && break
  sleep 1
done
grep -q 'rank 1 last completed #1 and has not entered #2' "$TMP/hang.diag" ||
  die "cohortctl diagnose hang: $(cat "$TMP/hang.diag")"
export OPEN_URL=$STATUS_URL

# --- A cohortd with auth: an admin token and run demo's.
export ADMIN_TOKEN=status-admin-0123456789abcdef
export RUN_TOKEN=status-demo-0123456789abcdef
printf '%s admin *\n%s r demo/\n' "$ADMIN_TOKEN" "$RUN_TOKEN" >"$TMP/tokens"
start_cohortd "$TMP/auth.log" --auth_tokens="$TMP/tokens"
for run in demo other; do
  COHORT_TOKEN=$ADMIN_TOKEN "$JOIN" --addr="$ADDR" --run=$run --node=n1 \
    --address=10.0.1.1:29400 >"$TMP/join-$run.out" 2>&1 ||
    die "run $run's rendezvous: $(cat "$TMP/join-$run.out")"
done
export AUTH_URL=$STATUS_URL

node "$SCRIPT"
status=$?
if ((status != 0)); then
  echo "--- open cohortd ---"; cat "$TMP/open.log"
  echo "--- auth cohortd ---"; cat "$TMP/auth.log"
  for f in "$TMP"/*.out; do echo "--- $f ---"; cat "$f"; done
  echo "FAIL: the browser checks (screenshots in $OUT_DIR)"
  exit 1
fi
ls "$OUT_DIR"/status_page.png >/dev/null || die "no screenshot in $OUT_DIR"
echo "PASS (screenshots in $OUT_DIR)"
