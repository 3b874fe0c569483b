#include "worker/collective/nccl/nccl_backend.h"

#include <utility>

#include "worker/collective/nccl/cuda_nccl_api.h"

namespace cohort {

absl::StatusOr<std::unique_ptr<NcclProcessGroup>> CreateNcclProcessGroup(
    std::shared_ptr<Store> store, int rank, int size,
    const NcclOptions& options) {
  NcclOptions with_api = options;
  if (with_api.api == nullptr) with_api.api = CudaNcclApi();
  return NcclProcessGroup::Create(std::move(store), rank, size, with_api);
}

}  // namespace cohort
