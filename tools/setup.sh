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
  zlib1g-dev
)
# prometheus-cpp: cohortd's /metrics (--metrics_listen); prometheus brings
# promtool, which lints a live scrape in tests/interop/promtool_test.sh.
# civetweb: the HTTP server on that port (/metrics and the status page).
# OpenSSL: checking certificates at start and hashing tokens.
packages+=(prometheus-cpp-dev prometheus libcivetweb-dev libssl-dev openssl)
# chromium: the browser tests/interop/status_page_test.sh drives through
# playwright-core (npm, below) to look at cohortd's status page.
packages+=(chromium)
# PyTorch 1.13 (run as /usr/bin/python3): the real TCPStore client, DDP and
# torchrun that the interop tests drive against cohortd, and the baselines
# the benchmarks compare with.
packages+=(python3-torch)
# libtorch's C++ headers and libraries, pybind11 and Python's headers: the
# torch.distributed backend "cohort" (worker/torch) is built against them.
packages+=(libtorch-dev pybind11-dev python3-dev)
# venv for the project's PyTorch 2.x environment (.venv, below), made from
# Debian's python3 so that the 1.13 tests and the 2.x venv share one Python.
packages+=(python3-venv)
# python3-jsonschema: tests/testing/check_trace.py checks the timelines
# COHORT_TRACE writes against a JSON Schema of the Trace Event Format, with
# Debian's python3 (Perfetto's trace processor would download a binary; and
# a line more in tools/requirements.txt would remake the whole venv).
packages+=(python3-jsonschema)
# Only needed for tools/fuzz.sh (clang's libFuzzer) and tools/faults.sh;
# gcc's ASan, UBSan and TSan runtimes come with g++.
if [[ "${COHORT_WITH_FUZZ:-0}" == 1 ]]; then
  packages+=(clang libclang-rt-14-dev llvm)
fi
# npm installs buf (below), the third-party gRPC client the reflection test
# drives cohortd with: Debian's, unless the machine has an npm already.
command -v npm >/dev/null || packages+=(npm)
# go installs grpcurl (below): the machine's own Go, else Debian's.
command -v go >/dev/null || [[ -x /usr/local/go/bin/go ]] || packages+=(golang-go)
# kubectl (its built-in kustomize) renders deploy/k8s's overlays in
# //deploy:kustomize_test: Debian's, unless the machine has one already
# (both would own /usr/bin/kubectl).
command -v kubectl >/dev/null || packages+=(kubernetes-client)
# etcd (3.4): the engine under highly available cohortd replicas
# (--engine=etcd), and the 3-member clusters the HA tests start on loopback.
packages+=(etcd-server etcd-client)
# nftables and iproute2: tests/robustness/partition_test.sh cuts etcd members
# and cohortd replicas apart, each in a network namespace of its own joined
# by veth to a bridge, by dropping their packets (nft), and caps a link's
# bandwidth (tc); util-linux's unshare and nsenter make and enter them.
packages+=(nftables iproute2 util-linux)

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
# tests/interop/buf_curl_test.sh. Pinned, in a folder of its own that the
# test knows.
buf_version=1.75.0
if [[ "$("$tools/node_modules/.bin/buf" --version 2>/dev/null)" != "$buf_version" ]]; then
  echo "setup: installing buf $buf_version into $tools"
  "${sudo_cmd[@]}" mkdir -p "$tools"
  "${sudo_cmd[@]}" npm install --prefix "$tools" --no-audit --no-fund --silent \
    "@bufbuild/buf@$buf_version" >/dev/null
fi
# playwright-core (npm; it downloads no browser of its own): drives Debian's
# chromium in tests/interop/status_page_test.sh. Pinned, beside buf.
playwright_version=1.65.1
if [[ "$(node -p "require('$tools/node_modules/playwright-core/package.json').version" 2>/dev/null)" != "$playwright_version" ]]; then
  echo "setup: installing playwright-core $playwright_version into $tools"
  "${sudo_cmd[@]}" mkdir -p "$tools"
  "${sudo_cmd[@]}" npm install --prefix "$tools" --no-audit --no-fund --silent \
    "playwright-core@$playwright_version" >/dev/null
