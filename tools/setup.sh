#!/usr/bin/env bash
# Installs the Debian packages cohort builds, tests and benchmarks with.
# Idempotent: packages already present are skipped, so a second run is quick.
set -euo pipefail

packages=(
  bazel-bootstrap
  g++
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler grpc-proto
  librocksdb-dev
  libabsl-dev
  libgloo-dev
  libuv1-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libeigen3-dev libopenblas-dev
)
# PyTorch 1.13 (run as /usr/bin/python3): the real TCPStore client, DDP and
# torchrun that the interop tests drive against cohortd, and the baselines
# the benchmarks compare with.
packages+=(python3-torch)
# libtorch's C++ headers and libraries, pybind11 and Python's headers: the
# torch.distributed backend "cohort" (worker/torch) is built against them.
packages+=(libtorch-dev pybind11-dev python3-dev)
# Only needed for tools/fuzz.sh (clang's libFuzzer) and tools/faults.sh;
# gcc's ASan, UBSan and TSan runtimes come with g++.
if [[ "${COHORT_WITH_FUZZ:-0}" == 1 ]]; then
  packages+=(clang libclang-rt-14-dev llvm)
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "setup: all ${#packages[@]} packages already installed"
  exit 0
fi

sudo_cmd=()
if [[ $(id -u) != 0 ]]; then sudo_cmd=(sudo); fi
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "setup: done"
