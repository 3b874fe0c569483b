// DDP and FSDP on a group whose buffers are device memory: NcclProcessGroup
// over the fake NCCL, ranks as threads. The fake runs under
// RequireDeviceMemory(), so any buffer that is not device memory (a host
// pointer handed to a collective, a copy or a kernel) fails the call as a
// GPU would fault; the tests also read the calls each rank made, to check
// that gradients and parameters never go through the host.
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/parallel/ddp.h"
#include "worker/parallel/fsdp.h"
#include "worker/parallel/optimizer.h"
#include "worker/parallel/powersgd.h"
#include "worker/parallel/testing/device_ranks.h"

namespace cohort {
namespace {

using ::cohort::testing::DeviceRanks;
using ::testing::Contains;
using ::testing::HasSubstr;

// A gradient value for rank r, parameter p, element i, iteration t.
float Grad(int r, int p, size_t i, int t) {
  return static_cast<float>((r + 1) * (p + 1)) + 0.25f * i + t;
}

void RunDdp(const std::shared_ptr<CommHook>& hook, float tolerance) {
  constexpr int kRanks = 2;
  const std::vector<size_t> sizes = {5, 300, 3, 700, 11, 600};
  DeviceRanks ranks(kRanks);
  std::vector<size_t> baseline(kRanks);
  for (int r = 0; r < kRanks; ++r) baseline[r] = ranks.api(r).allocated_bytes();
  ranks.RunAll([&](int r) {
    ReducerOptions options;
    options.first_bucket_bytes = 1024;
    options.bucket_cap_bytes = 2048;
    options.hook = hook == nullptr                   ? nullptr
                   : hook->name() == "fp16_compress" ? Fp16CompressHook()
                                                     : Bf16CompressHook();
    auto reducer = Reducer::Create(ranks.group(r), sizes, options);
    ASSERT_TRUE(reducer.ok()) << reducer.status();
    Reducer& red = **reducer;
    EXPECT_TRUE(red.on_device());
    EXPECT_GT(red.buckets().size(), 2u);
    int allocations = 0;
    for (int t = 0; t < 3; ++t) {
      const size_t before = ranks.CallCount(r);
      // After the rebuild, an iteration allocates nothing.
      if (t == 2) allocations = ranks.api(r).allocations_made();
      red.ZeroGrad();
      // Marks in an order other than the layout's, to force a rebuild.
      for (int p : {1, 4, 0, 5, 3, 2}) {
        absl::Span<float> g = red.grad(p);
        for (size_t i = 0; i < g.size(); ++i) g[i] = Grad(r, p, i, t);
        ASSERT_TRUE(red.MarkReady(p).ok());
      }
      absl::Status finished = red.Finish();
      ASSERT_TRUE(finished.ok()) << finished;
      for (int p = 0; p < static_cast<int>(sizes.size()); ++p) {
        absl::Span<float> g = red.grad(p);
        for (size_t i = 0; i < g.size(); ++i) {
          const float want = (Grad(0, p, i, t) + Grad(1, p, i, t)) / 2;
          ASSERT_NEAR(g[i], want, tolerance * want)
              << "rank " << r << " param " << p << " element " << i;
        }
      }
      // Only the first Finish sends the ready order (4 bytes a parameter)
      // through the host; gradients never do.
      EXPECT_EQ(ranks.BytesToHost(r, before), t == 0 ? 4 * sizes.size() : 0u)
          << "iteration " << t;
    }
    EXPECT_TRUE(red.rebuilt());
    EXPECT_EQ(red.buckets()[0].params[0], 1);
    EXPECT_EQ(ranks.api(r).allocations_made(), allocations);
  });
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(ranks.api(r).host_pointer_calls(), 0);
    // The Reducer (buckets, scratch, its pool) freed everything it held.
    EXPECT_EQ(ranks.api(r).allocated_bytes(), baseline[r]);
  }
}

TEST(DeviceBuffers, DdpBucketsLiveOnTheDevice) { RunDdp(nullptr, 0.0f); }

TEST(DeviceBuffers, DdpCompressionHooksCastOnTheDevice) {
  RunDdp(Fp16CompressHook(), 1e-3f);
  RunDdp(Bf16CompressHook(), 1e-2f);
}

TEST(DeviceBuffers, CompressionCastsAreKernels) {
  DeviceRanks ranks(2);
  ranks.RunAll([&](int r) {
    ReducerOptions options;
    options.hook = Fp16CompressHook();
    auto reducer = Reducer::Create(ranks.group(r), {8}, options);
    ASSERT_TRUE(reducer.ok()) << reducer.status();
    // The scratch is on the device: 8 f16 beside the 8 f32 of the bucket.
    EXPECT_EQ((*reducer)->grad_bytes(), 8u * 4 + 8u * 2);
    absl::Span<float> g = (*reducer)->grad(0);
    for (size_t i = 0; i < g.size(); ++i) g[i] = 2.0f * (r + 1);
    ASSERT_TRUE((*reducer)->MarkReady(0).ok());
    ASSERT_TRUE((*reducer)->Finish().ok());
    // (The first Finish rebuilt the buckets: views taken before are stale.)
    EXPECT_EQ((*reducer)->grad(0)[0], 3.0f);
  });
  EXPECT_THAT(ranks.api(0).calls(), Contains("Convert(count=8, f32 to f16)"));
  EXPECT_THAT(ranks.api(0).calls(), Contains("Convert(count=8, f16 to f32)"));
}

// PowerSGD computes on the host: on a device group its first Launch fails
// with UNIMPLEMENTED before anything is sent, and the Reducer reports it
// at once (from the first iteration, not at start_powersgd_iter).
TEST(DeviceBuffers, PowerSgdRefusesDeviceMemory) {
  DeviceRanks ranks(1);
  auto hook = PowerSgdHook::Create({}, {{4, 3}}).value();
  ReducerOptions options;
  options.hook = hook;
  auto reducer = Reducer::Create(ranks.group(0), {12}, options);
  ASSERT_TRUE(reducer.ok()) << reducer.status();
  absl::Status marked = (*reducer)->MarkReady(0);
  EXPECT_EQ(marked.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(marked.message(), HasSubstr("host groups only"));
  EXPECT_EQ(hook->bytes_sent(), std::optional<uint64_t>(0));
  EXPECT_EQ((*reducer)->Finish().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(DeviceBuffers, NoSyncAccumulatesOnTheDevice) {
  DeviceRanks ranks(2);
  ranks.RunAll([&](int r) {
    auto reducer = Reducer::Create(ranks.group(r), {4, 4});
    ASSERT_TRUE(reducer.ok()) << reducer.status();
    Reducer& red = **reducer;
    {
      Reducer::NoSyncScope no_sync(red);
      for (int p : {1, 0}) {
        for (float& x : red.grad(p)) x += 1.0f + r;
        ASSERT_TRUE(red.MarkReady(p).ok());
      }
      ASSERT_TRUE(red.Finish().ok());
    }
    for (int p : {1, 0}) {
      for (float& x : red.grad(p)) x += 1.0f + r;
      ASSERT_TRUE(red.MarkReady(p).ok());
    }
    ASSERT_TRUE(red.Finish().ok());
    // Each rank accumulated 2 * (1 + r); the average is 3.
    for (int p : {0, 1}) {
      for (float x : red.grad(p)) EXPECT_EQ(x, 3.0f);
    }
  });
}

TEST(DeviceBuffers, BroadcastFromRank0PacksOnTheDevice) {
  DeviceRanks ranks(3);
  ranks.RunAll([&](int r) {
    // Two small tensors (packed together) and one above the chunk size
    // (broadcast in place).
    float* a = ranks.DeviceFloats(r, 3);
    float* b = ranks.DeviceFloats(r, 5);
    float* big = ranks.DeviceFloats(r, 64);
    for (int i = 0; i < 3; ++i) a[i] = 10.0f * r + i;
    for (int i = 0; i < 5; ++i) b[i] = 20.0f * r + i;
    for (int i = 0; i < 64; ++i) big[i] = 30.0f * r + i;
    std::vector<BufferView> tensors = {
        BufferView::Of(a, 3), BufferView::Of(b, 5), BufferView::Of(big, 64)};
    const size_t before = ranks.CallCount(r);
    absl::Status status = BroadcastFromRank0(*ranks.group(r), tensors, 128);
    ASSERT_TRUE(status.ok()) << status;
    for (int i = 0; i < 3; ++i) EXPECT_EQ(a[i], static_cast<float>(i));
    for (int i = 0; i < 5; ++i) EXPECT_EQ(b[i], static_cast<float>(i));
    for (int i = 0; i < 64; ++i) EXPECT_EQ(big[i], static_cast<float>(i));
    EXPECT_EQ(ranks.BytesToHost(r, before), 0u);
    for (float* p : {a, b, big}) ranks.api(r).Free(p);
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(ranks.api(r).host_pointer_calls(), 0);
  }
}

// What FSDP must produce: one optimizer over the full parameters, stepped
// with the average of every rank's gradients, on the host.
class FsdpOnDevice : public ::testing::TestWithParam<ShardingStrategy> {};

std::unique_ptr<Optimizer> NewOptimizer(int which) {
  if (which == 0) return *NewSgd({.lr = 0.1f, .momentum = 0.9f});
  return *NewAdam({.lr = 0.01f, .weight_decay = 0.01f});
}

TEST_P(FsdpOnDevice, StepsMatchTheHostReference) {
  constexpr int kRanks = 3;
  constexpr int kSteps = 3;
  // Unit sizes that need padding to a multiple of the ranks.
  const std::vector<std::vector<size_t>> units = {{7, 3}, {50}, {1, 2, 4}};
  for (int which : {0, 1}) {
    SCOPED_TRACE(which == 0 ? "sgd" : "adam");
    // Initial values and the reference run on the host.
    std::vector<std::vector<std::vector<float>>> initial(units.size());
    std::vector<std::vector<std::vector<float>>> want(units.size());
    for (size_t u = 0; u < units.size(); ++u) {
      for (size_t i = 0; i < units[u].size(); ++i) {
        std::vector<float> v(units[u][i]);
        for (size_t k = 0; k < v.size(); ++k) {
          v[k] = 0.5f - 0.01f * static_cast<float>(k + 7 * i + 13 * u);
        }
        initial[u].push_back(v);
      }
      want[u] = initial[u];
    }
    std::unique_ptr<Optimizer> reference = NewOptimizer(which);
    for (int t = 0; t < kSteps; ++t) {
      for (size_t u = 0; u < units.size(); ++u) {
        // The flat unit as one slot, as FSDP steps its shards.
        std::vector<float> flat, grads;
        for (size_t i = 0; i < units[u].size(); ++i) {
          flat.insert(flat.end(), want[u][i].begin(), want[u][i].end());
          for (size_t k = 0; k < units[u][i]; ++k) {
            float sum = 0;
            for (int r = 0; r < kRanks; ++r) sum += Grad(r, i, k, t);
            grads.push_back(sum / kRanks);
          }
        }
        ASSERT_TRUE(reference->Step(u, absl::MakeSpan(flat), grads).ok());
        size_t at = 0;
        for (size_t i = 0; i < units[u].size(); ++i) {
          std::copy(flat.begin() + at, flat.begin() + at + units[u][i],
                    want[u][i].begin());
          at += units[u][i];
        }
      }
    }

    DeviceRanks ranks(kRanks);
    std::vector<size_t> baseline(kRanks);
    for (int r = 0; r < kRanks; ++r) {
      baseline[r] = ranks.api(r).allocated_bytes();
    }
    ranks.RunAll([&](int r) {
      FsdpOptions options;
      options.strategy = GetParam();
      auto created = Fsdp::Create(ranks.group(r), units, options);
      ASSERT_TRUE(created.ok()) << created.status();
      Fsdp& fsdp = **created;
      EXPECT_TRUE(fsdp.on_device());
      std::vector<std::vector<absl::Span<const float>>> values(units.size());
      for (size_t u = 0; u < units.size(); ++u) {
        for (const std::vector<float>& v : initial[u]) values[u].push_back(v);
      }
      ASSERT_TRUE(fsdp.LoadFromRank0(values).ok());
      std::unique_ptr<Optimizer> optimizer = NewOptimizer(which);
      int allocations = 0;
      for (int t = 0; t < kSteps; ++t) {
        const size_t before = ranks.CallCount(r);
        // Once the optimizer's state exists (the first Step takes it, in
        // part from the pool) every buffer of a step comes from the pool:
        // no cudaMalloc (nor cudaFree) in a steady-state step.
        if (t == 2) allocations = ranks.api(r).allocations_made();
        for (int u = 0; u < fsdp.num_units(); ++u) {
          ASSERT_TRUE(fsdp.BeginForward(u).ok());
          for (int i = 0; i < fsdp.num_params(u); ++i) {
            // The gathered parameters are the current ones.
            EXPECT_EQ(fsdp.param(u, i).size(), units[u][i]);
          }
          ASSERT_TRUE(fsdp.EndForward(u).ok());
        }
        for (int u = fsdp.num_units() - 1; u >= 0; --u) {
          ASSERT_TRUE(fsdp.BeginBackward(u).ok());
          for (int i = 0; i < fsdp.num_params(u); ++i) {
            absl::Span<float> g = fsdp.grad(u, i);
            for (size_t k = 0; k < g.size(); ++k) g[k] += Grad(r, i, k, t);
          }
          ASSERT_TRUE(fsdp.EndBackward(u).ok());
        }
        ASSERT_TRUE(fsdp.FinishBackward().ok());
        absl::Status stepped = fsdp.Step(*optimizer);
        ASSERT_TRUE(stepped.ok()) << stepped;
        fsdp.ZeroGrad();
        // A training step moves nothing through the host.
        EXPECT_EQ(ranks.BytesToHost(r, before), 0u) << "step " << t;
      }
      EXPECT_EQ(ranks.api(r).allocations_made(), allocations);
      EXPECT_GT(optimizer->state_bytes(), 0u);
      for (int u = 0; u < fsdp.num_units(); ++u) {
        auto full = fsdp.GatherFullParams(u);
        ASSERT_TRUE(full.ok()) << full.status();
        size_t at = 0;
        for (size_t i = 0; i < units[u].size(); ++i) {
          for (size_t k = 0; k < units[u][i]; ++k) {
            EXPECT_FLOAT_EQ((*full)[at + k], want[u][i][k])
                << "rank " << r << " unit " << u << " param " << i << " [" << k
                << "]";
          }
          at += units[u][i];
        }
      }
    });
    for (int r = 0; r < kRanks; ++r) {
      EXPECT_EQ(ranks.api(r).host_pointer_calls(), 0);
      EXPECT_THAT(ranks.api(r).calls(), Contains(HasSubstr("Update(count=")));
      // Fsdp and the optimizer freed everything they held.
      EXPECT_EQ(ranks.api(r).allocated_bytes(), baseline[r]);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Strategies, FsdpOnDevice,
                         ::testing::Values(ShardingStrategy::kFullShard,
                                           ShardingStrategy::kShardGradOp,
                                           ShardingStrategy::kNoShard),
                         [](const auto& info) {
                           return std::string(ShardingStrategyName(info.param));
                         });

TEST(DeviceBuffers, AnOptimizerSlotStaysInOneMemory) {
  DeviceRanks ranks(1);
  GroupMemory device(ranks.group(0)->device_memory());
  std::unique_ptr<Optimizer> adam = *NewAdam({});
  float* params = ranks.DeviceFloats(0, 4);
  float* grads = ranks.DeviceFloats(0, 4);
  for (int i = 0; i < 4; ++i) grads[i] = 1.0f;
  ASSERT_TRUE(adam->StepIn(device, 0, params, grads, 4).ok());
  EXPECT_LT(params[0], 0.0f);
  EXPECT_EQ(adam->state_bytes(), 2u * 4 * sizeof(float));
  std::vector<float> host_params(4), host_grads(4, 1.0f);
  absl::Status mixed = adam->Step(0, absl::MakeSpan(host_params), host_grads);
  EXPECT_EQ(mixed.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(mixed.message(), HasSubstr("slot 0's state is in device memory"));
  ranks.api(0).Free(params);
  ranks.api(0).Free(grads);
}

// A slot's state in device memory is exported through the host; state
// imported on the host moves to the device at the slot's first step there
// (allocated and copied once) and stays. Both continue the host's steps
// bit for bit: the fake's kernels are the host's arithmetic.
TEST(DeviceBuffers, OptimizerStateLeavesAndReentersTheDevice) {
  constexpr size_t kN = 5;
  DeviceRanks ranks(1);
  GroupMemory device(ranks.group(0)->device_memory());
  float* params = ranks.DeviceFloats(0, kN);
  float* grads = ranks.DeviceFloats(0, kN);
  std::vector<float> want(kN);
  for (size_t i = 0; i < kN; ++i) want[i] = params[i] = 0.5f - 0.1f * i;
  std::unique_ptr<Optimizer> host = *NewAdam({.lr = 0.01f});
  std::unique_ptr<Optimizer> saver = *NewAdam({.lr = 0.01f});
  std::unique_ptr<Optimizer> resumed = *NewAdam({.lr = 0.01f});
  auto step = [&](Optimizer& on_device, int t) {
    std::vector<float> g(kN);
    for (size_t i = 0; i < kN; ++i) g[i] = grads[i] = 0.3f * t - 0.07f * i;
    ASSERT_TRUE(host->Step(3, absl::MakeSpan(want), g).ok());
    absl::Status s = on_device.StepIn(device, 3, params, grads, kN);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(std::memcmp(params, want.data(), kN * sizeof(float)), 0)
        << "step " << t;
  };
  step(*saver, 1);
  step(*saver, 2);
  const size_t before = ranks.CallCount(0);
  absl::StatusOr<OptimizerSlotState> exported = saver->ExportSlot(3);
  ASSERT_TRUE(exported.ok()) << exported.status();
  EXPECT_EQ(ranks.BytesToHost(0, before), 2 * kN * sizeof(float));
  const OptimizerSlotState reference = *host->ExportSlot(3);
  EXPECT_EQ(exported->step, 2);
  ASSERT_EQ(exported->buffers.size(), 2u);
  for (int k = 0; k < 2; ++k) {
    EXPECT_EQ(std::memcmp(exported->buffers[k].data(),
                          reference.buffers[k].data(), kN * sizeof(float)),
              0)
        << "state " << k;
  }

  ASSERT_TRUE(resumed->ImportSlot(3, *exported).ok());
  const size_t allocated = ranks.api(0).allocated_bytes();
  step(*resumed, 3);
  // The state moved: its two buffers were allocated on the device.
  EXPECT_EQ(ranks.api(0).allocated_bytes(), allocated + 2 * kN * sizeof(float));
  step(*resumed, 4);
  EXPECT_EQ(resumed->ExportSlot(3)->buffers, host->ExportSlot(3)->buffers);
  std::vector<float> host_params(kN), host_grads(kN);
  absl::Status mixed =
      resumed->Step(3, absl::MakeSpan(host_params), host_grads);
  EXPECT_THAT(mixed.message(), HasSubstr("slot 3's state is in device memory"));
  EXPECT_EQ(ranks.api(0).host_pointer_calls(), 0);
  ranks.api(0).Free(params);
  ranks.api(0).Free(grads);
}

TEST(DeviceBuffers, AHostPointerIsRefusedAsAGpuWouldFault) {
  // What the strict fake catches: DDP's old host buckets would have been
  // refused here, call by call.
  DeviceRanks ranks(1);
  std::vector<float> host(4, 1.0f);
  absl::Status status =
      ranks.group(0)
          ->AllReduce(BufferView::Of(host.data(), 4), ReduceOp::kSum)
          ->Wait();
  EXPECT_FALSE(status.ok());
  EXPECT_THAT(status.message(), HasSubstr("outside device memory"));
  EXPECT_EQ(ranks.api(0).host_pointer_calls(), 1);
}

}  // namespace
}  // namespace cohort
