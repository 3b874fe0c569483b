#!/usr/bin/env bash
# The NCCL backend on a GPU: everything that is the device's own, in one
# command with one log and an exit status that says what passed.
#
# A GPU machine here has no Bazel, no network and none of Debian's gRPC,
# RocksDB or Abseil libraries, so the work is split in two:
#
#   tools/gpu_test.sh pack     # on the build machine (CUDA from the venv's
#                              # wheels is enough; no GPU needed): builds the
#                              # binaries and packs them with the shared
#                              # libraries they need into .gpu/bundle.tar.xz
#   tools/gpu_test.sh          # on the GPU machine, from the checkout that
#                              # holds .gpu/: unpacks and runs the steps below
#
# Where Bazel is installed and no bundle is there, the run packs first.
# The steps (each with a time limit, so one hang cannot eat the machine):
#   env      the GPU, driver, glibc, and the NCCL the binaries load (the
#            one beside the machine's PyTorch when LD_LIBRARY_PATH has none)
#   libs     every binary finds every library it needs (ldd)
#   nccl_types_test          dtype/op mapping against NCCL's headers
#   nccl_gpu_test            every op on every GPU; kernels bit for bit
#   nccl_device_test         init, split, abort, errors, stream order
#   nccl_device_test:hang    the watchdog aborting a hung op (own process)
#   device_buffers_gpu_test  DDP and FSDP on device memory, bit for bit
#                            against the host; no cudaMalloc when steady;
#                            an FSDP checkpoint saved and loaded there
#   device_memory_bench      kernel GB/s beside the device's copy; the cost
#                            of one DeviceMemory call
#   nccl_bench               under cohortrun and a local cohortd, one
#                            process per GPU (busbw means something only
#                            with 2 or more)
#   torch_backend            the "cohort" torch backend on CUDA tensors:
#                            SKIPPED while it is built for CPU only
# Logs go to $GPU_TEST_LOGS (default: $OUT when set, else /tmp/gpu_test):
# gpu_test.log (everything), figures.txt (the benchmarks' tables).
# Exit status: 0 every step passed (SKIPPED steps say why), 1 some step
# failed (the summary names it), 2 no GPU visible (nothing run).
#   MAX_BYTES=64M ITERS=50 tools/gpu_test.sh
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
bundle_dir=$root/.gpu
bundle=$bundle_dir/bundle.tar.xz

# The binaries, as Bazel labels and as paths under bazel-bin.
targets=(
  //worker/collective/nccl:nccl_types_test
  //worker/collective/nccl:nccl_gpu_test
  //worker/collective/nccl:nccl_device_test
  //worker/parallel:device_buffers_gpu_test
  //bench:device_memory_bench
  //bench:nccl_bench
  //server:cohortd
  //worker/launch:cohortrun
)

