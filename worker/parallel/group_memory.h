// Where DDP keeps its gradient buckets and FSDP its flat units: host memory
// on a host backend (Gloo, shared memory), the group's device memory on
// NCCL (ProcessGroup::device_memory()). Every allocation, copy and piece of
// arithmetic DDP and FSDP do on those buffers goes through a GroupMemory,
// so they are written once: on a device group each call is a
// cudaMemcpyAsync, a cudaMemsetAsync or a kernel on a stream of the group's
// device (not behind its collectives in flight: DeviceMemory's contract),
// and no gradient or parameter is staged through the host.
//
//   GroupMemory memory(group->device_memory());
//   GroupBuffer bucket = memory.Allocate(n).value();   // zeroed
//   memory.Add(bucket.floats(), other.floats(), n);     // on the device
//
// Device memory is cached, as torch's CUDA allocator does: a freed buffer
// goes back to its GroupMemory's pool and serves the next allocation of the
// same size (FSDP gathers and frees the same unit sizes every step), so a
// steady-state training step calls no cudaMalloc or cudaFree, both of which
// stall the device. An allocation the device refuses frees the cache and
// tries once more.
#ifndef COHORT_WORKER_PARALLEL_GROUP_MEMORY_H_
#define COHORT_WORKER_PARALLEL_GROUP_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/collective/elementwise.h"
#include "worker/collective/process_group.h"

namespace cohort {

class DevicePool;

// An allocation in a GroupMemory, freed (or returned to the pool) when
// destroyed. Move-only.
class GroupBuffer {
 public:
  GroupBuffer() = default;
  GroupBuffer(GroupBuffer&& other) noexcept;
  GroupBuffer& operator=(GroupBuffer&& other) noexcept;
  GroupBuffer(const GroupBuffer&) = delete;
  GroupBuffer& operator=(const GroupBuffer&) = delete;
  ~GroupBuffer();

  void* data() const { return data_; }
  float* floats() const { return static_cast<float*>(data_); }
  size_t bytes() const { return bytes_; }
  // Whole f32 elements.
  size_t elements() const { return bytes_ / sizeof(float); }
  // The buffer as f32, or as `count` elements of `dtype`.
  BufferView view() const { return BufferView::Of(floats(), elements()); }

 private:
  friend class GroupMemory;
  GroupBuffer(std::shared_ptr<DevicePool> pool, void* data, size_t bytes)
      : pool_(std::move(pool)), data_(data), bytes_(bytes) {}
  void Reset();

  std::shared_ptr<DevicePool> pool_;  // Null: host memory (calloc).
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// Not thread-safe beyond what the DeviceMemory is: one thread drives it,
// as one training loop drives a Reducer or an Fsdp. `device` (null for
// host memory) must outlive it and every buffer it allocates.
class GroupMemory {
 public:
  explicit GroupMemory(DeviceMemory* device);
  ~GroupMemory();
  GroupMemory(const GroupMemory&) = delete;
  GroupMemory& operator=(const GroupMemory&) = delete;

  bool on_device() const { return device_ != nullptr; }
  DeviceMemory* device() const { return device_; }

  // `bytes` of zeroed memory. RESOURCE_EXHAUSTED (or the device's error)
  // when it cannot be had.
  absl::StatusOr<GroupBuffer> Allocate(size_t bytes);
  absl::StatusOr<GroupBuffer> AllocateFloats(size_t elements) {
    return Allocate(elements * sizeof(float));
  }

  // All within this memory.
  absl::Status Zero(void* data, size_t bytes);
  absl::Status Copy(void* dst, const void* src, size_t bytes);
  // dst[i] += src[i].
  absl::Status Add(float* dst, const float* src, size_t count);
  // dst[i] = src[i] * scale between f32, f16 and bf16.
  absl::Status Convert(BufferView dst, BufferView src, float scale);
  absl::Status Update(const ElementwiseUpdate& update);

  // Between this memory and the host (for values the caller hands over on
  // the host, such as LoadFromRank0's).
  absl::Status FromHost(void* dst, const void* host, size_t bytes);
  absl::Status ToHost(void* host, const void* src, size_t bytes);

  // The device pool: bytes held for reuse, and the device allocations
  // made so far (0 and 0 for host memory).
  size_t cached_bytes() const;
  uint64_t device_allocations() const;

 private:
  DeviceMemory* const device_;
  const std::shared_ptr<DevicePool> pool_;  // Null for host memory.
};

}  // namespace cohort

#endif  // COHORT_WORKER_PARALLEL_GROUP_MEMORY_H_
