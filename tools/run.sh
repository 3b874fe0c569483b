#!/usr/bin/env bash
# cohort's end-to-end demo, on the embedded default: starts cohortd (RocksDB
# in ./cohort-data), then trains the example MLP under cohortrun with two
# worker processes, first with DDP and then with FSDP (FULL_SHARD), prints
# each loss curve and a summary, and shuts cohortd down. Installs and builds
# what it needs first. Extra arguments go to the trainer (e.g. --steps=200).
# With COHORT_TRACE=DIR each job also writes its timelines (DIR/ddp.json and
# DIR/fsdp.json, merged) and the demo prints their summaries.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
bazel build --noshow_progress --ui_event_filters=-info \
  //server:cohortd //worker/launch:cohortrun //worker/parallel/examples:train \
  //client:cohortctl
bin=bazel-bin
for b in server/cohortd worker/launch/cohortrun worker/parallel/examples/train; do
  [[ -x $bin/$b ]] || { echo "run.sh: $bin/$b was not built" >&2; exit 1; }
done

demo_start=$SECONDS
data_dir=./cohort-data
mkdir -p "$data_dir"
log="$data_dir/cohortd.log"
# Port 0: the kernel picks a free port, and cohortd's first log line says
# which, so the demo never collides with another cohortd on 29500.
: >"$log"  # Exists before the loop below reads it.
"$bin/server/cohortd" --listen=127.0.0.1:0 --tcpstore_listen=127.0.0.1:0 --data_dir="$data_dir" >"$log" 2>&1 &
cohortd_pid=$!
stop_cohortd() {
  if kill -0 "$cohortd_pid" 2>/dev/null; then
    kill -TERM "$cohortd_pid"
    wait "$cohortd_pid" || true
  fi
}
trap stop_cohortd EXIT

addr=""
for _ in $(seq 100); do
  addr=$(sed -n 's/.*serving cohort.v1.Store on \([^;]*\);.*/\1/p' "$log" | head -1)
  [[ -n $addr ]] && break
  kill -0 "$cohortd_pid" 2>/dev/null || { cat "$log" >&2; exit 1; }
  sleep 0.1
done
[[ -n $addr ]] || { echo "run.sh: cohortd did not start; its log:" >&2; cat "$log" >&2; exit 1; }
echo "== cohortd serving on $addr (RocksDB in $data_dir)"

declare -A summary
for mode in ddp fsdp; do
  echo
  echo "== cohortrun: 2 workers, --mode=$mode"
  out="$data_dir/train-$mode.log"
  # COHORT_TRACE=DIR: each job's timelines in DIR/<mode>/ (docs/debugging.md).
  traced=()
  if [[ -n ${COHORT_TRACE:-} ]]; then traced=(env "COHORT_TRACE=$COHORT_TRACE/$mode"); fi
  if ! "${traced[@]}" "$bin/worker/launch/cohortrun" --coordinator="$addr" --run-id="demo-$mode-$$" \
    --nnodes=1:1 --nproc-per-node=2 -- \
    "$bin/worker/parallel/examples/train" --mode="$mode" --steps=200 --log_every=20 "$@" \
    2>&1 | tee "$out"; then
    echo "run.sh: the $mode job failed (its output is in $out)" >&2
    exit 1
  fi
  summary[$mode]=$(grep 'param_checksum=' "$out" | tail -1)
done

echo
echo "== summary: 2 workers each; bytes are per rank"
printf "%-5s %10s %16s %8s %12s %14s %10s\n" mode "last loss" param_checksum steps/s "sent/step" "params+grads+opt" peak
for mode in ddp fsdp; do
  line=${summary[$mode]}
  field() { sed -n "s/.*[ (]$1=\([^ ]*\).*/\1/p" <<<"$line"; }
  steps=$(grep -c '^step [0-9]* loss=' "$data_dir/train-$mode.log" || true)
  last_step=$(sed -n 's/^step \([0-9]*\) loss=.*/\1/p' "$data_dir/train-$mode.log" | tail -1)
  loss=$(sed -n 's/^step [0-9]* loss=//p' "$data_dir/train-$mode.log" | tail -1)
  sent=$(awk -v b="$(field comm_bytes_per_rank)" -v s="$last_step" 'BEGIN { printf "%.2fMiB", b / s / 1048576 }')
  held=$(awk -v p="$(field params)" -v g="$(field grads)" -v o="$(field optimizer)" 'BEGIN { printf "%.2fMiB", p + g + o }')
  printf "%-5s %10s %16s %8s %12s %14s %10s\n" "$mode" "$loss" "$(field param_checksum)" \
    "$(field steps_per_s)" "$sent" "$held" "$(field peak)"
done
ddp_sum=$(sed -n 's/.*param_checksum=\([^ ]*\).*/\1/p' <<<"${summary[ddp]}")
fsdp_sum=$(sed -n 's/.*param_checksum=\([^ ]*\).*/\1/p' <<<"${summary[fsdp]}")
if awk -v a="$ddp_sum" -v b="$fsdp_sum" 'BEGIN { d = a - b; if (d < 0) d = -d; m = a < 0 ? -a : a; exit !(d <= 1e-4 * m) }'; then
  echo "DDP and FSDP ended with the same parameters (checksums agree within 1e-4)."
else
  echo "run.sh: DDP and FSDP disagree: param_checksum $ddp_sum vs $fsdp_sum" >&2
  exit 1
fi

if [[ -n ${COHORT_TRACE:-} ]]; then
  for mode in ddp fsdp; do
    "$bin/client/cohortctl" trace merge "$COHORT_TRACE/$mode" -o "$COHORT_TRACE/$mode.json" 2>/dev/null
    echo
    echo "== timeline of the $mode job: $COHORT_TRACE/$mode.json (open it in ui.perfetto.dev); cohortctl trace summary, abridged:"
    # The first line, the mean over steps, and the ops.
    "$bin/client/cohortctl" trace summary "$COHORT_TRACE/$mode.json" |
      awk 'NR == 1 || /^ +step +step_ms/ || /^ +mean / { print } /^per op/ { ops = 1 } ops'
  done
fi

stop_cohortd
trap - EXIT
echo "== cohortd stopped: $(tail -1 "$log")"
echo "== demo done in $((SECONDS - demo_start)) s (after the build)"