pack() {
  command -v bazel >/dev/null || { echo "gpu_test pack: bazel is not installed" >&2; return 1; }
  bazel build "${targets[@]}" || return 1
  local bin stage
  bin=$(bazel info bazel-bin 2>/dev/null)
  stage=$(mktemp -d)
  mkdir -p "$stage/bin" "$stage/lib"
  local built=()
  for t in "${targets[@]}"; do
    local path=${t#//}
    path=$bin/${path/://}
    [[ -x $path ]] || { echo "gpu_test pack: $path is not an executable (built without CUDA?)" >&2; return 1; }
    cp "$path" "$stage/bin/"
    built+=("$path")
  done
  # The shared libraries they load (ldd where they were built, so that
  # Bazel's own libraries are found through their runpaths), but for
  # glibc's and the C++ runtime's (the GPU machine's own are newer) and
  # NCCL's (the machine's PyTorch carries it; ours is too large to travel).
  local libs
  libs=$(ldd "${built[@]}" | awk '$3 ~ /^\// {print $3}' | sort -u |
    grep -Ev '/(libc|libm|libpthread|libdl|librt|ld-linux[^/]*|libstdc\+\+|libgcc_s|libnccl)\.so')
  for l in $libs; do cp -L "$l" "$stage/lib/"; done
  strip --strip-debug "$stage"/bin/* "$stage"/lib/* 2>/dev/null
  git describe --always --dirty --abbrev=12 >"$stage/commit" 2>/dev/null
  mkdir -p "$bundle_dir"
  tar -C "$stage" -cJf "$bundle" . || return 1
  rm -rf "$stage"
  echo "gpu_test pack: $bundle ($(du -h "$bundle" | cut -f1)): $(ls "$root/.gpu" | wc -l) file(s); carry .gpu to the GPU machine"
}

if [[ ${1:-} == pack ]]; then
  pack
  exit
fi

logs=${GPU_TEST_LOGS:-${OUT:-/tmp/gpu_test}}
mkdir -p "$logs"
log=$logs/gpu_test.log
figures=$logs/figures.txt
: >"$log"
: >"$figures"
exec > >(tee -a "$log") 2>&1

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
  echo "gpu_test: no GPU visible: ${why}."
  echo "gpu_test: nothing run. Without a GPU, 'bazel test //worker/collective/nccl/...' runs the NCCL backend's GPU-free tests."
  exit 2
fi

if [[ ! -f $bundle ]]; then
  echo "gpu_test: no bundle at $bundle: packing it here"
  pack || { echo "gpu_test: FAIL: no bundle, and packing failed"; exit 1; }
fi
work=$(mktemp -d)
cohortd_pid=""
cleanup() {
  [[ -n $cohortd_pid ]] && kill "$cohortd_pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
tar -C "$work" -xJf "$bundle" || { echo "gpu_test: FAIL: cannot unpack $bundle"; exit 1; }
bin=$work/bin

declare -a passed=() failed=() skipped=()
# step NAME LIMIT_SECONDS COMMAND...: runs it, records PASS/FAIL/SKIPPED
# (SKIPPED: it passed and printed "SKIPPED").
step() {
  local name=$1 limit=$2
  shift 2
  echo
  echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s)"
  local out=$work/step.out rc
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out"
  rc=${PIPESTATUS[0]}
  if ((rc == 124 || rc == 137)); then
    echo "=== $name: FAIL (still running after ${limit}s; killed)"
    failed+=("$name (timed out)")
  elif ((rc != 0)); then
    echo "=== $name: FAIL (exit $rc)"
    failed+=("$name")
  elif grep -q 'SKIPPED' "$out" && ! grep -q '\[  PASSED  \] [1-9]' "$out"; then
    echo "=== $name: SKIPPED"
    skipped+=("$name")
  else
    echo "=== $name: PASS"
    passed+=("$name")
  fi
}

echo "gpu_test: $(date -u +%FT%TZ), bundle of commit $(cat "$work/commit" 2>/dev/null || echo unknown)"
echo "=== env"
nvidia-smi -L | head -n "$gpus"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader
echo "kernel: $(uname -r); $(ldd --version | head -1)"
echo "libstdc++: $(ldconfig -p | awk '/libstdc\+\+\.so\.6 /{print $NF; exit}')"
# NCCL: LD_LIBRARY_PATH's, else the one beside this machine's PyTorch.
nccl_dir=""
IFS=: read -ra ld_dirs <<<"${LD_LIBRARY_PATH:-}"
for d in "${ld_dirs[@]}"; do [[ -n $d && -e $d/libnccl.so.2 ]] && nccl_dir=$d && break; done
if [[ -z $nccl_dir ]]; then
  for py in python3 /opt/torch/.venv/bin/python3; do
    site=$("$py" -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null) || continue
    for s in $site; do
      [[ -e $s/nvidia/nccl/lib/libnccl.so.2 ]] && nccl_dir=$s/nvidia/nccl/lib && break 2
    done
  done
fi
[[ -z $nccl_dir ]] && nccl_dir=$(dirname "$(ldconfig -p | awk '/libnccl\.so\.2 /{print $NF; exit}')" 2>/dev/null)
nccl_version=$(strings "$nccl_dir/libnccl.so.2" 2>/dev/null | grep -o 'NCCL version [0-9.+a-z]*' | head -1)
echo "NCCL: ${nccl_dir:-not found} (${nccl_version:-version unknown})"
export LD_LIBRARY_PATH=$work/lib${nccl_dir:+:$nccl_dir}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

missing=$(ldd "$bin"/* 2>&1 | grep 'not found' | sort -u)
if [[ -n $missing ]]; then
  echo "=== libs: FAIL: $missing"
  failed+=("libs")
else
  echo "=== libs: PASS (every binary finds every library)"
  passed+=("libs")
fi

export GTEST_COLOR=no
step nccl_types_test 60 "$bin/nccl_types_test"
step nccl_gpu_test 150 "$bin/nccl_gpu_test"
step nccl_device_test 150 env NCCL_DEBUG=${NCCL_DEBUG:-WARN} "$bin/nccl_device_test" --gtest_filter=-*Hangs*
step nccl_device_test:hang 60 "$bin/nccl_device_test" --gtest_filter=*Hangs*
step device_buffers_gpu_test 180 "$bin/device_buffers_gpu_test"

bench_out=$work/bench.out
step device_memory_bench 150 bash -o pipefail -c "'$bin/device_memory_bench' | tee '$bench_out'"
{ echo "# device_memory_bench ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1))"; cat "$bench_out"; echo; } >>"$figures"

# nccl_bench under cohortrun, against a cohortd of its own.
: >"$work/cohortd.log"
"$bin/cohortd" --listen=127.0.0.1:0 --tcpstore_listen=127.0.0.1:0 --engine=memory 2>"$work/cohortd.log" &
cohortd_pid=$!
addr="" tcpstore=""
for _ in $(seq 300); do
  addr=$(sed -n 's/.*serving cohort.v1.Store on \([^;]*\);.*/\1/p' "$work/cohortd.log")
  tcpstore=$(sed -n 's/.*TCPStore protocol on \([^ ;,]*\).*/\1/p' "$work/cohortd.log" | head -1)
  [[ -n $addr && -n $tcpstore ]] && break
  sleep 0.05
done
if [[ -z $addr || -z $tcpstore ]]; then
  echo "=== nccl_bench: FAIL: cohortd did not start:"
  cat "$work/cohortd.log"
  failed+=("nccl_bench (cohortd)")
else
  step nccl_bench 150 bash -o pipefail -c "'$bin/cohortrun' --coordinator='$addr' --tcpstore='$tcpstore' --run-id=nccl-bench \
    --nnodes=1:1 --nproc-per-node=$gpus -- '$bin/nccl_bench' --min_bytes=${MIN_BYTES:-8} \
    --max_bytes=${MAX_BYTES:-256M} --iters=${ITERS:-20} --warmup=${WARMUP:-5} | tee '$bench_out'"
  { echo "# nccl_bench, $gpus GPU(s)"; cat "$bench_out"; echo; } >>"$figures"
fi

echo
echo "=== torch_backend"
echo "SKIPPED: the torch backend \"cohort\" (worker/torch) is built for CPU tensors only; CUDA tensors wait for its torch 2.x build (issue 26)"
skipped+=("torch_backend (CPU-only build)")

echo
echo "gpu_test: summary: ${#passed[@]} passed, ${#failed[@]} failed, ${#skipped[@]} skipped"
for p in "${passed[@]}"; do echo "  PASS     $p"; done
for s in "${skipped[@]}"; do echo "  SKIPPED  $s"; done
for f in "${failed[@]}"; do echo "  FAIL     $f"; done
echo "gpu_test: log $log, figures $figures"
((${#failed[@]} == 0))
