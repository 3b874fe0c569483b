#!/usr/bin/env bash
# Step time of the demo model (train's defaults) at world 2: two worker
# processes under cohortrun against one cohortd, in these modes:
#   compute_only   each rank's forward/backward/optimizer on its half of the
#                  batch, no communication: the floor DDP could reach
#   ddp            buckets all_reduced while backward goes on (the default)
#   ddp_no_overlap every bucket all_reduced after backward (--overlap=false)
#   ddp_unverified ddp without the ProcessGroup's per-op check (as torch)
#   fsdp           FULL_SHARD (prefetch depth 1); fsdp_grad_op: SHARD_GRAD_OP
#   fsdp_prefetchK FULL_SHARD with --fsdp_prefetch=K (0: none; K units ahead)
#   powersgdR      DDP with the PowerSGD hook at rank R (plain all_reduce for
#                  the first 10 steps); the table adds the last step's loss
#                  and the bytes per step after the start, against ddp's
# Rounds alternate the modes so that drift on a shared VM hits all alike;
# the table shows each mode's median and the hidden share of communication.
#   bazel run //bench:train_bench -- [train flags, e.g. --bucket_cap_mb=0.5]
#   ROUNDS=5 STEPS=100 NPROC=4 bazel run //bench:train_bench
#   MODES="compute_only ddp ddp_no_overlap fsdp_prefetch0 fsdp fsdp_prefetch2" \
#     bazel run //bench:train_bench -- --dims=256,512,512,512,512,512,512,512,10 \
#     --teacher_dims=256,128,10   # a deeper model (8 layers)
#   MODES="ddp powersgd1 powersgd2 powersgd4" STEPS=200 bazel run //bench:train_bench
set -euo pipefail

ROUNDS=${ROUNDS:-5}
STEPS=${STEPS:-100}
NPROC=${NPROC:-2}
TMP=$(mktemp -d)
CPID=""
trap '[[ -n $CPID ]] && kill $CPID 2>/dev/null; rm -rf "$TMP"' EXIT

: >"$TMP/cohortd.log"  # Exists before the loop below reads it.
server/cohortd --listen=127.0.0.1:0 --tcpstore_listen=127.0.0.1:0 --engine=memory 2>"$TMP/cohortd.log" &
CPID=$!
for _ in $(seq 300); do
  ADDR=$(sed -n 's/.*serving cohort.v1.Store on \([^;]*\);.*/\1/p' "$TMP/cohortd.log")
  [[ -n $ADDR ]] && break
  sleep 0.05
done

read -r -a modes <<<"${MODES:-compute_only ddp ddp_no_overlap ddp_unverified fsdp fsdp_grad_op}"
has() { [[ " ${modes[*]} " == *" $1 "* ]]; }
run=0
for round in $(seq "$ROUNDS"); do
  for m in "${modes[@]}"; do
    args=(--mode="$m")
    [[ $m == ddp_no_overlap ]] && args=(--mode=ddp --overlap=false)
    [[ $m == ddp_unverified ]] && args=(--mode=ddp --verify_ops=false)
    [[ $m == fsdp_prefetch* ]] && args=(--mode=fsdp --fsdp_prefetch="${m#fsdp_prefetch}")
    [[ $m == powersgd* ]] && args=(--mode=ddp --comm_hook=powersgd --powersgd_rank="${m#powersgd}" --powersgd_start_step=10)
    run=$((run + 1))
    worker/launch/cohortrun --coordinator="$ADDR" --run-id="bench-$run" \
      --nnodes=1:1 --nproc-per-node="$NPROC" -- \
      worker/parallel/examples/train "${args[@]}" --steps="$STEPS" \
      --log_every=1000000 "$@" >"$TMP/out" 2>"$TMP/err" ||
      { echo "$m failed:"; cat "$TMP/err"; exit 1; }
    line=$(grep param_checksum "$TMP/out")
    sps=$(sed -n 's/.*steps_per_s=\([0-9.]*\).*/\1/p' <<<"$line")
    echo "$m $(awk -v s="$sps" 'BEGIN { printf "%.3f", 1000 / s }')" >>"$TMP/times"
    echo "$line" >"$TMP/last.$m"
    grep '^step ' "$TMP/out" | tail -1 | sed 's/.*loss=//' >"$TMP/loss.$m"
    echo "round $round $m: $(awk -v s="$sps" 'BEGIN { printf "%.2f ms/step", 1000 / s }')"
  done
done

median() { grep "^$1 " "$TMP/times" | awk '{print $2}' | sort -g |
  awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
echo
printf "%-15s %10s %12s %10s %10s %10s %14s\n" mode "ms/step" "comm/rank" params grads peak peak_gathered
for m in "${modes[@]}"; do
  line=$(cat "$TMP/last.$m")
  field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<"$line"; }
  comm=$(sed -n 's/.*comm_bytes_per_rank=[0-9]* (\([^)]*\)).*/\1/p' <<<"$line")
  printf "%-15s %10s %12s %10s %10s %10s %14s\n" "$m" "$(median "$m")" "$comm" \
    "$(field params)" "$(field grads)" "$(field peak)" "$(field peak_gathered)"
done
echo
if has compute_only && has ddp && has ddp_no_overlap; then
  c=$(median compute_only); d=$(median ddp); n=$(median ddp_no_overlap)
  awk -v c="$c" -v d="$d" -v n="$n" 'BEGIN {
    printf "DDP / compute-only: %.2fx; communication exposed without overlap: %.2f ms/step, with overlap: %.2f ms/step (%.0f%% hidden)\n",
      d / c, n - c, d - c, (n > c) ? 100 * (n - d) / (n - c) : 0 }'
fi
if has compute_only && has ddp_unverified; then
  c=$(median compute_only); u=$(median ddp_unverified)
  awk -v c="$c" -v u="$u" 'BEGIN { printf "DDP without verify_ops / compute-only: %.2fx (exposed %.2f ms/step)\n", u / c, u - c }'
fi
if has ddp; then
  bytes() { sed -n 's/.*comm_bytes_per_rank=\([0-9]*\).*/\1/p' "$TMP/last.$1"; }
  for m in "${modes[@]}"; do
    [[ $m == powersgd* ]] || continue
    # Bytes per compressed step: what the run sent beyond its 10 plain steps
    # (ddp's per-step bytes each), over the remaining steps.
    awk -v d="$(bytes ddp)" -v p="$(bytes "$m")" -v s="$STEPS" -v m="$m" \
        -v dt="$(median ddp)" -v pt="$(median "$m")" \
        -v dl="$(cat "$TMP/loss.ddp")" -v pl="$(cat "$TMP/loss.$m")" 'BEGIN {
      per = d / s; c = (p - 10 * per) / (s - 10)
      printf "%s: %.0f bytes/step compressed vs ddp %.0f (1/%.1f); step time %.2fx ddp; loss at step %d %s vs ddp %s\n",
        m, c, per, per / c, pt / dt, s, pl, dl }'
  done
  d=$(median ddp)
  for m in "${modes[@]}"; do
    [[ $m == fsdp* ]] || continue
    awk -v d="$d" -v f="$(median "$m")" -v m="$m" 'BEGIN { printf "%s / DDP step time: %.2fx\n", m, f / d }'
  done
fi
