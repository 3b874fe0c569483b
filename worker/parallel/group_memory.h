// Where DDP keeps its gradient buckets and FSDP its flat units: host memory
// on a host backend (Gloo, shared memory), the group's device memory on
// NCCL (ProcessGroup::device_memory()). Every allocation, copy and piece of
// arithmetic DDP and FSDP do on those buffers goes through a GroupMemory,
// so they are written once: on a device group each call is a
// cudaMemcpyAsync, a cudaMemsetAsync or a kernel on the group's stream, in
// order with its collectives, and no gradient or parameter is staged
// through the host.
//
//   GroupMemory memory(group->device_memory());
//   GroupBuffer bucket = memory.Allocate(n).value();   // zeroed
//   memory.Add(bucket.floats(), other.floats(), n);     // on the device
#ifndef COHORT_WORKER_PARALLEL_GROUP_MEMORY_H_
#define COHORT_WORKER_PARALLEL_GROUP_MEMORY_H_

#include <cstddef>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/collective/elementwise.h"
#include "worker/collective/process_group.h"

namespace cohort {

// An allocation in a GroupMemory, freed when destroyed. Move-only.
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
  GroupBuffer(DeviceMemory* device, void* data, size_t bytes)
      : device_(device), data_(data), bytes_(bytes) {}
  void Reset();

  DeviceMemory* device_ = nullptr;  // Null: host memory (calloc).
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// Not thread-safe beyond what the DeviceMemory is: one thread drives it,
// as one training loop drives a Reducer or an Fsdp. `device` (null for
// host memory) must outlive it and every buffer it allocates.
class GroupMemory {
 public:
  explicit GroupMemory(DeviceMemory* device) : device_(device) {}

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

 private:
  DeviceMemory* const device_;
};

}  // namespace cohort

#endif  // COHORT_WORKER_PARALLEL_GROUP_MEMORY_H_
