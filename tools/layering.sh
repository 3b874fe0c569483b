#!/usr/bin/env bash
# Proves that the build enforces cohort's layering (../shared/STYLE.md,
# docs/architecture.md): dependencies point one way,
#   server -> store -> base      client -> proto -> base
#   server -> proto              worker -> client
#   store -> proto (the c10d rules only)
# and inside server/: rpc, tcpstore, metrics and status over coordination
# and auth; http (the metrics port's server) under metrics and status,
# reaching no other room; coordination, store/, base/ and the data plane
# never reach gRPC.
# and inside worker/: checkpoint -> parallel -> collective, torch -> collective/init ->
# {gloo, nccl} -> collective; launch stands alone.
#
# 1. No library or binary reaches a room it must not, even through others
#    (bazel query; tests may cross rooms, so testonly targets are left out).
# 2. `bazel build` rejects a new arrow against the design: for each
#    forbidden arrow, a throwaway package in the source room names a target
#    of the room it must not use, and analysis must fail on visibility. One
#    allowed arrow is checked the same way, to show the probes themselves
#    are sound.
# Run by tools/test.sh before the tests; runs alone in ~1 minute.
set -euo pipefail
cd "$(dirname "$0")/.."

failures=0
fail() {
  echo "layering: FAIL: $*" >&2
  failures=$((failures + 1))
}

# Libraries and binaries of a room (a target pattern), tests left out.
production() {
  echo "(kind('cc_library|cc_binary', $1) except attr(testonly, 1, $1))"
}

no_path() {
  local from=$1 to=$2 path
  path=$(bazel query --noshow_progress --output=label \
    "somepath($(production "$from"), $to)" 2>/dev/null)
  if [[ -n $path ]]; then
    fail "$from reaches $to:"$'\n'"$path"
  else
    echo "layering: ok: nothing in $from reaches $to"
  fi
}

