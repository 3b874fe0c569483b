// FSDP trains two steps at world 4 and saves; FSDP at world 2 and 3, and
// replicas in one process, load it: every parameter and every element of
// Adam's state comes back bit-identical (loading is copying), wherever the
// new shards cut the units.
#include "worker/checkpoint/training_state.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/file_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/collective/testing/ranks.h"

namespace cohort {
namespace {

using ::cohort::testing::ReadFloats;
using ::cohort::testing::RunRanks;
using ::cohort::testing::TempPath;
using ::cohort::testing::WriteFloats;

// Two units: {7, 3} and {5, 2} elements; neither divides by 3 or 4.
const std::vector<size_t> kParamSizes = {7, 3, 5, 2};
const std::vector<std::vector<size_t>> kUnits = {{7, 3}, {5, 2}};

float Initial(size_t param, size_t i) { return 0.1f * param + 0.01f * i; }
float Grad(int step, size_t param, size_t i) {
  return 0.5f - 0.03f * step * (param + 1) + 0.002f * i;
}

class TrainingStateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = TempPath("ckpt");
    store_path_ = TempPath("store");
  }

  // FSDP over `group` with Adam, two steps with the gradients above.
  absl::Status TrainAndSave(std::shared_ptr<ProcessGroup> group) {
    auto fsdp = Fsdp::Create(group, kUnits);
    if (!fsdp.ok()) return fsdp.status();
    std::vector<std::vector<float>> initial(kParamSizes.size());
    for (size_t p = 0; p < kParamSizes.size(); ++p) {
      for (size_t i = 0; i < kParamSizes[p]; ++i) {
        initial[p].push_back(Initial(p, i));
      }
    }
    RANK_OK((*fsdp)->LoadFromRank0({{initial[0], initial[1]},
                                    {initial[2], initial[3]}}));
    auto adam = NewAdam({.lr = 0.01f}).value();
    for (int step = 1; step <= 2; ++step) {
      (*fsdp)->ZeroGrad();
      for (int u = 0; u < 2; ++u) {
        RANK_OK((*fsdp)->BeginForward(u));
        RANK_OK((*fsdp)->EndForward(u));
      }
      for (int u = 1; u >= 0; --u) {
        RANK_OK((*fsdp)->BeginBackward(u));
        for (int k = 0; k < 2; ++k) {
          absl::Span<float> g = (*fsdp)->grad(u, k);
          for (size_t i = 0; i < g.size(); ++i) g[i] = Grad(step, 2 * u + k, i);
        }
        RANK_OK((*fsdp)->EndBackward(u));
      }
      RANK_OK((*fsdp)->FinishBackward());
      RANK_OK((*fsdp)->Step(*adam));
    }
    auto store = FileStore::Open(store_path_);
    if (!store.ok()) return store.status();
    CheckpointCatalog catalog(store->get(), CheckpointPrefix("job"));
    auto writer = CheckpointWriter::Create({.dir = dir_,
                                            .rank = group->rank(),
                                            .world_size = group->size(),
                                            .catalog = &catalog});
    if (!writer.ok()) return writer.status();
    RANK_OK(SaveFsdpState(**writer, /*async=*/true, 2, **fsdp, kParamSizes, *adam));
    RANK_OK((*writer)->Wait());
    return Dump(group->rank(), "saved", **fsdp, *adam);
  }

  // Loads the latest checkpoint into FSDP over `group`.
  absl::Status Load(std::shared_ptr<ProcessGroup> group) {
    auto fsdp = Fsdp::Create(group, kUnits);
    if (!fsdp.ok()) return fsdp.status();
    auto store = FileStore::Open(store_path_);
    if (!store.ok()) return store.status();
    CheckpointCatalog catalog(store->get(), CheckpointPrefix("job"));
    auto reader = CheckpointReader::OpenLatest(catalog);
    if (!reader.ok()) return reader.status();
    if (*reader == nullptr) return absl::NotFoundError("no checkpoint");
    auto adam = NewAdam({.lr = 0.01f}).value();
    RANK_OK(LoadFsdpState(**reader, **fsdp, kParamSizes, *adam));
    return Dump(group->rank(), absl::StrCat("loaded", group->size()), **fsdp,
                *adam);
  }

