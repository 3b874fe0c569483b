// FSDP on device memory checkpoints its training state. Two ranks of an
// NcclProcessGroup over the strict fake NCCL (threads; any host pointer
// handed to the device fails the call) train with Adam and save, once
// synchronously and once asynchronously (training on while the writer
// writes). Each checkpoint loads into FSDP on host memory at world 3 (Gloo
// ranks, forked processes) and on device memory at worlds 2 and 3: the
// parameters and both of Adam's moments come back bit for bit, and at
// world 2 the next step after loading equals the saver's next step bit for
// bit (the imported moments move to the device at that step).
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/file_store.h"
#include "gtest/gtest.h"
#include "worker/checkpoint/training_state.h"
#include "worker/collective/testing/ranks.h"
#include "worker/parallel/fsdp.h"
#include "worker/parallel/optimizer.h"
#include "worker/parallel/testing/device_ranks.h"

namespace cohort {
namespace {

using ::cohort::testing::DeviceRanks;
using ::cohort::testing::ReadFloats;
using ::cohort::testing::RunRanks;
using ::cohort::testing::TempPath;
using ::cohort::testing::WriteFloats;

// Two units, {7, 3} and {5, 2} elements: padded at worlds 2 and 3.
const std::vector<size_t> kParamSizes = {7, 3, 5, 2};
const std::vector<std::vector<size_t>> kUnits = {{7, 3}, {5, 2}};
constexpr int kUnitCount = 2;
constexpr int kSavedStep = 2;

float Initial(size_t param, size_t i) { return 0.1f * param - 0.013f * i; }
float Grad(int step, int rank, size_t param, size_t i) {
  return 0.5f - 0.03f * step * (param + 1) + 0.002f * i + 0.11f * rank;
}
size_t UnitElements(int u) { return kUnits[u][0] + kUnits[u][1]; }

std::unique_ptr<Optimizer> NewTestAdam() {
  return *NewAdam({.lr = 0.01f, .weight_decay = 0.01f});
}

absl::StatusOr<std::unique_ptr<Fsdp>> NewFsdp(
    std::shared_ptr<ProcessGroup> group) {
  auto fsdp = Fsdp::Create(std::move(group), kUnits);
  if (!fsdp.ok()) return fsdp.status();
  std::vector<std::vector<float>> initial(kParamSizes.size());
  for (size_t p = 0; p < kParamSizes.size(); ++p) {
    for (size_t i = 0; i < kParamSizes[p]; ++i) {
      initial[p].push_back(Initial(p, i));
    }
  }
  RANK_OK((*fsdp)->LoadFromRank0(
      {{initial[0], initial[1]}, {initial[2], initial[3]}}));
  return fsdp;
}

// One training step with this rank's gradients of `step`. The fake's
// device memory is host memory: the test writes the gradients as a
// backward kernel would.
absl::Status TrainStep(Fsdp& fsdp, Optimizer& adam, int step) {
  const int rank = fsdp.group().rank();
  fsdp.ZeroGrad();
  for (int u = 0; u < kUnitCount; ++u) {
    RANK_OK(fsdp.BeginForward(u));
    RANK_OK(fsdp.EndForward(u));
  }
  for (int u = kUnitCount - 1; u >= 0; --u) {
    RANK_OK(fsdp.BeginBackward(u));
    for (int k = 0; k < 2; ++k) {
      absl::Span<float> g = fsdp.grad(u, k);
      for (size_t i = 0; i < g.size(); ++i)
        g[i] = Grad(step, rank, 2 * u + k, i);
    }
    RANK_OK(fsdp.EndBackward(u));
  }
  RANK_OK(fsdp.FinishBackward());
  return fsdp.Step(adam);
}

// Bytes of this rank's parameter shards, padding included.
size_t ShardBytes(const Fsdp& fsdp) {
  size_t bytes = 0;
  for (int u = 0; u < kUnitCount; ++u) {
    bytes += fsdp.shard_elements(u) * sizeof(float);
  }
  return bytes;
}

// What one rank holds: each unit's full parameters (gathered, the same on
// every rank) and its shard of each of Adam's moments (padded).
struct RankView {
  std::vector<std::vector<float>> params;
  std::vector<std::vector<float>> moments[2];
};

absl::StatusOr<RankView> View(Fsdp& fsdp, const Optimizer& adam) {
  RankView view;
  for (int u = 0; u < kUnitCount; ++u) {
    auto full = fsdp.GatherFullParams(u);
    if (!full.ok()) return full.status();
    view.params.push_back(*std::move(full));
    auto state = adam.ExportSlot(u);
    if (!state.ok()) return state.status();
    RANK_CHECK(state->buffers.size() == 2);
    for (int k = 0; k < 2; ++k) view.moments[k].push_back(state->buffers[k]);
  }
  return view;
}

// The whole training state: each unit's parameters and moments over its
// real elements, assembled from every rank's view.
struct Whole {
  std::vector<std::vector<float>> params;
  std::vector<std::vector<float>> moments[2];
};

Whole Assemble(const std::vector<RankView>& ranks) {
  Whole whole;
  whole.params = ranks[0].params;
  for (int k = 0; k < 2; ++k) {
    for (int u = 0; u < kUnitCount; ++u) {
      std::vector<float> full;
      for (const RankView& r : ranks) {
        full.insert(full.end(), r.moments[k][u].begin(), r.moments[k][u].end());
      }
      full.resize(UnitElements(u));  // Drops the padding.
      whole.moments[k].push_back(std::move(full));
    }
  }
  return whole;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void ExpectSameBits(const Whole& got, const Whole& want,
                    const std::string& what) {
  for (int u = 0; u < kUnitCount; ++u) {
    ASSERT_EQ(got.params.size(), static_cast<size_t>(kUnitCount)) << what;
    EXPECT_TRUE(SameBits(got.params[u], want.params[u]))
        << what << ": unit " << u << "'s parameters";
    for (int k = 0; k < 2; ++k) {
      EXPECT_TRUE(SameBits(got.moments[k][u], want.moments[k][u]))
          << what << ": unit " << u << "'s moment " << k;
    }
  }
}

class DeviceCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override { store_path_ = TempPath("store"); }

  std::string Dir(const std::string& job) const {
    return absl::StrCat(store_path_, "-", job);
  }

  // Loads job's latest checkpoint into a fresh FSDP and Adam over `group`.
  absl::Status Load(const std::string& job, Fsdp& fsdp, Optimizer& adam) {
    auto store = FileStore::Open(store_path_);
    if (!store.ok()) return store.status();
    CheckpointCatalog catalog(store->get(), CheckpointPrefix(job));
    auto reader = CheckpointReader::OpenLatest(catalog);
    if (!reader.ok()) return reader.status();
    if (*reader == nullptr) return absl::NotFoundError("no checkpoint");
    RANK_CHECK((*reader)->step() == kSavedStep);
    return LoadFsdpState(**reader, fsdp, kParamSizes, adam);
  }

  // A forked rank's view, through files, and back.
  std::string ViewPath(const std::string& tag, int r, const std::string& what,
                       int u) const {
    return absl::StrCat(store_path_, "-", tag, "-", r, "-", what, "-", u);
  }
  absl::Status WriteView(const std::string& tag, int r, const RankView& view) {
    for (int u = 0; u < kUnitCount; ++u) {
      RANK_OK(WriteFloats(ViewPath(tag, r, "param", u), view.params[u]));
      for (int k = 0; k < 2; ++k) {
        RANK_OK(WriteFloats(ViewPath(tag, r, absl::StrCat("moment", k), u),
                            view.moments[k][u]));
      }
    }
    return absl::OkStatus();
  }
  RankView ReadView(const std::string& tag, int r) const {
    RankView view;
    for (int u = 0; u < kUnitCount; ++u) {
      view.params.push_back(ReadFloats(ViewPath(tag, r, "param", u)).value());
      for (int k = 0; k < 2; ++k) {
        view.moments[k].push_back(
            ReadFloats(ViewPath(tag, r, absl::StrCat("moment", k), u)).value());
      }
    }
    return view;
  }

  std::string store_path_;
};

TEST_F(DeviceCheckpointTest, SavedOnDeviceLoadsAnywhereAndContinuesExactly) {
  Whole saved, continued;
  {
    DeviceRanks ranks(2);
    std::vector<RankView> at_save(2), after(2);
    ranks.RunAll([&](int r) {
      auto fsdp = NewFsdp(ranks.group(r));
      ASSERT_TRUE(fsdp.ok()) << fsdp.status();
      ASSERT_TRUE((*fsdp)->on_device());
      std::unique_ptr<Optimizer> adam = NewTestAdam();
      for (int step = 1; step <= kSavedStep; ++step) {
        ASSERT_TRUE(TrainStep(**fsdp, *adam, step).ok());
      }
      auto view = View(**fsdp, *adam);
      ASSERT_TRUE(view.ok()) << view.status();
      at_save[r] = *std::move(view);
      auto store = FileStore::Open(store_path_);
      ASSERT_TRUE(store.ok()) << store.status();
      CheckpointCatalog sync_catalog(store->get(), CheckpointPrefix("sync"));
      CheckpointCatalog async_catalog(store->get(), CheckpointPrefix("async"));
      auto sync = CheckpointWriter::Create({.dir = Dir("sync"),
                                            .rank = r,
                                            .world_size = 2,
                                            .catalog = &sync_catalog});
      auto async = CheckpointWriter::Create({.dir = Dir("async"),
                                             .rank = r,
                                             .world_size = 2,
                                             .catalog = &async_catalog});
      ASSERT_TRUE(sync.ok() && async.ok());
      const size_t before = ranks.CallCount(r);
      absl::Status s = SaveFsdpState(**sync, /*async=*/false, kSavedStep,
                                     **fsdp, kParamSizes, *adam);
      ASSERT_TRUE(s.ok()) << s;
      // The save read the device through the host, once: each shard and
      // its two moments.
      EXPECT_EQ(ranks.BytesToHost(r, before), 3 * ShardBytes(**fsdp));
      s = SaveFsdpState(**async, /*async=*/true, kSavedStep, **fsdp,
                        kParamSizes, *adam);
      ASSERT_TRUE(s.ok()) << s;
      // The next step rewrites the shards and the moments on the device
      // while the writer's thread writes what SaveAsync copied.
      ASSERT_TRUE(TrainStep(**fsdp, *adam, kSavedStep + 1).ok());
      s = (*async)->Wait();
      ASSERT_TRUE(s.ok()) << s;
      view = View(**fsdp, *adam);
      ASSERT_TRUE(view.ok()) << view.status();
      after[r] = *std::move(view);
    });
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(ranks.api(r).host_pointer_calls(), 0) << "rank " << r;
    }
    ASSERT_FALSE(::testing::Test::HasFatalFailure());
    saved = Assemble(at_save);
    continued = Assemble(after);
  }
  // (The device ranks' threads are gone before RunRanks forks.)

