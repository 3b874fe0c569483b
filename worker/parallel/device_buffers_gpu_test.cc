// DDP and FSDP on real device buffers: an NcclProcessGroup over CUDA's NCCL,
// one rank per visible GPU (threads of this process). The test writes the
// gradients with host-to-device copies, standing in for a backward's
// kernels, and reads the results back the same way. Without a GPU every
// case is SKIPPED with the reason (device_buffers_test covers the same
// paths over the fake NCCL everywhere).
//
// An FSDP checkpoint saved from device memory loads back into it bit for
// bit, and the steps after it continue as the saver's.
//
// At world 1 the same training steps also run over the fake NCCL, whose
// "device" is host memory and whose kernels are elementwise.h's host
// arithmetic: the GPU's results must equal the host's bit for bit, and a
// steady-state step must allocate no device memory (no cudaMalloc).
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/in_process_store.h"
#include "worker/checkpoint/training_state.h"
#include "worker/collective/nccl/cuda_nccl_api.h"
#include "worker/collective/nccl/fake_nccl_api.h"
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

// An NcclApi that counts the device allocations made through it.
class CountingApi final : public NcclApi {
 public:
  explicit CountingApi(std::shared_ptr<NcclApi> api) : api_(std::move(api)) {}
  absl::StatusOr<int> DeviceCount() override { return api_->DeviceCount(); }
  absl::StatusOr<NcclUniqueId> GetUniqueId() override {
    return api_->GetUniqueId();
  }
  absl::StatusOr<std::unique_ptr<NcclCommunicator>> InitRank(
      int device, int nranks, int rank,
      absl::Span<const NcclUniqueId> ids) override {
    return api_->InitRank(device, nranks, rank, ids);
  }
  absl::StatusOr<std::unique_ptr<DeviceStream>> NewStream(int device) override {
    return api_->NewStream(device);
  }
  absl::StatusOr<void*> Alloc(int device, size_t bytes) override {
    ++allocations_;
    return api_->Alloc(device, bytes);
  }
  void Free(void* device_memory) override { api_->Free(device_memory); }
  int allocations() const { return allocations_; }

 private:
  const std::shared_ptr<NcclApi> api_;
  std::atomic<int> allocations_{0};
};

// What a run of the steps below produced: every gradient and parameter
// value read back, in order, and whether some steady-state step allocated.
struct Steps {
  std::vector<float> values;
  std::vector<std::string> steady_state_allocations;
};

float GradValue(int p, size_t i, int t) {
  return 0.37f * static_cast<float>(p + 1) - 0.0071f * static_cast<float>(i) +
         0.5f * static_cast<float>(t);
}

