#!/usr/bin/env bash
# Sharded checkpoints end to end (docs/checkpoints.md), with the real
# binaries and the Python reader under PyTorch 2.x:
#  1. an FSDP job (2 workers under cohortrun) saves every 5 of 20 steps;
#     cohortctl checkpoints lists steps 5, 10, 15, 20 at world 2, 20 latest;
#     torch loads step 20's folder with cohort_checkpoint.py and finds the
#     job's final parameters bit for bit;
#  2. the same job with a worker SIGKILLed after step 12 (cohortrun
#     --max-restarts=1, train --resume): the second attempt resumes from the
#     latest committed checkpoint and ends with the same parameters as the
#     uninterrupted job, bit for bit (world 2: sums of two terms commute);
#  3. that job's checkpoint resumed by DDP on one worker: it starts after
#     the checkpoint's step, at another world size and in another mode;
#  4. an elastic job (two cohortrun nodes, --nnodes=1:2; a 10 s last call,
#     not 30, for a second node in each round) loses a node after
#     step 12 (its last worker SIGKILLs its cohortrun, then itself): the
#     other node's next round runs at world 1 and resumes from the latest
#     checkpoint saved at world 2, FSDP's shards re-cut; the loss curve
#     continues where the checkpoint left it, and the catalog lists the
#     saves of both world sizes.
set -uo pipefail

COHORTD=server/cohortd
CTL=client/cohortctl
RUN=worker/launch/cohortrun
TRAIN=worker/parallel/examples/train
READER=worker/checkpoint/cohort_checkpoint.py
TMP=${TEST_TMPDIR:-$(mktemp -d)}
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

requirements=$(readlink -f tools/requirements.txt)
PYTHON=${PYTHON:-$(dirname "$(dirname "$requirements")")/.venv/bin/python}
[[ -x "$PYTHON" ]] || { echo "FAIL: no venv python at $PYTHON: run tools/setup.sh"; exit 1; }

"$COHORTD" --listen=127.0.0.1:0 --tcpstore_listen=127.0.0.1:0 --engine=memory 2>"$TMP/cohortd.log" &
CPID=$!
trap 'kill $CPID 2>/dev/null' EXIT
for _ in $(seq 300); do
  PORT=$(sed -n 's/.*serving cohort.v1.Store on 127.0.0.1:\([0-9]*\);.*/\1/p' "$TMP/cohortd.log")
  [[ -n "$PORT" ]] && break
  sleep 0.05
done
[[ -n "$PORT" ]] || { cat "$TMP/cohortd.log"; exit 1; }

