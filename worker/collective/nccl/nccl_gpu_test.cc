// The NCCL backend against the real NCCL: one rank per visible GPU, as
// threads of this process (NCCL takes one rank per device in a
// communicator). On a machine without a GPU it checks the error a worker
// then gets and skips the rest, printing why (gtest's SKIPPED).
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/in_process_store.h"
#include "worker/collective/nccl/cuda_nccl_api.h"
#include "worker/collective/nccl/nccl_backend.h"

namespace cohort {
namespace {

using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

absl::StatusOr<int> Devices() { return CudaNcclApi()->DeviceCount(); }

#define SKIP_WITHOUT_GPU(devices)                                \
  if (!(devices).ok()) {                                         \
    GTEST_SKIP() << "SKIPPED: " << (devices).status().message(); \
  }

TEST(NcclGpu, WithoutAGpuCreateFailsWithAClearError) {
  absl::StatusOr<int> devices = Devices();
  if (devices.ok()) GTEST_SKIP() << *devices << " GPU(s) visible";
  std::printf("SKIPPED: the GPU tests: %s\n",
              std::string(devices.status().message()).c_str());
  EXPECT_EQ(devices.status().code(), absl::StatusCode::kFailedPrecondition);
  absl::Status created =
      CreateNcclProcessGroup(std::make_shared<InProcessStore>(), 0, 1).status();
  EXPECT_EQ(created.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(created.message(), HasSubstr("no CUDA device visible"));
}

// One rank per device, each with its group, running `fn`.
void OnEveryDevice(int n, const NcclOptions& options,
                   const std::function<void(NcclProcessGroup&)>& fn) {
  auto store = std::make_shared<InProcessStore>();
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      NcclOptions mine = options;
      mine.device = r;
      auto group = CreateNcclProcessGroup(store, r, n, mine);
      ASSERT_TRUE(group.ok()) << group.status();
      fn(**group);
    });
  }
  for (auto& t : threads) t.join();
}

// A device buffer holding `values`, freed at scope exit.
class DeviceFloats {
 public:
  DeviceFloats(NcclProcessGroup& g, const std::vector<float>& values)
      : g_(g), count_(values.size()) {
    data_ = *g.api().Alloc(g.device(), std::max<size_t>(count_, 1) * 4);
    EXPECT_TRUE(
        g.Copy(data_, values.data(), count_ * 4, CopyKind::kHostToDevice).ok());
  }
  ~DeviceFloats() { g_.api().Free(data_); }
  BufferView view() const { return BufferView{data_, count_, Dtype::kF32}; }
  std::vector<float> Read() const {
    std::vector<float> out(count_);
    EXPECT_TRUE(
        g_.Copy(out.data(), data_, count_ * 4, CopyKind::kDeviceToHost).ok());
    return out;
  }

 private:
  NcclProcessGroup& g_;
  size_t count_;
  void* data_;
};

TEST(NcclGpu, EveryCollectiveOnEveryDevice) {
  absl::StatusOr<int> devices = Devices();
  SKIP_WITHOUT_GPU(devices);
  const int n = *devices;
  NcclOptions options;
  options.group.timeout = absl::Seconds(60);
  OnEveryDevice(n, options, [n](NcclProcessGroup& g) {
    const int r = g.rank();
    DeviceFloats x(g, {float(r + 1), 1});
    ASSERT_TRUE(g.AllReduce(x.view(), ReduceOp::kSum)->Wait().ok());
    EXPECT_THAT(x.Read(), ElementsAreArray({float(n * (n + 1) / 2), float(n)}));
    ASSERT_TRUE(g.AllReduce(x.view(), ReduceOp::kAvg)->Wait().ok());
    EXPECT_THAT(x.Read(), ElementsAreArray({float(n * (n + 1) / 2), float(n)}));
    DeviceFloats b(g, {float(r)});
    ASSERT_TRUE(g.Broadcast(b.view(), n - 1)->Wait().ok());
    EXPECT_EQ(b.Read()[0], n - 1);
    DeviceFloats in(g, {float(r)}), out(g, std::vector<float>(n, -1));
    ASSERT_TRUE(g.AllGather(in.view(), out.view())->Wait().ok());
    std::vector<float> ranks(n);
    for (int i = 0; i < n; ++i) ranks[i] = i;
    EXPECT_THAT(out.Read(), ElementsAreArray(ranks));
    ASSERT_TRUE(g.Gather(in.view(), out.view(), 0)->Wait().ok());
    if (r == 0) {
      EXPECT_THAT(out.Read(), ElementsAreArray(ranks));
    }
    DeviceFloats all(g, ranks), one(g, {-1});
    ASSERT_TRUE(g.Scatter(all.view(), one.view(), 0)->Wait().ok());
    EXPECT_EQ(one.Read()[0], r);
    ASSERT_TRUE(
        g.ReduceScatter(all.view(), one.view(), ReduceOp::kSum)->Wait().ok());
    EXPECT_EQ(one.Read()[0], float(r * n));
    DeviceFloats a2a(g, std::vector<float>(n, float(r))),
        a2a_out(g, std::vector<float>(n, -1));
    ASSERT_TRUE(g.AllToAll(a2a.view(), a2a_out.view())->Wait().ok());
    EXPECT_THAT(a2a_out.Read(), ElementsAreArray(ranks));
    ASSERT_TRUE(g.Barrier()->Wait().ok());
    if (n > 1) {
      DeviceFloats mine(g, {float(r)}), theirs(g, {-1});
      auto sent = g.Send(mine.view(), (r + 1) % n, 0);
      auto got = g.Recv(theirs.view(), (r + n - 1) % n, 0);
      ASSERT_TRUE(sent->Wait().ok());
      ASSERT_TRUE(got->Wait().ok());
      EXPECT_EQ(theirs.Read()[0], (r + n - 1) % n);
    }
  });
}

TEST(NcclGpu, AHungPeerIsAbortedAtTheDeadline) {
  absl::StatusOr<int> devices = Devices();
  SKIP_WITHOUT_GPU(devices);
  if (*devices < 2)
    GTEST_SKIP() << "SKIPPED: needs 2 GPUs, " << *devices << " visible";
  NcclOptions options;
  options.group.timeout = absl::Seconds(5);
  options.group.verify_ops = false;
  OnEveryDevice(2, options, [](NcclProcessGroup& g) {
    if (g.rank() == 1) return;  // Never takes part.
    DeviceFloats x(g, {1});
    absl::Status status = g.AllReduce(x.view(), ReduceOp::kSum)->Wait();
    EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
    EXPECT_THAT(status.message(), HasSubstr("watchdog aborted"));
  });
}

}  // namespace
}  // namespace cohort