cohort_rooms=(//proto/... //store/... //server/... //client/... //worker/...)
for room in "${cohort_rooms[@]}"; do no_path //base/... "$room"; done
for room in //store/... //server/... //client/... //worker/...; do
  no_path //proto/... "$room"
done
for room in //server/... //client/... //worker/...; do
  no_path //store/... "$room"
done
for room in //client/... //worker/...; do no_path //server/... "$room"; done
for room in //server/... //store/... //worker/...; do
  no_path //client/... "$room"
done
for room in //server/... //store/...; do no_path //worker/... "$room"; done
for room in //worker/parallel/... //worker/launch/...; do
  no_path //worker/collective/... "$room"
done
for room in //worker/collective/... //worker/parallel/...; do
  no_path //worker/launch/... "$room"
done

# server/http carries /metrics and the status page and knows neither;
# the state machines reach neither; metrics and status stand apart.
for room in //server/coordination/... //server/auth/... //server/rpc/... \
  //server/tcpstore/... //server/metrics/... //server/status/...; do
  no_path //server/http/... "$room"
done
no_path //server/coordination/... //server/http/...
no_path //server/coordination/... //server/status/...
no_path //server/metrics/... //server/status/...
no_path //server/status/... //server/metrics/...

# worker/collective: the API and engine reach no backend and not the
# factory; the backends reach neither the factory (no package cycle) nor
# each other; DDP/FSDP reach no backend but through the factory.
for backend in //worker/collective/gloo/... //worker/collective/nccl/... \
  //worker/collective/init/...; do
  no_path //worker/collective:all "$backend"
done
for backend in //worker/collective/gloo/... //worker/collective/nccl/...; do
  no_path "$backend" //worker/collective/init/...
  no_path //worker/parallel:all "$backend"
done
no_path //worker/collective/gloo/... //worker/collective/nccl/...
no_path //worker/collective/nccl/... //worker/collective/gloo/...
# worker/collective/trace (timelines) reads flight recorders: it reaches no
# backend, not the factory and not client/ (cohortctl parses its files).
for room in //worker/collective/gloo/... //worker/collective/nccl/... \
  //worker/collective/init/... //client/...; do
  no_path //worker/collective/trace/... "$room"
done

# worker/checkpoint sits on parallel/ (the training state) and the client's
# catalog: nothing under it reaches it but the trainer, and it reaches no
# backend and not the launcher.
no_path //worker/collective/... //worker/checkpoint/...
no_path //worker/parallel:all //worker/checkpoint/...
for room in //worker/collective/gloo/... //worker/collective/nccl/... \
  //worker/collective/init/... //worker/launch/...; do
  no_path //worker/checkpoint/... "$room"
done

# gRPC stays in the rooms that speak it (server/rpc, server/auth,
# server/metrics, server/ha, cohortd's composition, client/, proto/): the
# storage engines, base/, the coordination state machines and the data
# plane (the collective engine, its backends, DDP/FSDP, the torch backend)
# never link it. Only what dials cohortd does, through client/: the
# launcher, and InitProcessGroup's cohort:// init method.
for room in //base/... //store/... //server/coordination/... \
  //worker/collective:all //worker/collective/gloo/... \
  //worker/collective/nccl/... //worker/parallel:all //worker/torch/...; do
  no_path "$room" //third_party:grpc
done

# Probe packages live only while this script runs.
probes=()
cleanup() { ((${#probes[@]})) && rm -rf "${probes[@]}"; return 0; }
trap cleanup EXIT

# probe ROOM_DIR TARGET ALLOWED(yes|no)
probe() {
  local dir=$1/layering_probe target=$2 allowed=$3 out
  probes+=("$dir")
  mkdir -p "$dir"
  cat >"$dir/BUILD" <<EOF
cc_library(
    name = "probe",
    deps = ["$target"],
)
EOF
  if out=$(bazel build --nobuild --noshow_progress "//$dir:probe" 2>&1); then
    [[ $allowed == yes ]] && echo "layering: ok: $1 may use $target" ||
      fail "the build lets $1 use $target"
  elif grep -q "is not visible from" <<<"$out"; then
    [[ $allowed == no ]] && echo "layering: ok: the build rejects $1 -> $target" ||
      fail "the build rejects $1 -> $target, an arrow of the design"
  else
    fail "probe $1 -> $target failed for another reason:"$'\n'"$out"
  fi
  rm -rf "$dir"
}

probe store //server/rpc:store_service no
probe store //client:store no
probe client //store:kv_store no
probe client //server/coordination:membership no
probe worker/collective //store:kv_store no
probe worker/parallel //server:cohort_server no
probe worker/collective //proto:store_cc_proto no
probe worker/collective //worker/parallel:ddp no
probe worker/launch //worker/collective:process_group no
probe base //client:store no
probe proto //store:kv_store no
probe server //client:remote_store no
probe server //store:kv_store yes
probe store //third_party:grpc no
probe base //third_party:grpc no
probe server/coordination //third_party:grpc no
probe server/coordination //server/rpc:coordination_slot no
probe server/tcpstore //server/rpc:store_service no
probe worker/collective //third_party:grpc no
probe worker/launch //third_party:grpc no
probe server/coordination //server/status:status_page no
probe server/metrics //server/status:status_page no
probe server/http //server/metrics:metrics no
probe server/status //server/http:http_server yes
probe server/coordination //third_party:civetweb no
probe server/rpc //third_party:grpc yes
probe server/rpc //server/coordination:membership yes
probe worker/torch //worker/collective/gloo:gloo_process_group no
probe worker/torch //worker/collective/nccl:nccl_process_group no
probe worker/torch //worker/collective/init:backend_factory yes
probe worker/collective //worker/collective/gloo:gloo_process_group no
probe worker/collective //worker/collective/nccl:nccl_backend no
probe worker/parallel //worker/collective/gloo:gloo_process_group no
probe worker/collective/init //worker/collective/gloo/shm:shm_group no
probe worker/launch //worker/collective/init no
probe tests //worker/collective/gloo:gloo_process_group no

if ((failures)); then
  echo "layering: $failures check(s) failed" >&2
  exit 1
fi
echo "layering: every check passed"
