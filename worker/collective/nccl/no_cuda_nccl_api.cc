// CudaNcclApi() where cohort was built without CUDA (third_party/cuda.bzl
// found none): every call fails with FAILED_PRECONDITION saying so, so a
// worker asking for the NCCL backend learns why instead of failing to link.
#include "absl/strings/str_cat.h"
#include "cuda_missing.h"  // COHORT_NO_CUDA_REASON, from third_party/cuda.bzl.
#include "worker/collective/nccl/cuda_nccl_api.h"

namespace cohort {
namespace {

absl::Status NoCuda() {
  return absl::FailedPreconditionError(absl::StrCat(
      "no CUDA device visible: cohort was built without CUDA (",
      COHORT_NO_CUDA_REASON, "); install CUDA and NCCL and rebuild"));
}

class NoCudaNcclApi final : public NcclApi {
 public:
  absl::StatusOr<int> DeviceCount() override { return NoCuda(); }
  absl::StatusOr<NcclUniqueId> GetUniqueId() override { return NoCuda(); }
  absl::StatusOr<std::unique_ptr<NcclCommunicator>> InitRank(
      int, int, int, absl::Span<const NcclUniqueId>) override {
    return NoCuda();
  }
  absl::StatusOr<std::unique_ptr<DeviceStream>> NewStream(int) override {
    return NoCuda();
  }
  absl::StatusOr<void*> Alloc(int, size_t) override { return NoCuda(); }
  void Free(void*) override {}
};

}  // namespace

std::shared_ptr<NcclApi> CudaNcclApi() {
  static auto* const api =
      new std::shared_ptr<NcclApi>(std::make_shared<NoCudaNcclApi>());
  return *api;
}

}  // namespace cohort
