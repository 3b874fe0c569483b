// DDP and FSDP on real device buffers: an NcclProcessGroup over CUDA's NCCL,
// one rank per visible GPU (threads of this process). The test writes the
// gradients with host-to-device copies, standing in for a backward's
// kernels, and reads the results back the same way. Without a GPU every
// case is SKIPPED with the reason (device_buffers_test covers the same
// paths over the fake NCCL everywhere).
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tests/in_process_store.h"
#include "worker/collective/nccl/cuda_nccl_api.h"
#include "worker/collective/nccl/nccl_backend.h"
#include "worker/parallel/ddp.h"
#include "worker/parallel/fsdp.h"
#include "worker/parallel/optimizer.h"

namespace cohort {
namespace {

void OnEveryDevice(
    int n, const std::function<void(std::shared_ptr<NcclProcessGroup>)>& fn) {
  auto store = std::make_shared<InProcessStore>();
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      NcclOptions options;
      options.device = r;
      options.group.timeout = absl::Seconds(60);
      auto group = CreateNcclProcessGroup(store, r, n, options);
      ASSERT_TRUE(group.ok()) << group.status();
      fn(std::shared_ptr<NcclProcessGroup>(std::move(*group)));
    });
  }
  for (auto& t : threads) t.join();
}

#define DEVICES_OR_SKIP(n)                                     \
  absl::StatusOr<int> devices = CudaNcclApi()->DeviceCount();  \
  if (!devices.ok()) {                                         \
    GTEST_SKIP() << "SKIPPED: " << devices.status().message(); \
  }                                                            \
  const int n = *devices

TEST(DeviceBuffersGpu, DdpAveragesGradientsInDeviceMemory) {
  DEVICES_OR_SKIP(n);
  OnEveryDevice(n, [n](std::shared_ptr<NcclProcessGroup> g) {
    const std::vector<size_t> sizes = {1000, 3, 300000};
    ReducerOptions options;
    options.first_bucket_bytes = 4096;
    auto reducer = Reducer::Create(g, sizes, options);
    ASSERT_TRUE(reducer.ok()) << reducer.status();
    ASSERT_TRUE((*reducer)->on_device());
    for (int t = 0; t < 2; ++t) {
      (*reducer)->ZeroGrad();
      for (int p = 2; p >= 0; --p) {
        std::vector<float> grad(sizes[p], float(g->rank() + 1 + p + t));
        absl::Span<float> device = (*reducer)->grad(p);
        ASSERT_TRUE(g->Copy(device.data(), grad.data(), grad.size() * 4,
                            CopyKind::kHostToDevice)
                        .ok());
        ASSERT_TRUE((*reducer)->MarkReady(p).ok());
      }
      ASSERT_TRUE((*reducer)->Finish().ok());
      for (int p = 0; p < 3; ++p) {
        std::vector<float> got(sizes[p]);
        ASSERT_TRUE(g->Copy(got.data(), (*reducer)->grad(p).data(),
                            got.size() * 4, CopyKind::kDeviceToHost)
                        .ok());
        const float want = (n + 1) / 2.0f + p + t;
        EXPECT_FLOAT_EQ(got.front(), want);
        EXPECT_FLOAT_EQ(got.back(), want);
      }
    }
  });
}

TEST(DeviceBuffersGpu, FsdpStepsShardsInDeviceMemory) {
  DEVICES_OR_SKIP(n);
  OnEveryDevice(n, [n](std::shared_ptr<NcclProcessGroup> g) {
    auto fsdp = Fsdp::Create(g, {{5, 1000}});
    ASSERT_TRUE(fsdp.ok()) << fsdp.status();
    std::vector<float> w(5, 1.0f), b(1000, 2.0f);
    ASSERT_TRUE((*fsdp)->LoadFromRank0({{w, b}}).ok());
    std::unique_ptr<Optimizer> sgd = *NewSgd({.lr = 0.5f});
    ASSERT_TRUE((*fsdp)->BeginForward(0).ok());
    ASSERT_TRUE((*fsdp)->EndForward(0).ok());
    ASSERT_TRUE((*fsdp)->BeginBackward(0).ok());
    for (int i = 0; i < 2; ++i) {
      absl::Span<float> grad = (*fsdp)->grad(0, i);
      std::vector<float> mine(grad.size(), float(g->rank() + 1));
      ASSERT_TRUE(g->Copy(grad.data(), mine.data(), mine.size() * 4,
                          CopyKind::kHostToDevice)
                      .ok());
    }
    ASSERT_TRUE((*fsdp)->EndBackward(0).ok());
    ASSERT_TRUE((*fsdp)->FinishBackward().ok());
    ASSERT_TRUE((*fsdp)->Step(*sgd).ok());
    auto full = (*fsdp)->GatherFullParams(0);
    ASSERT_TRUE(full.ok()) << full.status();
    const float avg = (n + 1) / 2.0f;
    EXPECT_FLOAT_EQ((*full)[0], 1.0f - 0.5f * avg);
    EXPECT_FLOAT_EQ((*full)[1004], 2.0f - 0.5f * avg);
  });
}

}  // namespace
}  // namespace cohort