# job NAME NPROC MODE [cohortrun flags] -- [train flags]: a 20-step job,
# checkpoints every 5 steps in $TMP/NAME.ckpt (or the DIR given with
# --checkpoint_dir), rank 0's final parameters in $TMP/NAME.params.
job() {
  local name=$1 nproc=$2 mode=$3 run_flags=() train_flags=()
  shift 3
  while (($#)) && [[ $1 != -- ]]; do run_flags+=("$1"); shift; done
  (($#)) && shift
  train_flags=("$@")
  timeout 300 "$RUN" --coordinator="127.0.0.1:$PORT" --run-id="$name" --nnodes=1:1 \
    --nproc-per-node="$nproc" "${run_flags[@]}" -- "$TRAIN" --mode="$mode" \
    --steps=20 --seed=7 --optimizer=adam --lr=0.001 --dims=64,128,128,16 \
    --checkpoint_dir="$TMP/$name.ckpt" --checkpoint_every=5 \
    --params_out="$TMP/$name.params" "${train_flags[@]}" \
    >"$TMP/$name.out" 2>"$TMP/$name.err" ||
    fail "$name: cohortrun exited non-zero: $(tail -8 "$TMP/$name.err")"
}

# 1. Save, list, read with torch.
job whole 2 fsdp
"$CTL" --addr="127.0.0.1:$PORT" checkpoints whole >"$TMP/list" 2>"$TMP/list.err" ||
  fail "cohortctl checkpoints: $(cat "$TMP/list.err")"
echo "cohortctl checkpoints whole:"
sed 's/^/  /' "$TMP/list"
[[ $(awk '{print $1 ":" $2}' "$TMP/list" | tr '\n' ' ') == "5:2 10:2 15:2 20:2 " ]] ||
  fail "expected steps 5 10 15 20 at world 2: $(cat "$TMP/list")"
[[ $(grep -c ' latest$' "$TMP/list") == 1 && $(tail -1 "$TMP/list") == *" latest" ]] ||
  fail "step 20 should be the one latest: $(cat "$TMP/list")"
folder=$(tail -1 "$TMP/list" | awk '{print $5}')
grep -q '^checkpoints: 4 saved (async)' "$TMP/whole.out" ||
  fail "the trainer did not report 4 async saves: $(grep checkpoints "$TMP/whole.out")"
"$PYTHON" - "$folder" "$TMP/whole.params" "$READER" <<'EOF' || fail "torch could not load the checkpoint (above)"
import importlib.util, sys
import numpy as np, torch
folder, params, reader = sys.argv[1:]
spec = importlib.util.spec_from_file_location("cohort_checkpoint", reader)
cc = importlib.util.module_from_spec(spec); spec.loader.exec_module(cc)
ckpt = cc.Checkpoint(folder)
assert ckpt.step == 20 and ckpt.world_size == 2, (ckpt.step, ckpt.world_size)
state = ckpt.state_dict()
names = sorted((n for n in state if n.count(".") == 1), key=lambda n: int(n.split(".")[1]))
flat = torch.cat([state[n].reshape(-1) for n in names])
final = torch.from_numpy(np.fromfile(params, dtype="<f4"))
assert flat.dtype == torch.float32 and flat.shape == final.shape, (flat.shape, final.shape)
assert torch.equal(flat, final), "the checkpoint's parameters are not the job's final ones"
assert "param.0.exp_avg" in state and ckpt.attributes["optimizer"] == "adam"
assert ckpt.attributes["optimizer.step"] == "20", ckpt.attributes
print(f"torch loaded {len(state)} tensors of step {ckpt.step}: {len(names)} parameters "
      f"({flat.numel()} elements) equal to the job's final parameters")
EOF

# 2. Killed after step 12, resumed by cohortrun's second attempt.
job killed 2 fsdp --max-restarts=1 -- --resume --fault_kill_after_step=12
grep -q 'SIGKILL after step 12' "$TMP/killed.err" ||
  fail "killed: no worker killed itself: $(tail -5 "$TMP/killed.err")"
grep -q 'restarting:' "$TMP/killed.err" || fail "killed: cohortrun did not restart the round"
resumed=$(sed -n 's/^resuming after step \([0-9]*\) .*/\1/p' "$TMP/killed.out")
echo "killed after step 12; the second attempt resumed after step ${resumed:-?}"
[[ $resumed == 5 || $resumed == 10 ]] ||
  fail "killed: expected a resume after step 5 or 10 (the saves before the kill): $(grep -e resuming -e '^step 1[0-3] ' "$TMP/killed.out")"
cmp -s "$TMP/whole.params" "$TMP/killed.params" ||
  fail "killed: the resumed job's final parameters differ from the uninterrupted job's"
# The loss curve continues: the step after the resume has the uninterrupted
# job's loss at that step.
next=$((resumed + 1))
want=$(sed -n "s/^step $next loss=//p" "$TMP/whole.out" | head -1)
got=$(sed -n "s/^step $next loss=//p" "$TMP/killed.out" | tail -1)
[[ -n $want && $got == "$want" ]] || fail "killed: step $next's loss after the resume is '$got', uninterrupted '$want'"

# 3. Resumed at world 1 by DDP from the killed job's checkpoints.
job other_world 1 ddp -- --resume --checkpoint_dir="$TMP/killed.ckpt" \
  --checkpoint_run=killed --steps=25
grep -q '^resuming after step 20 .*(saved at world 2)' "$TMP/other_world.out" ||
  fail "other_world: $(head -3 "$TMP/other_world.out") $(tail -3 "$TMP/other_world.err")"

# 4. A node leaves an elastic job; the survivor resumes at world 1.
pids=()
for n in a b; do
  ( timeout 300 "$RUN" --coordinator="127.0.0.1:$PORT" --run-id=leave --node-id=$n \
      --heartbeat-interval=1s --last-call-timeout=10s --nnodes=1:2 --nproc-per-node=1 \
      --max-restarts=1 -- \
      "$TRAIN" --mode=fsdp --steps=30 --seed=7 --optimizer=adam --lr=0.001 \
      --dims=64,128,128,16 --checkpoint_dir="$TMP/leave.ckpt" --checkpoint_every=5 \
      --resume --fault_kill_after_step=12 --fault_kill_node \
      >"$TMP/leave.$n.out" 2>"$TMP/leave.$n.err"
    echo $? >"$TMP/leave.$n.rc" ) &
  pids+=($!)
done
wait "${pids[@]}"
[[ $(cat "$TMP/leave.a.rc") == 0 ]] ||
  fail "leave: node a exited $(cat "$TMP/leave.a.rc"): $(tail -8 "$TMP/leave.a.err")"
grep -q 'SIGKILL of its node after step 12' "$TMP/leave.b.err" ||
  fail "leave: node b's worker did not kill its node: $(tail -5 "$TMP/leave.b.err")"
grep -q 'round 1: node rank 0 of 1, world size 1' "$TMP/leave.a.err" ||
  fail "leave: node a's second round is not at world 1: $(grep round "$TMP/leave.a.err")"
resumed=$(sed -n 's/^resuming after step \([0-9]*\) .*(saved at world 2)$/\1/p' "$TMP/leave.a.out")
echo "a node left after step 12; the survivor resumed at world 1 after step ${resumed:-?}"
[[ $resumed == 5 || $resumed == 10 ]] ||
  fail "leave: expected a resume after step 5 or 10 from a world-2 save: $(grep -e resuming -e '^mode' "$TMP/leave.a.out")"
grep -q '^mode=fsdp world=1 param_checksum' "$TMP/leave.a.out" ||
  fail "leave: the world-1 round did not finish: $(tail -3 "$TMP/leave.a.out")"
# The loss continues: step resumed+1 at world 1 is the loss of the world-2
# run at that step (the same parameters, from the checkpoint), up to the
# order of f32 sums: a mean of n = 128 x 16 squared errors over outputs of
# 3 layers of dot products of <= 128 terms differs by at most 2 gamma(n')
# of the loss, n' = 2048 + 6 x 128, plus the 1e-6 the lines print.
next=$((resumed + 1))
before=$(sed -n "s/^step $next loss=//p" "$TMP/leave.a.out" | head -1)
after=$(sed -n "s/^step $next loss=//p" "$TMP/leave.a.out" | tail -1)
[[ $(grep -c "^step $next loss=" "$TMP/leave.a.out") == 2 ]] ||
  fail "leave: expected step $next in both rounds: $(grep "^step $next " "$TMP/leave.a.out")"
awk -v a="$before" -v b="$after" 'BEGIN {
  n = 2048 + 6 * 128; u = 2^-24; g = n * u / (1 - n * u)
  d = a - b; if (d < 0) d = -d
  exit !(d <= 2 * g * a + 1e-6) }' ||
  fail "leave: step $next's loss at world 1 ($after) is not world 2's ($before)"
"$CTL" --addr="127.0.0.1:$PORT" checkpoints leave >"$TMP/leave.list" 2>&1 ||
  fail "cohortctl checkpoints leave: $(cat "$TMP/leave.list")"
sed 's/^/  /' "$TMP/leave.list"
# The saves up to the resumed step are world 2's; the later ones, world 1's
# (a save still being written when the node died is made again at world 1).
awk -v r="$resumed" '($1 <= r && $2 != 2) || ($1 > r && $2 != 1) { bad = 1 }
  END { exit bad }' "$TMP/leave.list" &&
  [[ $(tail -1 "$TMP/leave.list" | awk '{print $1 ":" $2 ":" $NF}') == "30:1:latest" ]] ||
  fail "leave: expected world-2 saves up to step $resumed, world-1 saves after it, step 30 latest: $(cat "$TMP/leave.list")"

if ((failures > 0)); then
  echo "$failures check(s) failed"
  exit 1
fi
echo "all checks passed"