  for (const std::string job : {"sync", "async"}) {
    SCOPED_TRACE(job);
    // Host memory, Gloo, world 3.
    const std::string tag = absl::StrCat("host-", job);
    RunRanks(3, [&](std::shared_ptr<ProcessGroup> group) -> absl::Status {
      auto fsdp = Fsdp::Create(group, kUnits);
      if (!fsdp.ok()) return fsdp.status();
      RANK_CHECK(!(*fsdp)->on_device());
      std::unique_ptr<Optimizer> adam = NewTestAdam();
      RANK_OK(Load(job, **fsdp, *adam));
      auto view = View(**fsdp, *adam);
      if (!view.ok()) return view.status();
      return WriteView(tag, group->rank(), *view);
    });
    std::vector<RankView> host_views;
    for (int r = 0; r < 3; ++r) host_views.push_back(ReadView(tag, r));
    ExpectSameBits(Assemble(host_views), saved, "host FSDP at world 3");

    // Device memory at world 2 and 3; at 2 the next step too.
    for (int world : {2, 3}) {
      DeviceRanks ranks(world);
      std::vector<RankView> loaded(world), stepped(world);
      ranks.RunAll([&](int r) {
        auto fsdp = Fsdp::Create(ranks.group(r), kUnits);
        ASSERT_TRUE(fsdp.ok()) << fsdp.status();
        std::unique_ptr<Optimizer> adam = NewTestAdam();
        const size_t before = ranks.CallCount(r);
        absl::Status s = Load(job, **fsdp, *adam);
        ASSERT_TRUE(s.ok()) << s;
        // One copy of each whole shard to the device; the moments wait on
        // the host for the first step.
        EXPECT_EQ(ranks.BytesToDevice(r, before), ShardBytes(**fsdp));
        auto view = View(**fsdp, *adam);
        ASSERT_TRUE(view.ok()) << view.status();
        loaded[r] = *std::move(view);
        const size_t before_step = ranks.CallCount(r);
        s = TrainStep(**fsdp, *adam, kSavedStep + 1);
        ASSERT_TRUE(s.ok()) << s;
        // The first step moved both moments to the device, and steps there.
        EXPECT_EQ(ranks.BytesToDevice(r, before_step), 2 * ShardBytes(**fsdp));
        view = View(**fsdp, *adam);
        ASSERT_TRUE(view.ok()) << view.status();
        stepped[r] = *std::move(view);
      });
      for (int r = 0; r < world; ++r) {
        EXPECT_EQ(ranks.api(r).host_pointer_calls(), 0) << "rank " << r;
      }
      ASSERT_FALSE(::testing::Test::HasFatalFailure());
      const std::string what = absl::StrCat("device FSDP at world ", world);
      ExpectSameBits(Assemble(loaded), saved, what);
      if (world == 2) {
        ExpectSameBits(Assemble(stepped), continued, what + ", one step on");
      }
    }
  }
}

}  // namespace
}  // namespace cohort
