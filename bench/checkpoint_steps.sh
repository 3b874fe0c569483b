#!/usr/bin/env bash
# What a checkpoint costs the training loop: the example trainer alone
# (--mode=local, one process) for STEPS steps with no checkpoint, with an
# asynchronous save every K steps and with a synchronous one, rounds
# alternating; prints each run's steps/s and the trainer's own line (saves,
# seconds of steps spent in them, seconds writing), then the medians.
#
#   bazel build //worker/parallel/examples:train
#   ROUNDS=3 STEPS=60 K=10 bench/checkpoint_steps.sh [DIR]
#
# DIR (default ./checkpoint-steps) must be on the disk under test; it is
# emptied before each run and removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
TRAIN=${TRAIN:-bazel-bin/worker/parallel/examples/train}
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-60}
K=${K:-10}
DIMS=${DIMS:-64,1024,1024,1024,16}
dir=$(realpath -m "${1:-checkpoint-steps}")
[[ -x $TRAIN ]] || { echo "build it first: bazel build //worker/parallel/examples:train" >&2; exit 1; }
declare -A rates
run() {
  local name=$1
  shift
  rm -rf "$dir" && mkdir -p "$dir"
  local out
  out=$("$TRAIN" --mode=local --steps="$STEPS" --log_every="$STEPS" --dims="$DIMS" "$@")
  local rate
  rate=$(sed -n 's/.* steps_per_s=\([0-9.]*\) .*/\1/p' <<<"$out")
  rates[$name]+="$rate "
  printf '%-6s %8s steps/s  %s\n' "$name" "$rate" "$(grep '^checkpoints:' <<<"$out" || true)"
}
echo "train --mode=local --dims=$DIMS --steps=$STEPS; saves every $K steps into $dir"
for round in $(seq "$ROUNDS"); do
  echo "round $round"
  run none
  run async --checkpoint_dir="$dir" --checkpoint_every="$K"
  run sync --checkpoint_dir="$dir" --checkpoint_every="$K" --checkpoint_sync
done
median() { tr ' ' '\n' | grep . | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
none=$(median <<<"${rates[none]}")
async=$(median <<<"${rates[async]}")
sync=$(median <<<"${rates[sync]}")
echo "medians: none $none, async $async, sync $sync steps/s"
awk -v n="$none" -v a="$async" -v s="$sync" 'BEGIN {
  printf "step time vs none: async %.3fx, sync %.3fx\n", n / a, n / s }'
rm -rf "$dir"
