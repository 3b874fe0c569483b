#include "worker/parallel/group_memory.h"

#include <algorithm>
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
  for (Dtype dtype : {dst.dtype, src.dtype}) {
    if (dtype != Dtype::kF32 && dtype != Dtype::kF16 && dtype != Dtype::kBF16) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Convert: ", DtypeName(dtype), " is not f32, f16 or bf16"));
    }
  }
  if (dst.count != src.count) {
    return absl::InvalidArgumentError(
        absl::StrCat("Convert: ", src.count, " elements into ", dst.count));
  }
  // In blocks, so that no bucket-sized f32 temporary is needed.
  constexpr size_t kBlock = 1024;
  float block[kBlock];
  const size_t in = DtypeSize(src.dtype);
  const size_t out = DtypeSize(dst.dtype);
  for (size_t start = 0; start < dst.count; start += kBlock) {
    const size_t n = std::min(kBlock, dst.count - start);
    const char* from = static_cast<const char*>(src.data) + start * in;
    char* to = static_cast<char*>(dst.data) + start * out;
    if (src.dtype == Dtype::kF32) {
      std::memcpy(block, from, n * sizeof(float));
    } else {
      WidenToF32(src.dtype, from, block, n);
    }
    for (size_t i = 0; i < n; ++i) block[i] *= scale;
    if (dst.dtype == Dtype::kF32) {
      std::memcpy(to, block, n * sizeof(float));
    } else {
      NarrowFromF32(dst.dtype, block, to, n);
    }
  }
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
