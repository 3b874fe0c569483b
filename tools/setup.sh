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
# prometheus-cpp: cohortd's /metrics (--metrics_listen); prometheus brings
# promtool, which lints a live scrape in tests/promtool_test.sh. OpenSSL:
# checking certificates at start and hashing tokens.
packages+=(prometheus-cpp-dev prometheus libssl-dev openssl)
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
# npm installs buf (below), the third-party gRPC client the reflection test
# drives cohortd with: Debian's, unless the machine has an npm already.
command -v npm >/dev/null || packages+=(npm)
# kubectl (its built-in kustomize) renders deploy/k8s's overlays in
# //deploy:kustomize_test: Debian's, unless the machine has one already
# (both would own /usr/bin/kubectl).
command -v kubectl >/dev/null || packages+=(kubernetes-client)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

sudo_cmd=()
if [[ $(id -u) != 0 ]]; then sudo_cmd=(sudo); fi
if ((${#missing[@]} == 0)); then
  echo "setup: all ${#packages[@]} packages already installed"
else
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

tools=/usr/local/lib/cohort-tools
# kubernetes-models and yaml (npm): deploy/validate.js checks every rendered
# kustomize overlay against Kubernetes' schemas, offline.
models_version=5.1.0
if [[ ! -f "$tools/node_modules/kubernetes-models/package.json" ]] ||
   ! grep -q "\"version\": \"$models_version\"" "$tools/node_modules/kubernetes-models/package.json"; then
  echo "setup: installing kubernetes-models $models_version into $tools"
  "${sudo_cmd[@]}" mkdir -p "$tools"
  "${sudo_cmd[@]}" npm install --prefix "$tools" --no-audit --no-fund --silent \
    "kubernetes-models@$models_version" "@kubernetes-models/validate@5.0.2" "yaml@2.9.1" >/dev/null
fi

# buf (npm's @bufbuild/buf, whose package carries its prebuilt binary):
# `buf curl` calls cohortd through server reflection in
# tests/buf_curl_test.sh. Pinned, in a folder of its own that the test knows.
buf_version=1.75.0
if [[ "$("$tools/node_modules/.bin/buf" --version 2>/dev/null)" != "$buf_version" ]]; then
  echo "setup: installing buf $buf_version into $tools"
  "${sudo_cmd[@]}" mkdir -p "$tools"
  "${sudo_cmd[@]}" npm install --prefix "$tools" --no-audit --no-fund --silent \
    "@bufbuild/buf@$buf_version" >/dev/null
fi
echo "setup: done"
