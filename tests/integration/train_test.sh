#!/usr/bin/env bash
# The training demo's promise, with the real binaries: cohortd, cohortrun and
# the example trainer. The same job (--steps=30 --seed=7) ends with the same
# param_checksum whether DDP runs on 1 or 2 workers or FSDP (both sharding
# strategies) on 2, and its loss goes down.
set -uo pipefail

COHORTD=server/cohortd
RUN=worker/launch/cohortrun
TRAIN=worker/parallel/examples/train
TMP=${TEST_TMPDIR:-$(mktemp -d)}
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

"$COHORTD" --listen=127.0.0.1:0 --tcpstore_listen=127.0.0.1:0 --data_dir="$TMP/cohortd-data" 2>"$TMP/cohortd.log" &
CPID=$!
trap 'kill $CPID 2>/dev/null' EXIT
for _ in $(seq 300); do
  PORT=$(sed -n 's/.*serving cohort.v1.Store on 127.0.0.1:\([0-9]*\);.*/\1/p' "$TMP/cohortd.log")
  [[ -n "$PORT" ]] && break
  sleep 0.05
done
[[ -n "$PORT" ]] || { cat "$TMP/cohortd.log"; exit 1; }

# train_job NAME NPROC MODE: runs the job, leaves rank 0's output in
# $TMP/NAME.out and prints its param_checksum.
train_job() {
  local name=$1 nproc=$2 mode=$3
  if ! "$RUN" --coordinator="127.0.0.1:$PORT" --run-id="$name" --nnodes=1:1 \
      --nproc-per-node="$nproc" -- "$TRAIN" --mode="$mode" --steps=30 --seed=7 \
      >"$TMP/$name.out" 2>"$TMP/$name.err"; then
    fail "$name: cohortrun exited non-zero: $(tail -5 "$TMP/$name.err")"
    return
  fi
  sed -n 's/.*param_checksum=\([^ ]*\).*/\1/p' "$TMP/$name.out"
}

# close A B: |A - B| <= 1e-4 * max(|A|, |B|)
close() {
  awk -v a="$1" -v b="$2" 'BEGIN {
    d = a - b; if (d < 0) d = -d
    m = a < 0 ? -a : a; n = b < 0 ? -b : b; if (n > m) m = n
    exit !(a != "" && b != "" && d <= 1e-4 * m) }'
}

ddp1=$(train_job ddp1 1 ddp)
ddp2=$(train_job ddp2 2 ddp)
fsdp2=$(train_job fsdp2 2 fsdp)
grad_op2=$(train_job grad_op2 2 fsdp_grad_op)
echo "param_checksum: ddp x1 $ddp1, ddp x2 $ddp2, fsdp x2 $fsdp2, fsdp_grad_op x2 $grad_op2"
[[ -n $ddp1 ]] || fail "ddp x1 printed no param_checksum: $(cat "$TMP/ddp1.out")"
for other in "ddp x2:$ddp2" "fsdp x2:$fsdp2" "fsdp_grad_op x2:$grad_op2"; do
  close "$ddp1" "${other#*:}" || fail "${other%%:*} checksum ${other#*:} differs from ddp x1's $ddp1 by more than 1e-4"
done

# Rank 0 alone prints: 30 step lines, one summary with every figure.
for name in ddp2 fsdp2; do
  [[ $(grep -c '^step [0-9]* loss=' "$TMP/$name.out") == 30 ]] ||
    fail "$name: expected 30 loss lines from rank 0: $(cat "$TMP/$name.out")"
  grep -q 'steps_per_s=[0-9.]* comm_bytes_per_rank=[1-9][0-9]* .*params=.*grads=.*optimizer=.*peak=' "$TMP/$name.out" ||
    fail "$name: summary line incomplete: $(grep param_checksum "$TMP/$name.out")"
  first=$(sed -n 's/^step 1 loss=//p' "$TMP/$name.out")
  last=$(sed -n 's/^step 30 loss=//p' "$TMP/$name.out")
  awk -v f="$first" -v l="$last" 'BEGIN { exit !(l < 0.8 * f) }' ||
    fail "$name: loss did not go down: step 1 $first, step 30 $last"
done

# FSDP holds about half of DDP's parameter bytes per rank at world 2.
ddp_params=$(sed -n 's/.* params=\([0-9.]*\)MiB.*/\1/p' "$TMP/ddp2.out")
fsdp_params=$(sed -n 's/.* params=\([0-9.]*\)MiB.*/\1/p' "$TMP/fsdp2.out")
awk -v d="$ddp_params" -v f="$fsdp_params" 'BEGIN { exit !(f > 0.45 * d && f < 0.55 * d) }' ||
  fail "fsdp x2 holds ${fsdp_params}MiB of parameters per rank, ddp x2 ${ddp_params}MiB: expected about half"

if ((failures > 0)); then
  echo "$failures check(s) failed"
  exit 1
fi
echo "all checks passed"
