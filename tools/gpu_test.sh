#!/usr/bin/env bash
# The NCCL backend on a machine with GPUs (worker/collective/nccl/README.md):
#  1. builds it and runs its tests, the GPU ones included (nccl_gpu_test runs
#     every op and kernel on every visible GPU, device_buffers_gpu_test DDP
#     and FSDP on device buffers; on a machine without one they skip);
#  2. runs bench/nccl_bench under cohortrun, one process per visible GPU,
#     against a local cohortd: all_reduce, all_gather, reduce_scatter and
#     broadcast from 8 B to 1 GiB, in nccl-tests' columns (algbw, busbw).
# Prints the benchmark's table and saves it to $OUT (default
# /tmp/nccl_bench.txt). Exits 2, saying so, when no GPU is visible: nothing
# here can run without one (CI has none; `bazel test //worker/collective/
# nccl/...` is what runs there).
#   tools/gpu_test.sh                      # every GPU, 8 B .. 1 GiB
#   MAX_BYTES=64M ITERS=50 tools/gpu_test.sh
#   CUDA_VISIBLE_DEVICES=0,1 tools/gpu_test.sh
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-/tmp/nccl_bench.txt}
MIN_BYTES=${MIN_BYTES:-8}
MAX_BYTES=${MAX_BYTES:-1G}
ITERS=${ITERS:-20}
WARMUP=${WARMUP:-5}

# The GPUs this process may use: nvidia-smi's list, narrowed by
# CUDA_VISIBLE_DEVICES when it is set.
gpus=0
if ! command -v nvidia-smi >/dev/null 2>&1; then
  why="nvidia-smi is not installed (no NVIDIA driver)"
elif ! listing=$(nvidia-smi -L 2>&1); then
  why="nvidia-smi -L failed: ${listing}"
else
  gpus=$(grep -c '^GPU ' <<<"$listing" || true)
  why="nvidia-smi -L lists no GPU"
  if [[ -n ${CUDA_VISIBLE_DEVICES+x} ]]; then
    visible=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c . || true)
    ((visible < gpus)) && gpus=$visible
    why="CUDA_VISIBLE_DEVICES='${CUDA_VISIBLE_DEVICES}' leaves no GPU"
  fi
fi
if ((gpus < 1)); then
  echo "gpu_test: no GPU visible: ${why}." >&2
  echo "gpu_test: nothing run. Without a GPU, 'bazel test //worker/collective/nccl/...' runs the NCCL backend's GPU-free tests." >&2
  exit 2
fi
echo "gpu_test: ${gpus} GPU(s) visible"
nvidia-smi -L | head -n "$gpus"

bazel build //worker/collective/nccl/... //bench:nccl_bench //server:cohortd \
  //worker/launch:cohortrun
bazel test --test_output=all --nocache_test_results //worker/collective/nccl/... \
  //worker/parallel:device_buffers_gpu_test //worker/parallel:device_buffers_test

bin=$(bazel info bazel-bin 2>/dev/null)
tmp=$(mktemp -d)
cohortd_pid=""
cleanup() {
  [[ -n $cohortd_pid ]] && kill "$cohortd_pid" 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT

: >"$tmp/cohortd.log"
"$bin/server/cohortd" --listen=127.0.0.1:0 --engine=memory 2>"$tmp/cohortd.log" &
cohortd_pid=$!
addr=""
for _ in $(seq 300); do
  addr=$(sed -n 's/.*serving cohort.v1.Store on \([^;]*\);.*/\1/p' "$tmp/cohortd.log")
  [[ -n $addr ]] && break
  sleep 0.05
done
if [[ -z $addr ]]; then
  echo "gpu_test: cohortd did not start:" >&2
  cat "$tmp/cohortd.log" >&2
  exit 1
fi

echo "gpu_test: nccl_bench on ${gpus} GPU(s), ${MIN_BYTES} B .. ${MAX_BYTES}B"
"$bin/worker/launch/cohortrun" --coordinator="$addr" --run-id=nccl-bench \
  --nnodes=1:1 --nproc-per-node="$gpus" -- \
  "$bin/bench/nccl_bench" --min_bytes="$MIN_BYTES" --max_bytes="$MAX_BYTES" \
  --iters="$ITERS" --warmup="$WARMUP" | tee "$OUT"
echo "gpu_test: the table is in $OUT; put it beside nccl-tests' figures for this GPU in bench/README.md"
