// The NCCL backend against the real NCCL: one rank per visible GPU, as
// threads of this process (NCCL takes one rank per device in a
// communicator). On a machine without a GPU it checks the error a worker
// then gets and skips the rest, printing why (gtest's SKIPPED).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/in_process_store.h"
#include "worker/collective/elementwise.h"
#include "worker/collective/nccl/cuda_nccl_api.h"
#include "worker/collective/nccl/nccl_backend.h"
#include "worker/collective/reduce.h"

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

// The element-wise kernels (cuda_kernels.cu) against the host arithmetic
// they must reproduce, bit for bit: reduce.h's rounding and elementwise.h's
// formulas (the kernels are built without FMA contraction, and nvcc's
// division and square root round correctly, as the host's do).
TEST(NcclGpu, KernelsComputeWhatTheHostComputes) {
  absl::StatusOr<int> devices = Devices();
  SKIP_WITHOUT_GPU(devices);
  NcclOptions options;
  options.group.timeout = absl::Seconds(60);
  OnEveryDevice(1, options, [](NcclProcessGroup& g) {
    DeviceMemory& memory = *g.device_memory();
    constexpr size_t kN = 100003;  // More than one grid-stride pass.
    std::vector<float> a(kN), b(kN);
    for (size_t i = 0; i < kN; ++i) {
      a[i] = 0.001f * static_cast<float>(i) - 37.5f;
      b[i] = 1.0f / (1.0f + static_cast<float>(i % 97));
    }
    DeviceFloats da(g, a), db(g, b);
    ASSERT_TRUE(memory
                    .AddF32(static_cast<float*>(da.view().data),
                            static_cast<const float*>(db.view().data), kN)
                    .ok());
    std::vector<float> sum = da.Read();
    for (size_t i = 0; i < kN; ++i) {
      const float want = a[i] + b[i];
      ASSERT_EQ(std::memcmp(&sum[i], &want, sizeof(float)), 0) << i;
    }

    // The conversions' edges, after the ordinary values: signed zeros,
    // f16 subnormals and overflow, round-to-even ties of f16 (2^-11) and
    // bf16 (2^-8), f32 subnormals, infinities and NaN.
    const float kEdges[] = {0.0f,     -0.0f,           1e-8f,     6e-8f,
                            65504.0f, 65519.0f,        65520.0f,  -65536.0f,
                            1.0f + 0x1p-11f,           1.0f + 0x1p-8f,
                            1.0f + 3 * 0x1p-9f,        3e38f,     1e-40f,
                            INFINITY, -INFINITY,       NAN};
    std::vector<float> c = b;
    for (size_t i = 0; i < sizeof(kEdges) / sizeof(float); ++i) c[i] = kEdges[i];
    DeviceFloats dc(g, c);
    // Bit for bit; any NaN equals any NaN.
    auto same = [](float x, float y) {
      return (std::isnan(x) && std::isnan(y)) ||
             std::memcmp(&x, &y, sizeof(float)) == 0;
    };
    for (Dtype narrow : {Dtype::kF16, Dtype::kBF16}) {
      SCOPED_TRACE(DtypeName(narrow));
      void* half = *g.api().Alloc(g.device(), kN * 2);
      ASSERT_TRUE(
          memory.Convert(BufferView{half, kN, narrow}, dc.view(), 0.5f).ok());
      DeviceFloats back(g, std::vector<float>(kN));
      ASSERT_TRUE(
          memory.Convert(back.view(), BufferView{half, kN, narrow}, 2.0f).ok());
      std::vector<float> scaled(kN), want(kN);
      std::vector<uint16_t> host_half(kN);
      for (size_t i = 0; i < kN; ++i) scaled[i] = c[i] * 0.5f;
      NarrowFromF32(narrow, scaled.data(), host_half.data(), kN);
      WidenToF32(narrow, host_half.data(), want.data(), kN);
      for (float& x : want) x *= 2.0f;
      std::vector<float> got = back.Read();
      for (size_t i = 0; i < kN; ++i) {
        ASSERT_TRUE(same(got[i], want[i]))
            << i << ": " << c[i] << " became " << got[i] << ", host "
            << want[i];
      }
      g.api().Free(half);
    }

    for (auto rule :
         {ElementwiseUpdate::Rule::kSgd, ElementwiseUpdate::Rule::kSgdMomentum,
          ElementwiseUpdate::Rule::kAdam}) {
      SCOPED_TRACE(static_cast<int>(rule));
      std::vector<float> p = a, s0(kN, 0.25f), s1(kN, 0.5f);
      DeviceFloats dp(g, p), ds0(g, s0), ds1(g, s1);
      ElementwiseUpdate u;
      u.rule = rule;
      u.count = kN;
      u.lr = 0.01f;
      u.weight_decay = 0.001f;
      u.momentum = 0.9f;
      u.beta1 = 0.9f;
      u.beta2 = 0.999f;
      u.eps = 1e-8f;
      u.step_size = 0.1f;
      u.bc2_sqrt = 0.0447f;
      ElementwiseUpdate on_device = u;
      on_device.params = static_cast<float*>(dp.view().data);
      on_device.grads = static_cast<const float*>(db.view().data);
      on_device.state0 = static_cast<float*>(ds0.view().data);
      on_device.state1 = static_cast<float*>(ds1.view().data);
      ASSERT_TRUE(memory.Update(on_device).ok());
      u.params = p.data();
      u.grads = b.data();
      u.state0 = s0.data();
      u.state1 = s1.data();
      ApplyUpdateOnHost(u);
      std::vector<float> got = dp.Read();
      for (size_t i = 0; i < kN; ++i) {
        ASSERT_TRUE(same(got[i], p[i])) << i << ": GPU " << got[i]
                                        << ", host " << p[i];
      }
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