fi
# etcd's v3 API protos, from Debian's golang-etcd-server-dev and the two
# packages its protos import (file-level gogo options and HTTP
# annotations). Taken with apt-get download and dpkg -x rather than
# installed: the Go packages' 143 dependencies are not needed.
# //proto:etcd_api generates C++ from this folder.
etcd_protos=$tools/etcd-protos
etcd_files=(etcd/etcdserver/etcdserverpb/rpc.proto etcd/mvcc/mvccpb/kv.proto
            etcd/auth/authpb/auth.proto gogoproto/gogo.proto
            google/api/annotations.proto google/api/http.proto)
missing_protos=0
for f in "${etcd_files[@]}"; do [[ -f "$etcd_protos/$f" ]] || missing_protos=1; done
if ((missing_protos)); then
  echo "setup: extracting etcd's API protos into $etcd_protos"
  scratch=$(mktemp -d)
  (cd "$scratch" && chmod 777 . &&
    apt-get download golang-etcd-server-dev golang-github-gogo-protobuf-dev \
      golang-github-gogo-googleapis-dev >/dev/null 2>&1 ||
    { "${sudo_cmd[@]}" apt-get update -qq && apt-get download golang-etcd-server-dev \
        golang-github-gogo-protobuf-dev golang-github-gogo-googleapis-dev >/dev/null; })
  for deb in "$scratch"/*.deb; do dpkg -x "$deb" "$scratch/x"; done
  src=$scratch/x/usr/share/gocode/src
  "${sudo_cmd[@]}" mkdir -p "$etcd_protos"
  for f in "${etcd_files[@]}"; do
    case $f in
      etcd/*) from=$src/go.etcd.io/$f ;;
      gogoproto/*) from=$src/github.com/gogo/protobuf/$f ;;
      google/*) from=$src/github.com/gogo/googleapis/$f ;;
    esac
    "${sudo_cmd[@]}" install -D -m 644 "$from" "$etcd_protos/$f"
  done
  rm -rf "$scratch"
fi

# grpcurl, the gRPC command-line client cohort's design is inspected with
# (tests/interop/grpcurl_test.sh; docs/coordination.md), built by `go
# install` from the Go module proxy at a pinned version into $tools/bin.
grpcurl_version=v1.9.3
if [[ "$("$tools/bin/grpcurl" -version 2>&1)" != "grpcurl $grpcurl_version" ]]; then
  echo "setup: installing grpcurl $grpcurl_version into $tools/bin"
  go=$(command -v go || echo /usr/local/go/bin/go)
  "${sudo_cmd[@]}" mkdir -p "$tools/bin"
  "${sudo_cmd[@]}" env GOBIN="$tools/bin" GOFLAGS=-mod=mod GOTOOLCHAIN=local \
    "$go" install -ldflags "-X main.version=$grpcurl_version" \
    "github.com/fullstorydev/grpcurl/cmd/grpcurl@$grpcurl_version"
fi

# porcupine, the Go library under the linearizability checker
# tests/robustness/lincheck: the module (the version its go.mod requires,
# verified against its go.sum) downloaded into a module cache of its own,
# which the tests build from offline (tests/robustness/lincheck/build.sh).
lincheck_dir=$(dirname "$0")/../tests/robustness/lincheck
porcupine_version=$(awk '$1 == "require" && $2 == "github.com/anishathalye/porcupine" { print $3 }' \
  "$lincheck_dir/go.mod")
if [[ ! -f "$tools/gomod/cache/download/github.com/anishathalye/porcupine/@v/$porcupine_version.mod" ||
      ! -d "$tools/gomod/github.com/anishathalye/porcupine@$porcupine_version" ]]; then
  echo "setup: downloading porcupine $porcupine_version into $tools/gomod"
  go=$(command -v go || echo /usr/local/go/bin/go)
  "${sudo_cmd[@]}" mkdir -p "$tools/gomod"
  (cd "$lincheck_dir" && "${sudo_cmd[@]}" env GOMODCACHE="$tools/gomod" GOFLAGS=-mod=mod \
    GOTOOLCHAIN=local GOWORK=off "$go" mod download)
fi

# The project venv: PyTorch 2.x (pinned in tools/requirements.txt) and the
# CUDA toolkit wheels the NCCL backend builds with (third_party/cuda.bzl).
bash "$(dirname "$0")/venv.sh"
echo "setup: done"