  // Writes unit u's full parameters (rank 0) and this rank's Adam state of
  // each unit's real elements, for the test to compare.
  absl::Status Dump(int rank, const std::string& tag, Fsdp& fsdp,
                    const Optimizer& adam) {
    for (int u = 0; u < 2; ++u) {
      auto full = fsdp.GatherFullParams(u);
      if (!full.ok()) return full.status();
      if (rank == 0) RANK_OK(WriteFloats(Path(tag, "param", u, 0), *full));
      auto state = adam.ExportSlot(u);
      if (!state.ok()) return state.status();
      if (state->step != 2) {
        return absl::InternalError(absl::StrCat("step ", state->step));
      }
      for (int k = 0; k < 2; ++k) {
        RANK_OK(WriteFloats(Path(tag, absl::StrCat("state", k), u, rank),
                            state->buffers[k]));
      }
    }
    return absl::OkStatus();
  }

  std::string Path(const std::string& tag, const std::string& what, int unit,
                   int rank) const {
    return absl::StrCat(dir_, "-", tag, "-", what, "-", unit, "-", rank);
  }

  // Unit u's state k over its real elements, from the shards of `world`.
  std::vector<float> FullState(const std::string& tag, int world, int u,
                               int k) const {
    std::vector<float> full;
    for (int r = 0; r < world; ++r) {
      auto part = ReadFloats(Path(tag, absl::StrCat("state", k), u, r));
      EXPECT_TRUE(part.ok()) << part.status();
      if (part.ok()) full.insert(full.end(), part->begin(), part->end());
    }
    const size_t real = kUnits[u][0] + kUnits[u][1];
    if (full.size() > real) full.resize(real);  // Padding.
    return full;
  }

  std::string dir_;
  std::string store_path_;
};

TEST_F(TrainingStateTest, FsdpSavedAtFourLoadsAtTwoAndThreeAndAsReplicas) {
  RunRanks(4, [&](std::shared_ptr<ProcessGroup> g) { return TrainAndSave(g); });
  for (int world : {2, 3}) {
    RunRanks(world, [&](std::shared_ptr<ProcessGroup> g) { return Load(g); });
    const std::string tag = absl::StrCat("loaded", world);
    for (int u = 0; u < 2; ++u) {
      auto saved = ReadFloats(Path("saved", "param", u, 0));
      auto loaded = ReadFloats(Path(tag, "param", u, 0));
      ASSERT_TRUE(saved.ok() && loaded.ok());
      EXPECT_EQ(*loaded, *saved) << "unit " << u << " at world " << world;
      for (int k = 0; k < 2; ++k) {
        EXPECT_EQ(FullState(tag, world, u, k), FullState("saved", 4, u, k))
            << "unit " << u << " state " << k << " at world " << world;
      }
    }
  }
  // Replicas (DDP's layout) in this process: parameter p whole.
  auto store = FileStore::Open(store_path_);
  ASSERT_TRUE(store.ok());
  CheckpointCatalog catalog(store->get(), CheckpointPrefix("job"));
  auto reader = CheckpointReader::OpenLatest(catalog);
  ASSERT_TRUE(reader.ok() && *reader != nullptr);
  EXPECT_EQ((*reader)->world_size(), 4);
  std::vector<std::vector<float>> params;
  for (size_t size : kParamSizes) params.emplace_back(size);
  auto adam = NewAdam({.lr = 0.01f}).value();
  ASSERT_TRUE(LoadReplicaState(**reader, params, *adam).ok());
  for (int u = 0; u < 2; ++u) {
    auto saved = ReadFloats(Path("saved", "param", u, 0));
    std::vector<float> unit = params[2 * u];
    unit.insert(unit.end(), params[2 * u + 1].begin(), params[2 * u + 1].end());
    EXPECT_EQ(unit, *saved);
    for (int k = 0; k < 2; ++k) {
      std::vector<float> state = adam->ExportSlot(2 * u).value().buffers[k];
      const auto bias = adam->ExportSlot(2 * u + 1).value().buffers[k];
      state.insert(state.end(), bias.begin(), bias.end());
      EXPECT_EQ(state, FullState("saved", 4, u, k));
      EXPECT_EQ(adam->ExportSlot(2 * u).value().step, 2);
    }
  }
  // Another optimizer, or another model, is refused with the reason.
  auto sgd = NewSgd({.lr = 0.1f, .momentum = 0.9f}).value();
  absl::Status s = LoadReplicaState(**reader, params, *sgd);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), ::testing::HasSubstr("saved with optimizer adam"));
  params[1].resize(4);
  s = LoadReplicaState(**reader, params, *adam);
  EXPECT_THAT(s.message(), ::testing::HasSubstr(
                               "tensor 'param.1' has 3 elements; this model's has 4"));
}

}  // namespace
}  // namespace cohort