// DDP (plain and with the fp16 compression hook) and FSDP (Adam, every
// strategy) at world 1 over `api`.
Steps RunSteps(std::shared_ptr<NcclApi> base) {
  Steps out;
  auto api = std::make_shared<CountingApi>(base);
  NcclOptions options;
  options.device = 0;
  options.group.timeout = absl::Seconds(60);
  options.api = api;
  auto created = NcclProcessGroup::Create(std::make_shared<InProcessStore>(), 0,
                                          1, options);
  EXPECT_TRUE(created.ok()) << created.status();
  if (!created.ok()) return out;
  std::shared_ptr<NcclProcessGroup> g(std::move(*created));
  auto to_device = [&](float* device, const std::vector<float>& host) {
    EXPECT_TRUE(
        g->Copy(device, host.data(), host.size() * 4, CopyKind::kHostToDevice)
            .ok());
  };
  auto read = [&](const float* device, size_t n) {
    std::vector<float> host(n);
    EXPECT_TRUE(
        g->Copy(host.data(), device, n * 4, CopyKind::kDeviceToHost).ok());
    out.values.insert(out.values.end(), host.begin(), host.end());
  };

  const std::vector<size_t> sizes = {1000, 3, 300000, 17};
  for (bool compress : {false, true}) {
    ReducerOptions ddp;
    ddp.first_bucket_bytes = 4096;
    ddp.bucket_cap_bytes = 65536;
    if (compress) ddp.hook = Fp16CompressHook();
    auto reducer = Reducer::Create(g, sizes, ddp);
    EXPECT_TRUE(reducer.ok()) << reducer.status();
    if (!reducer.ok()) return out;
    for (int t = 0; t < 4; ++t) {
      const int before = api->allocations();
      (*reducer)->ZeroGrad();
      for (int p : {2, 0, 3, 1}) {
        std::vector<float> grad(sizes[p]);
        for (size_t i = 0; i < grad.size(); ++i) grad[i] = GradValue(p, i, t);
        to_device((*reducer)->grad(p).data(), grad);
        EXPECT_TRUE((*reducer)->MarkReady(p).ok());
      }
      EXPECT_TRUE((*reducer)->Finish().ok());
      for (int p = 0; p < 4; ++p) read((*reducer)->grad(p).data(), sizes[p]);
      // The first iteration takes the buckets, the second rebuilds them
      // in ready order; from the third on nothing is allocated.
      if (t >= 2 && api->allocations() != before) {
        out.steady_state_allocations.push_back(
            absl::StrCat("DDP", compress ? " fp16" : "", " iteration ", t, ": ",
                         api->allocations() - before, " allocations"));
      }
    }
  }

  const std::vector<std::vector<size_t>> units = {{7, 3}, {50}, {1000, 2, 4}};
  for (ShardingStrategy strategy :
       {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
        ShardingStrategy::kNoShard}) {
    FsdpOptions fsdp_options;
    fsdp_options.strategy = strategy;
    auto fsdp = Fsdp::Create(g, units, fsdp_options);
    EXPECT_TRUE(fsdp.ok()) << fsdp.status();
    if (!fsdp.ok()) return out;
    std::vector<std::vector<std::vector<float>>> initial(units.size());
    std::vector<std::vector<absl::Span<const float>>> spans(units.size());
    for (size_t u = 0; u < units.size(); ++u) {
      for (size_t i = 0; i < units[u].size(); ++i) {
        std::vector<float> v(units[u][i]);
        for (size_t k = 0; k < v.size(); ++k) {
          v[k] = 0.5f - 0.013f * static_cast<float>(k + 7 * i + 13 * u);
        }
        initial[u].push_back(std::move(v));
      }
      for (const auto& v : initial[u]) spans[u].push_back(v);
    }
    EXPECT_TRUE((*fsdp)->LoadFromRank0(spans).ok());
    std::unique_ptr<Optimizer> adam =
        *NewAdam({.lr = 0.01f, .weight_decay = 0.01f});
    for (int t = 0; t < 4; ++t) {
      const int before = api->allocations();
      for (int u = 0; u < (*fsdp)->num_units(); ++u) {
        EXPECT_TRUE((*fsdp)->BeginForward(u).ok());
        EXPECT_TRUE((*fsdp)->EndForward(u).ok());
      }
      for (int u = (*fsdp)->num_units() - 1; u >= 0; --u) {
        EXPECT_TRUE((*fsdp)->BeginBackward(u).ok());
        for (int i = 0; i < (*fsdp)->num_params(u); ++i) {
          absl::Span<float> grad = (*fsdp)->grad(u, i);
          std::vector<float> mine(grad.size());
          for (size_t k = 0; k < mine.size(); ++k) {
            mine[k] = GradValue(i + 10 * u, k, t);
          }
          to_device(grad.data(), mine);
        }
        EXPECT_TRUE((*fsdp)->EndBackward(u).ok());
      }
      EXPECT_TRUE((*fsdp)->FinishBackward().ok());
      absl::Status stepped = (*fsdp)->Step(*adam);
      EXPECT_TRUE(stepped.ok()) << stepped;
      (*fsdp)->ZeroGrad();
      // The first step takes the optimizer's state; after it, none.
      if (t >= 2 && api->allocations() != before) {
        out.steady_state_allocations.push_back(
            absl::StrCat("FSDP ", ShardingStrategyName(strategy), " step ", t,
                         ": ", api->allocations() - before, " allocations"));
      }
    }
    for (int u = 0; u < (*fsdp)->num_units(); ++u) {
      auto full = (*fsdp)->GatherFullParams(u);
      EXPECT_TRUE(full.ok()) << full.status();
      if (full.ok()) {
        out.values.insert(out.values.end(), full->begin(), full->end());
      }
    }
  }
  return out;
}

TEST(DeviceBuffersGpu, StepsAtWorldOneEqualTheHostsBitForBit) {
  DEVICES_OR_SKIP(n);
  (void)n;
  Steps gpu = RunSteps(CudaNcclApi());
  Steps host = RunSteps(std::make_shared<FakeNcclApi>(NewFakeNcclWorld()));
  EXPECT_THAT(gpu.steady_state_allocations, ::testing::IsEmpty());
  EXPECT_THAT(host.steady_state_allocations, ::testing::IsEmpty());
  ASSERT_EQ(gpu.values.size(), host.values.size());
  ASSERT_GT(gpu.values.size(), 600000u);
  size_t differing = 0, first = 0;
  for (size_t i = 0; i < gpu.values.size(); ++i) {
    if (std::memcmp(&gpu.values[i], &host.values[i], sizeof(float)) != 0) {
      if (differing++ == 0) first = i;
    }
  }
  EXPECT_EQ(differing, 0u) << "first at value " << first << ": GPU "
                           << gpu.values[first] << ", host "
                           << host.values[first];
}

