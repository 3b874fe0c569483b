#include "worker/parallel/group_memory.h"

#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/collective/reduce.h"

namespace cohort {

GroupBuffer::GroupBuffer(GroupBuffer&& other) noexcept
    : device_(other.device_), data_(other.data_), bytes_(other.bytes_) {
  other.data_ = nullptr;
  other.bytes_ = 0;
}

GroupBuffer& GroupBuffer::operator=(GroupBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    device_ = other.device_;
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
    if (device_ != nullptr) {
      device_->Free(data_);
    } else {
      std::free(data_);
    }
  }
  data_ = nullptr;
  bytes_ = 0;
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
  absl::StatusOr<void*> data = device_->Allocate(bytes);
  if (!data.ok()) return data.status();
  GroupBuffer buffer(device_, *data, bytes);
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
