// The backend factory: the one place that names the backends. It creates a
// backend's group over a store the caller already has, as the torch
// backend does with torch's store; InitProcessGroup (init.h) first resolves
// an init method to that store. Nothing in the API or the engine
// (worker/collective) depends on it, and the backends do not either.
//
//   InitOptions options;
//   options.group.timeout = absl::Seconds(60);  // every backend's
//   options.gloo.interface = "eth0";            // Gloo's own
//   options.gloo.shm.enabled = false;           // Gloo's shared memory
//   auto pg = cohort::CreateProcessGroup("gloo", store, rank, size, options);
#ifndef COHORT_WORKER_COLLECTIVE_INIT_BACKEND_FACTORY_H_
#define COHORT_WORKER_COLLECTIVE_INIT_BACKEND_FACTORY_H_

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/store.h"
#include "worker/collective/gloo/gloo_process_group.h"
#include "worker/collective/nccl/nccl_process_group.h"
#include "worker/collective/process_group.h"

namespace cohort {

struct InitOptions {
  // Every backend's: the timeout (which also bounds reaching the store in
  // InitProcessGroup), threads and verify_ops. The group is created with
  // these: `gloo.group` and `nccl.group` are not read.
  ProcessGroupOptions group;
  // The options of the backend named, each documented beside its backend
  // (the other backend's are not read):
  //  - gloo: where a rank listens (bind_address, interface) and shared
  //    memory among the ranks of one host (gloo.shm: enabled, host_id,
  //    slot_bytes);
  //  - nccl: the device, the bootstrap's roots, the watchdog and its
  //    error_reporter (InitProcessGroup's default: NodeErrorReporterFromEnv).
  // store_prefix: where the group's keys live in the store; InitProcessGroup
  // replaces it with keys fresh to each creation.
  GlooOptions gloo;
  NcclOptions nccl;
};

// OK when this build has `backend` ("gloo", "nccl"); INVALID_ARGUMENT
// naming the ones it has otherwise.
absl::Status CheckBackend(absl::string_view backend);

// Creates rank `rank` of `size` of `backend` over `store`, under the
// backend's store_prefix in `options`, and connects it to the other ranks,
// which call it with the same backend, store and prefix: "gloo" (host
// buffers, gloo/gloo_process_group.h) or "nccl" (device buffers,
// nccl/nccl_process_group.h; FAILED_PRECONDITION "no CUDA device visible:
// ..." without a GPU). Blocks until every rank has arrived or
// options.group.timeout passes (DEADLINE_EXCEEDED naming the missing
// ranks' keys). INVALID_ARGUMENT for an unknown backend, a rank outside
// [0, size) or bad options.
absl::StatusOr<std::unique_ptr<ProcessGroup>> CreateProcessGroup(
    absl::string_view backend, std::shared_ptr<Store> store, int rank, int size,
    const InitOptions& options = {});

}  // namespace cohort

#endif  // COHORT_WORKER_COLLECTIVE_INIT_BACKEND_FACTORY_H_
