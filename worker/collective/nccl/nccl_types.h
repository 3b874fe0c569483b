// How cohort's dtypes, reduce ops and NCCL's result codes map onto NCCL's
// (nccl.h): one place, used by cuda_nccl_api.cc and tested without a GPU
// by nccl_types_test.
#ifndef COHORT_WORKER_COLLECTIVE_NCCL_NCCL_TYPES_H_
#define COHORT_WORKER_COLLECTIVE_NCCL_NCCL_TYPES_H_

#include <nccl.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "worker/collective/dtype.h"

namespace cohort {

// ncclFloat32, ncclBfloat16, ... INVALID_ARGUMENT naming the dtype for
// one NCCL has no type for.
absl::StatusOr<ncclDataType_t> ToNcclDataType(Dtype dtype);

// ncclSum ... ncclAvg (NCCL averages on the device, in the dtype's own
// precision). INVALID_ARGUMENT naming the op for one NCCL lacks.
absl::StatusOr<ncclRedOp_t> ToNcclRedOp(ReduceOp op);

// OK for ncclSuccess and ncclInProgress (a nonblocking call under way);
// otherwise a status saying `what` failed with NCCL's text for `result`
// and, given a communicator, its last error. UNAVAILABLE for a remote or
// system error (a peer or the network failed), INTERNAL for the others
// (cohort checked the arguments before calling).
absl::Status FromNcclResult(ncclResult_t result, absl::string_view what,
                            ncclComm_t comm = nullptr);

}  // namespace cohort

#endif  // COHORT_WORKER_COLLECTIVE_NCCL_NCCL_TYPES_H_
