// The kernels behind cuda_kernels.h. Memory-bound loops: a grid-stride
// loop per kernel, 256 threads a block, enough blocks to fill the device
// without one per element for large buffers.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "worker/collective/nccl/cuda_kernels.h"

namespace cohort {
namespace cuda_kernels {
namespace {

constexpr int kThreads = 256;
constexpr size_t kMaxBlocks = 8192;

unsigned Blocks(size_t count) {
  size_t blocks = (count + kThreads - 1) / kThreads;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  return static_cast<unsigned>(blocks);
}

__device__ inline size_t First() {
  return static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ inline size_t Stride() {
  return static_cast<size_t>(gridDim.x) * blockDim.x;
}

__global__ void AddF32Kernel(float* dst, const float* src, size_t count) {
  for (size_t i = First(); i < count; i += Stride()) dst[i] += src[i];
}

__device__ inline float Load(const float* p, size_t i) { return p[i]; }
__device__ inline float Load(const __half* p, size_t i) {
  return __half2float(p[i]);
}
__device__ inline float Load(const __nv_bfloat16* p, size_t i) {
  return __bfloat162float(p[i]);
}
__device__ inline void Store(float* p, size_t i, float x) { p[i] = x; }
__device__ inline void Store(__half* p, size_t i, float x) {
  p[i] = __float2half_rn(x);
}
__device__ inline void Store(__nv_bfloat16* p, size_t i, float x) {
  p[i] = __float2bfloat16_rn(x);
}

template <typename Dst, typename Src>
__global__ void ConvertKernel(Dst* dst, const Src* src, size_t count,
                              float scale) {
  for (size_t i = First(); i < count; i += Stride()) {
    Store(dst, i, Load(src, i) * scale);
  }
}

__global__ void UpdateKernel(ElementwiseUpdate update) {
  for (size_t i = First(); i < update.count; i += Stride()) {
    ApplyUpdateAt(update, i);
  }
}

template <typename Dst, typename Src>
int Convert(void* dst, const void* src, size_t count, float scale,
            cudaStream_t stream) {
  ConvertKernel<Dst, Src><<<Blocks(count), kThreads, 0, stream>>>(
      static_cast<Dst*>(dst), static_cast<const Src*>(src), count, scale);
  return static_cast<int>(cudaGetLastError());
}

template <typename Dst>
int ConvertFrom(void* dst, const void* src, FloatKind src_kind, size_t count,
                float scale, cudaStream_t stream) {
  switch (src_kind) {
    case FloatKind::kF32:
      return Convert<Dst, float>(dst, src, count, scale, stream);
    case FloatKind::kF16:
      return Convert<Dst, __half>(dst, src, count, scale, stream);
    case FloatKind::kBF16:
      return Convert<Dst, __nv_bfloat16>(dst, src, count, scale, stream);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace

int LaunchAddF32(float* dst, const float* src, size_t count, void* stream) {
  if (count == 0) return 0;
  AddF32Kernel<<<Blocks(count), kThreads, 0,
                 static_cast<cudaStream_t>(stream)>>>(dst, src, count);
  return static_cast<int>(cudaGetLastError());
}

int LaunchConvert(void* dst, FloatKind dst_kind, const void* src,
                  FloatKind src_kind, size_t count, float scale, void* stream) {
  if (count == 0) return 0;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dst_kind) {
    case FloatKind::kF32:
      return ConvertFrom<float>(dst, src, src_kind, count, scale, s);
    case FloatKind::kF16:
      return ConvertFrom<__half>(dst, src, src_kind, count, scale, s);
    case FloatKind::kBF16:
      return ConvertFrom<__nv_bfloat16>(dst, src, src_kind, count, scale, s);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

int LaunchUpdate(const ElementwiseUpdate& update, void* stream) {
  if (update.count == 0) return 0;
  UpdateKernel<<<Blocks(update.count), kThreads, 0,
                 static_cast<cudaStream_t>(stream)>>>(update);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace cuda_kernels
}  // namespace cohort