// FSDP with Adam on the devices saves its training state (staged through
// the host) and a fresh FSDP on the same devices loads it: parameters and
// moments come back bit for bit, and the next step (the loaded moments
// moving to the device) equals the saver's bit for bit.
TEST(DeviceBuffersGpu, FsdpCheckpointLoadsAndContinuesBitForBit) {
  DEVICES_OR_SKIP(n);
  char dir_template[] = "/tmp/device_buffers_gpu_test.XXXXXX";
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir = tmp != nullptr ? absl::StrCat(tmp, "/checkpoint")
                                   : std::string(mkdtemp(dir_template));
  auto store = std::make_shared<InProcessStore>();
  const std::vector<size_t> sizes = {5, 1000, 3};
  const std::vector<std::vector<size_t>> units = {{5, 1000}, {3}};
  OnEveryDevice(n, [&](std::shared_ptr<NcclProcessGroup> g) {
    auto step = [&](Fsdp& fsdp, Optimizer& adam, int t) {
      for (int u = 0; u < 2; ++u) {
        ASSERT_TRUE(fsdp.BeginForward(u).ok());
        ASSERT_TRUE(fsdp.EndForward(u).ok());
      }
      for (int u = 1; u >= 0; --u) {
        ASSERT_TRUE(fsdp.BeginBackward(u).ok());
        for (int i = 0; i < fsdp.num_params(u); ++i) {
          absl::Span<float> grad = fsdp.grad(u, i);
          std::vector<float> mine(grad.size());
          for (size_t k = 0; k < mine.size(); ++k) {
            mine[k] = GradValue(i + 10 * u + g->rank(), k, t);
          }
          ASSERT_TRUE(g->Copy(grad.data(), mine.data(), mine.size() * 4,
                              CopyKind::kHostToDevice)
                          .ok());
        }
        ASSERT_TRUE(fsdp.EndBackward(u).ok());
      }
      ASSERT_TRUE(fsdp.FinishBackward().ok());
      absl::Status stepped = fsdp.Step(adam);
      ASSERT_TRUE(stepped.ok()) << stepped;
      fsdp.ZeroGrad();
    };
    auto expect_same = [&](Fsdp& a, Optimizer& adam_a, Fsdp& b,
                           Optimizer& adam_b, const std::string& when) {
      for (int u = 0; u < 2; ++u) {
        auto full_a = a.GatherFullParams(u);
        auto full_b = b.GatherFullParams(u);
        ASSERT_TRUE(full_a.ok() && full_b.ok());
        EXPECT_EQ(
            std::memcmp(full_a->data(), full_b->data(), full_a->size() * 4), 0)
            << when << ": unit " << u << "'s parameters";
        auto state_a = adam_a.ExportSlot(u);
        auto state_b = adam_b.ExportSlot(u);
        ASSERT_TRUE(state_a.ok()) << state_a.status();
        ASSERT_TRUE(state_b.ok()) << state_b.status();
        EXPECT_EQ(state_a->step, state_b->step) << when;
        for (int k = 0; k < 2; ++k) {
          EXPECT_EQ(std::memcmp(state_a->buffers[k].data(),
                                state_b->buffers[k].data(),
                                state_a->buffers[k].size() * 4),
                    0)
              << when << ": unit " << u << "'s moment " << k;
        }
      }
    };
    auto saver = Fsdp::Create(g, units);
    ASSERT_TRUE(saver.ok()) << saver.status();
    ASSERT_TRUE((*saver)->on_device());
    std::vector<float> w(5, 0.25f), b(1000, -0.5f), c(3, 1.0f);
    ASSERT_TRUE((*saver)->LoadFromRank0({{w, b}, {c}}).ok());
    std::unique_ptr<Optimizer> adam = *NewAdam({.lr = 0.01f});
    for (int t = 0; t < 2; ++t) step(**saver, *adam, t);

    CheckpointCatalog catalog(store.get(), CheckpointPrefix("gpu"));
    auto writer = CheckpointWriter::Create({.dir = dir,
                                            .rank = g->rank(),
                                            .world_size = g->size(),
                                            .catalog = &catalog});
    ASSERT_TRUE(writer.ok()) << writer.status();
    absl::Status saved =
        SaveFsdpState(**writer, /*async=*/false, 2, **saver, sizes, *adam);
    ASSERT_TRUE(saved.ok()) << saved;
    auto reader = CheckpointReader::OpenLatest(catalog);
    ASSERT_TRUE(reader.ok() && *reader != nullptr);
    auto loaded = Fsdp::Create(g, units);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    std::unique_ptr<Optimizer> resumed = *NewAdam({.lr = 0.01f});
    absl::Status load = LoadFsdpState(**reader, **loaded, sizes, *resumed);
    ASSERT_TRUE(load.ok()) << load;
    expect_same(**saver, *adam, **loaded, *resumed, "loaded");
    step(**saver, *adam, 2);
    step(**loaded, *resumed, 2);
    expect_same(**saver, *adam, **loaded, *resumed, "one step on");
  });
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace cohort
