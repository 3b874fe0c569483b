// The NCCL backend's element-wise kernels (cuda_kernels.cu, compiled by
// nvcc): what DDP and FSDP compute on device buffers through
// DeviceMemory (accumulation, f16/bf16 compression, optimizer steps). Each
// launcher enqueues on `stream` (a cudaStream_t on the current device) and
// returns the launch's cudaError_t as an int (0 is cudaSuccess), so that
// this header needs no CUDA header.
#ifndef COHORT_WORKER_COLLECTIVE_NCCL_CUDA_KERNELS_H_
#define COHORT_WORKER_COLLECTIVE_NCCL_CUDA_KERNELS_H_

#include <stddef.h>

#include "worker/collective/elementwise.h"

namespace cohort {
namespace cuda_kernels {

enum class FloatKind : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

// dst[i] += src[i].
int LaunchAddF32(float* dst, const float* src, size_t count, void* stream);
// dst[i] = src[i] * scale, widened to f32, scaled, narrowed to nearest even.
int LaunchConvert(void* dst, FloatKind dst_kind, const void* src,
                  FloatKind src_kind, size_t count, float scale, void* stream);
// ApplyUpdateAt (elementwise.h) for every element.
int LaunchUpdate(const ElementwiseUpdate& update, void* stream);

}  // namespace cuda_kernels
}  // namespace cohort

#endif  // COHORT_WORKER_COLLECTIVE_NCCL_CUDA_KERNELS_H_
