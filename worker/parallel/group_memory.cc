#include "worker/parallel/group_memory.h"

#include <cstdlib>
#include <cstring>
#include <map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "worker/collective/reduce.h"

namespace cohort {

// Freed device buffers by exact size, for the next allocation of that size.
// Shared by a GroupMemory and its live buffers, so that a buffer may
// outlive the GroupMemory (not the device memory). Thread-safe.
class DevicePool {
 public:
  explicit DevicePool(DeviceMemory* device) : device_(device) {}
  ~DevicePool() { Trim(); }

  absl::StatusOr<void*> Take(size_t bytes) {
    {
      absl::MutexLock lock(&mu_);
      auto it = cached_.find(bytes);
      if (it != cached_.end() && !it->second.empty()) {
        void* data = it->second.back();
        it->second.pop_back();
        cached_bytes_ -= bytes;
        return data;
      }
      ++allocations_;
    }
    absl::StatusOr<void*> data = device_->Allocate(bytes);
    if (data.ok() || cached_bytes() == 0) return data;
    // Out of device memory, perhaps because of what is cached here.
    Trim();
    return device_->Allocate(bytes);
  }

  void Return(void* data, size_t bytes) {
    absl::MutexLock lock(&mu_);
    cached_[bytes].push_back(data);
    cached_bytes_ += bytes;
  }

  void Trim() {
    std::map<size_t, std::vector<void*>> cached;
    {
      absl::MutexLock lock(&mu_);
      cached.swap(cached_);
      cached_bytes_ = 0;
    }
    for (const auto& [bytes, buffers] : cached) {
      for (void* data : buffers) device_->Free(data);
    }
  }

  size_t cached_bytes() const {
    absl::MutexLock lock(&mu_);
    return cached_bytes_;
  }
  uint64_t allocations() const {
    absl::MutexLock lock(&mu_);
    return allocations_;
  }

 private:
  DeviceMemory* const device_;
  mutable absl::Mutex mu_;
  std::map<size_t, std::vector<void*>> cached_ ABSL_GUARDED_BY(mu_);
  size_t cached_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t allocations_ ABSL_GUARDED_BY(mu_) = 0;
};

GroupBuffer::GroupBuffer(GroupBuffer&& other) noexcept
    : pool_(std::move(other.pool_)), data_(other.data_), bytes_(other.bytes_) {
  other.data_ = nullptr;
  other.bytes_ = 0;
}

GroupBuffer& GroupBuffer::operator=(GroupBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    pool_ = std::move(other.pool_);
    data_ = other.data_;
    bytes_ = other.bytes_;
    other.data_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

GroupBuffer::~GroupBuffer() { Reset(); }

void GroupBuffer::Reset() {
  if (data_ != nullptr) {
    if (pool_ != nullptr) {
      pool_->Return(data_, bytes_);
    } else {
      std::free(data_);
    }
  }
  pool_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

GroupMemory::GroupMemory(DeviceMemory* device)
    : device_(device),
      pool_(device != nullptr ? std::make_shared<DevicePool>(device)
                              : nullptr) {}

GroupMemory::~GroupMemory() = default;

size_t GroupMemory::cached_bytes() const {
  return pool_ != nullptr ? pool_->cached_bytes() : 0;
}

uint64_t GroupMemory::device_allocations() const {
  return pool_ != nullptr ? pool_->allocations() : 0;
}

absl::StatusOr<GroupBuffer> GroupMemory::Allocate(size_t bytes) {
  if (bytes == 0) return GroupBuffer();
  if (device_ == nullptr) {
    void* data = std::calloc(bytes, 1);
    if (data == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("out of host memory allocating ", bytes, " bytes"));
    }
    return GroupBuffer(nullptr, data, bytes);
  }
  absl::StatusOr<void*> data = pool_->Take(bytes);
  if (!data.ok()) return data.status();
  GroupBuffer buffer(pool_, *data, bytes);
  if (absl::Status zeroed = device_->Zero(*data, bytes); !zeroed.ok()) {
    return zeroed;
  }
  return buffer;
}

absl::Status GroupMemory::Zero(void* data, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (device_ != nullptr) return device_->Zero(data, bytes);
  std::memset(data, 0, bytes);
  return absl::OkStatus();
}

absl::Status GroupMemory::Copy(void* dst, const void* src, size_t bytes) {
  if (bytes == 0 || dst == src) return absl::OkStatus();
  if (device_ != nullptr) return device_->CopyOnDevice(dst, src, bytes);
  std::memmove(dst, src, bytes);
  return absl::OkStatus();
}

absl::Status GroupMemory::Add(float* dst, const float* src, size_t count) {
  if (count == 0) return absl::OkStatus();
  if (device_ != nullptr) return device_->AddF32(dst, src, count);
  for (size_t i = 0; i < count; ++i) dst[i] += src[i];
  return absl::OkStatus();
}

absl::Status GroupMemory::Convert(BufferView dst, BufferView src, float scale) {
  if (device_ != nullptr) return device_->Convert(dst, src, scale);
  if (absl::Status s =
          CheckFloatConversion(dst.dtype, dst.count, src.dtype, src.count);
      !s.ok()) {
    return s;
  }
  ConvertFloats(dst.dtype, dst.data, src.dtype, src.data, dst.count, scale);
  return absl::OkStatus();
}

absl::Status GroupMemory::Update(const ElementwiseUpdate& update) {
  if (device_ != nullptr) return device_->Update(update);
  ApplyUpdateOnHost(update);
  return absl::OkStatus();
}

absl::Status GroupMemory::FromHost(void* dst, const void* host, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (device_ != nullptr) return device_->CopyToDevice(dst, host, bytes);
  std::memmove(dst, host, bytes);
  return absl::OkStatus();
}

absl::Status GroupMemory::ToHost(void* host, const void* src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (device_ != nullptr) return device_->CopyToHost(host, src, bytes);
  std::memmove(host, src, bytes);
  return absl::OkStatus();
}

}  // namespace cohort
