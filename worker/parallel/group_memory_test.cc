#include "worker/parallel/group_memory.h"

#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cohort {
namespace {

using ::testing::ElementsAre;

// "Device" memory on the host that counts what is allocated and refuses
// allocations beyond `limit` bytes in use, as a full GPU does.
class CountingDevice : public DeviceMemory {
 public:
  explicit CountingDevice(size_t limit = SIZE_MAX) : limit_(limit) {}
  ~CountingDevice() override { EXPECT_TRUE(live_.empty()); }

  absl::StatusOr<void*> Allocate(size_t bytes) override {
    if (in_use_ + bytes > limit_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("out of device memory allocating ", bytes, " bytes"));
    }
    void* data = std::malloc(bytes);
    std::memset(data, 0xAB, bytes);  // Not zeroed, as cudaMalloc.
    live_[data] = bytes;
    in_use_ += bytes;
    ++allocations;
    return data;
  }
  void Free(void* data) override {
    in_use_ -= live_.at(data);
    live_.erase(data);
    std::free(data);
    ++frees;
  }
  absl::Status CopyToDevice(void* dst, const void* src, size_t n) override {
    std::memcpy(dst, src, n);
    return absl::OkStatus();
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t n) override {
    std::memcpy(dst, src, n);
    return absl::OkStatus();
  }
  absl::Status CopyOnDevice(void* dst, const void* src, size_t n) override {
    std::memcpy(dst, src, n);
    return absl::OkStatus();
  }
  absl::Status Zero(void* data, size_t n) override {
    std::memset(data, 0, n);
    return absl::OkStatus();
  }
  absl::Status AddF32(float*, const float*, size_t) override {
    return absl::UnimplementedError("not here");
  }
  absl::Status Convert(BufferView, BufferView, float) override {
    return absl::UnimplementedError("not here");
  }
  absl::Status Update(const ElementwiseUpdate&) override {
    return absl::UnimplementedError("not here");
  }

  int allocations = 0;
  int frees = 0;

 private:
  const size_t limit_;
  size_t in_use_ = 0;
  std::map<void*, size_t> live_;
};

TEST(GroupMemory, HostBuffersAreZeroedAndTheArithmeticIsTheHosts) {
  GroupMemory memory(nullptr);
  EXPECT_FALSE(memory.on_device());
  GroupBuffer a = *memory.AllocateFloats(4);
  GroupBuffer b = *memory.AllocateFloats(4);
  EXPECT_EQ(a.bytes(), 16u);
  EXPECT_THAT(std::vector<float>(a.floats(), a.floats() + 4),
              ElementsAre(0, 0, 0, 0));
  const float values[4] = {1, 2, 3, 4};
  ASSERT_TRUE(memory.FromHost(a.data(), values, sizeof(values)).ok());
  ASSERT_TRUE(memory.Copy(b.data(), a.data(), 16).ok());
  ASSERT_TRUE(memory.Add(a.floats(), b.floats(), 4).ok());
  float out[4];
  ASSERT_TRUE(memory.ToHost(out, a.data(), 16).ok());
  EXPECT_THAT(out, ElementsAre(2, 4, 6, 8));

  GroupBuffer half = *memory.Allocate(8);
  ASSERT_TRUE(
      memory.Convert(BufferView{half.data(), 4, Dtype::kBF16}, a.view(), 0.5f)
          .ok());
  ASSERT_TRUE(
      memory.Convert(b.view(), BufferView{half.data(), 4, Dtype::kBF16}, 1.0f)
          .ok());
  EXPECT_THAT(std::vector<float>(b.floats(), b.floats() + 4),
              ElementsAre(1, 2, 3, 4));
  EXPECT_EQ(
      memory.Convert(b.view(), BufferView{half.data(), 4, Dtype::kI32}, 1.0f)
          .code(),
      absl::StatusCode::kInvalidArgument);

  ElementwiseUpdate sgd;
  sgd.params = a.floats();
  sgd.grads = b.floats();
  sgd.count = 4;
  sgd.lr = 1.0f;
  ASSERT_TRUE(memory.Update(sgd).ok());
  EXPECT_THAT(std::vector<float>(a.floats(), a.floats() + 4),
              ElementsAre(1, 2, 3, 4));
  ASSERT_TRUE(memory.Zero(a.data(), 16).ok());
  EXPECT_THAT(std::vector<float>(a.floats(), a.floats() + 4),
              ElementsAre(0, 0, 0, 0));
  EXPECT_EQ(memory.Allocate(0)->data(), nullptr);
}

TEST(GroupMemory, DeviceBuffersAreZeroedAndReusedBySize) {
  CountingDevice device;
  {
    GroupMemory memory(&device);
    EXPECT_TRUE(memory.on_device());
    std::set<void*> seen;
    for (int step = 0; step < 5; ++step) {
      GroupBuffer big = *memory.Allocate(64);
      GroupBuffer small = *memory.Allocate(16);
      GroupBuffer small2 = *memory.Allocate(16);
      for (const GroupBuffer* b : {&big, &small, &small2}) {
        seen.insert(b->data());
        for (size_t i = 0; i < b->bytes(); ++i) {
          ASSERT_EQ(static_cast<const char*>(b->data())[i], 0);
        }
      }
      std::memset(big.data(), 7, 64);  // Dirty it for the next step.
    }
    // The first step's three allocations serve all five steps.
    EXPECT_EQ(device.allocations, 3);
    EXPECT_EQ(memory.device_allocations(), 3u);
    EXPECT_EQ(seen.size(), 3u);
    EXPECT_EQ(memory.cached_bytes(), 64u + 16 + 16);
    EXPECT_EQ(device.frees, 0);
  }
  // The GroupMemory gave everything back when it went.
  EXPECT_EQ(device.frees, 3);
}

TEST(GroupMemory, ABufferMayOutliveItsGroupMemory) {
  CountingDevice device;
  GroupBuffer kept;
  {
    GroupMemory memory(&device);
    kept = *memory.Allocate(32);
    GroupBuffer cached = *memory.Allocate(8);
  }
  EXPECT_EQ(device.frees, 0);  // The pool lives while a buffer does.
  kept = GroupBuffer();
  EXPECT_EQ(device.frees, 2);
}

TEST(GroupMemory, ARefusedAllocationEmptiesTheCacheAndRetries) {
  CountingDevice device(/*limit=*/100);
  GroupMemory memory(&device);
  { GroupBuffer cached = *memory.Allocate(60); }
  EXPECT_EQ(memory.cached_bytes(), 60u);
  // 60 cached + 80 would pass the limit: the cache goes, then it fits.
  absl::StatusOr<GroupBuffer> other = memory.Allocate(80);
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(memory.cached_bytes(), 0u);
  EXPECT_EQ(device.frees, 1);
  // Beyond the device: its error, as the device said it.
  absl::StatusOr<GroupBuffer> too_big = memory.Allocate(200);
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(too_big.status().message(),
              ::testing::HasSubstr("out of device memory"));
}

}  // namespace
}  // namespace cohort
