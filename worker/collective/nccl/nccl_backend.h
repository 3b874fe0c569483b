// CreateNcclProcessGroup: an NcclProcessGroup over CUDA's NCCL, what a
// worker calls (InitProcessGroup("nccl", ...) does). Without a GPU (or in a
// build without CUDA) it returns FAILED_PRECONDITION "no CUDA device
// visible: ..." with CUDA's own words.
#ifndef COHORT_WORKER_COLLECTIVE_NCCL_NCCL_BACKEND_H_
#define COHORT_WORKER_COLLECTIVE_NCCL_NCCL_BACKEND_H_

#include <memory>

#include "absl/status/statusor.h"
#include "client/store.h"
#include "worker/collective/nccl/nccl_process_group.h"

namespace cohort {

// NcclProcessGroup::Create with options.api defaulting to CudaNcclApi().
absl::StatusOr<std::unique_ptr<NcclProcessGroup>> CreateNcclProcessGroup(
    std::shared_ptr<Store> store, int rank, int size,
    const NcclOptions& options = {});

}  // namespace cohort

#endif  // COHORT_WORKER_COLLECTIVE_NCCL_NCCL_BACKEND_H_
