// CudaNcclApi: the NcclApi (nccl_api.h) over libnccl and libcudart, for the
// NCCL backend on a machine with a GPU. Built only where CUDA is installed
// (third_party/cuda.bzl); elsewhere the same function returns an NcclApi
// whose DeviceCount() says cohort was built without CUDA, so a caller gets
// FAILED_PRECONDITION rather than a link error.
#ifndef COHORT_WORKER_COLLECTIVE_NCCL_CUDA_NCCL_API_H_
#define COHORT_WORKER_COLLECTIVE_NCCL_CUDA_NCCL_API_H_

#include <memory>

#include "worker/collective/nccl/nccl_api.h"

namespace cohort {

// The process's NcclApi (stateless: every call may share it).
std::shared_ptr<NcclApi> CudaNcclApi();

}  // namespace cohort

#endif  // COHORT_WORKER_COLLECTIVE_NCCL_CUDA_NCCL_API_H_
