#include "worker/checkpoint/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/file_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/collective/testing/ranks.h"

namespace cohort {
namespace {

using ::testing::HasSubstr;

// The values every test saves: tensor "a" (10 elements), "b" (3 x 5) and
// "count" (one element, rank 0's), each element a function of its index.
float A(uint64_t i) { return 0.5f * i + 1.0f; }
float B(uint64_t i) { return -1.0f * i - 0.25f; }

std::vector<float> Values(float (*f)(uint64_t), ElementRange r) {
  std::vector<float> v;
  for (uint64_t i = r.start; i < r.start + r.count; ++i) v.push_back(f(i));
  return v;
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::TempPath("ckpt");
    store_path_ = testing::TempPath("store");
  }

  std::unique_ptr<FileStore> OpenStore() const {
    auto store = FileStore::Open(store_path_);
    EXPECT_TRUE(store.ok()) << store.status();
    return store.ok() ? *std::move(store) : nullptr;
  }

  // Rank `rank` of `world` saves step `step` of the values above, split
  // evenly; rank 0 also saves "count".
  absl::Status SaveAs(int rank, int world, int64_t step, bool async,
                      absl::Duration timeout = absl::Seconds(60)) const {
    std::unique_ptr<FileStore> store = OpenStore();
    CheckpointCatalog catalog(store.get(), CheckpointPrefix("job"));
    auto writer = CheckpointWriter::Create({.dir = dir_,
                                            .rank = rank,
                                            .world_size = world,
                                            .catalog = &catalog,
                                            .commit_timeout = timeout});
    if (!writer.ok()) return writer.status();
    const ElementRange ra = EvenShard(10, rank, world);
    const ElementRange rb = EvenShard(15, rank, world);
    std::vector<float> a = Values(A, ra), b = Values(B, rb);
    std::vector<float> count = {static_cast<float>(step)};
    std::vector<ShardToSave> shards = {{"a", {10}, ra.start, a},
                                       {"b", {3, 5}, rb.start, b}};
    if (rank == 0) shards.push_back({"count", {1}, 0, count});
    const std::map<std::string, std::string> attributes = {
        {"trainer", "checkpoint_test"}};
    if (!async) return (*writer)->Save(step, shards, attributes);
    if (absl::Status s = (*writer)->SaveAsync(step, shards, attributes);
        !s.ok()) {
      return s;
    }
    // The save owns a copy: what the caller does next cannot change it.
    std::fill(a.begin(), a.end(), 1e9f);
    std::fill(b.begin(), b.end(), 1e9f);
    return (*writer)->Wait();
  }

  void SaveAtWorld(int world, int64_t step, bool async) {
    testing::RunRanks(world, [&](std::shared_ptr<ProcessGroup> group) {
      return SaveAs(group->rank(), world, step, async);
    });
  }

  // Every rank of `world` reads its even shard of "a" and "b" from the
  // latest checkpoint and finds the values saved.
  void ExpectLoadsAtWorld(int world, int64_t step) {
    std::unique_ptr<FileStore> store = OpenStore();
    CheckpointCatalog catalog(store.get(), CheckpointPrefix("job"));
    auto reader = CheckpointReader::OpenLatest(catalog);
    ASSERT_TRUE(reader.ok()) << reader.status();
    ASSERT_NE(*reader, nullptr);
    EXPECT_EQ((*reader)->step(), step);
    for (int rank = 0; rank < world; ++rank) {
      for (auto [name, f, numel] :
           {std::make_tuple("a", A, uint64_t{10}), std::make_tuple("b", B, uint64_t{15})}) {
        const ElementRange r = EvenShard(numel, rank, world);
        std::vector<float> got(r.count);
        ASSERT_TRUE((*reader)->Read(name, r.start, absl::MakeSpan(got)).ok());
        EXPECT_EQ(got, Values(f, r)) << name << " at rank " << rank << " of " << world;
      }
    }
    float count = 0;
    ASSERT_TRUE((*reader)->Read("count", 0, absl::MakeSpan(&count, 1)).ok());
    EXPECT_EQ(count, static_cast<float>(step));
    EXPECT_EQ((*reader)->metadata().attributes().at("trainer"), "checkpoint_test");
  }

  std::string dir_;
  std::string store_path_;
};

TEST(EvenShardTest, SplitsAsFsdpPadsAFlatUnit) {
  // 10 elements at world 4: padded to 12, 3 per rank, the last holds 1.
  EXPECT_EQ(EvenShard(10, 0, 4).start, 0u);
  EXPECT_EQ(EvenShard(10, 3, 4).start, 9u);
  EXPECT_EQ(EvenShard(10, 3, 4).count, 1u);
  // 2 elements at world 4: ranks 2 and 3 hold nothing.
  EXPECT_EQ(EvenShard(2, 2, 4).count, 0u);
  EXPECT_EQ(EvenShard(2, 3, 4).start, 2u);
}

TEST(SplitFlatRangeTest, NamesEachTensorsPieceOfARange) {
  // Tensors of 4, 0 and 3 elements: the concatenation is 7 long.
  const std::vector<size_t> sizes = {4, 0, 3};
  std::vector<FlatPiece> pieces = SplitFlatRange(sizes, 2, 4);  // [2, 6)
  ASSERT_EQ(pieces.size(), 2u);
  EXPECT_EQ(pieces[0].tensor, 0);
  EXPECT_EQ(pieces[0].start, 2u);
  EXPECT_EQ(pieces[0].offset, 0u);
  EXPECT_EQ(pieces[0].count, 2u);
  EXPECT_EQ(pieces[1].tensor, 2);
  EXPECT_EQ(pieces[1].start, 0u);
  EXPECT_EQ(pieces[1].offset, 2u);
  EXPECT_EQ(pieces[1].count, 2u);
  EXPECT_TRUE(SplitFlatRange(sizes, 7, 0).empty());
  EXPECT_EQ(SplitFlatRange(sizes, 0, 7).size(), 2u);
}

TEST_F(CheckpointTest, SavedAtFourLoadsAtEveryOtherWorldSize) {
  SaveAtWorld(4, 100, /*async=*/false);
  for (int world : {1, 2, 3, 4, 5}) ExpectLoadsAtWorld(world, 100);
  // The folder holds one file per rank and the metadata, nothing else.
  std::unique_ptr<FileStore> store = OpenStore();
  CheckpointCatalog catalog(store.get(), CheckpointPrefix("job"));
  auto list = catalog.List();
  ASSERT_TRUE(list.ok() && list->size() == 1u);
  EXPECT_EQ((*list)[0].world_size(), 4);
  EXPECT_EQ((*list)[0].bytes(), (10 + 15 + 1) * sizeof(float));
  EXPECT_EQ((*list)[0].path(), dir_ + "/step-000000000100");
  auto reader = CheckpointReader::Open((*list)[0].path());
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_TRUE((*reader)->Verify().ok());
  EXPECT_EQ((*reader)->metadata().files_size(), 4);
}

TEST_F(CheckpointTest, AsyncSaveKeepsACopyAndCommits) {
  SaveAtWorld(3, 7, /*async=*/true);
  ExpectLoadsAtWorld(2, 7);
}

TEST_F(CheckpointTest, ANewerCheckpointBecomesTheLatest) {
  SaveAtWorld(2, 1, false);
  SaveAtWorld(3, 2, true);
  ExpectLoadsAtWorld(4, 2);
  std::unique_ptr<FileStore> store = OpenStore();
  CheckpointCatalog catalog(store.get(), CheckpointPrefix("job"));
  EXPECT_EQ(catalog.List()->size(), 2u);
}

TEST_F(CheckpointTest, ARankThatNeverWritesLeavesThePreviousLatest) {
  SaveAtWorld(2, 1, false);
  // Step 2 at world 2: rank 1 never saves; rank 0 gives up waiting.
  absl::Status s = SaveAs(0, 2, 2, false, absl::Milliseconds(300));
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("rank 1 of 2 had not reported"));
  ExpectLoadsAtWorld(2, 1);
  std::unique_ptr<FileStore> store = OpenStore();
  CheckpointCatalog catalog(store.get(), CheckpointPrefix("job"));
  EXPECT_EQ(catalog.List()->size(), 1u);
  // The other ranks learn it as well: nothing commits step 2.
  s = SaveAs(1, 2, 3, false, absl::Milliseconds(300));
  EXPECT_THAT(s.message(), HasSubstr("checkpoint of step 3: not committed"));
}

TEST_F(CheckpointTest, ACommittedStepIsNeverOverwritten) {
  SaveAtWorld(1, 5, false);
  absl::Status s = SaveAs(0, 1, 5, false);
  EXPECT_TRUE(absl::IsAlreadyExists(s)) << s;
  ExpectLoadsAtWorld(1, 5);
}

TEST_F(CheckpointTest, DamageIsFoundAndNamed) {
  SaveAtWorld(2, 9, false);
  const std::string folder = dir_ + "/step-000000000009";
  // Flip one byte of rank 1's file (it holds a[5..9] and b[8..14]).
  const std::string file = folder + "/rank-00001.bin";
  const int fd = open(file.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  char byte = 0;
  ASSERT_EQ(pread(fd, &byte, 1, 3), 1);
  byte ^= 0x40;
  ASSERT_EQ(pwrite(fd, &byte, 1, 3), 1);
  close(fd);
  auto reader = CheckpointReader::Open(folder);
  ASSERT_TRUE(reader.ok()) << reader.status();
  absl::Status verified = (*reader)->Verify();
  EXPECT_TRUE(absl::IsDataLoss(verified)) << verified;
  EXPECT_THAT(verified.message(), HasSubstr("rank-00001.bin fails its CRC-32"));
  EXPECT_THAT(verified.message(), HasSubstr("tensor 'a'"));
  // Rank 0's half reads as before; a range that touches the damage fails.
  std::vector<float> head(5);
  EXPECT_TRUE((*reader)->Read("a", 0, absl::MakeSpan(head)).ok());
  std::vector<float> tail(2);
  EXPECT_TRUE(absl::IsDataLoss((*reader)->Read("a", 4, absl::MakeSpan(tail))));
  // Past the end, and a tensor that is not there.
  EXPECT_TRUE(absl::IsOutOfRange((*reader)->Read("b", 14, absl::MakeSpan(tail))));
  EXPECT_TRUE(absl::IsNotFound((*reader)->Read("c", 0, absl::MakeSpan(tail))));
  // A folder without metadata.json.
  auto none = CheckpointReader::Open(dir_ + "/step-000000000010");
  EXPECT_TRUE(absl::IsNotFound(none.status())) << none.status();
  EXPECT_THAT(none.status().message(), HasSubstr("metadata.json"));
}

TEST_F(CheckpointTest, BadArgumentsAreRefused) {
  std::unique_ptr<FileStore> store = OpenStore();
  CheckpointCatalog catalog(store.get(), CheckpointPrefix("job"));
  EXPECT_TRUE(absl::IsInvalidArgument(
      CheckpointWriter::Create({.dir = dir_, .rank = 2, .world_size = 2,
                                .catalog = &catalog})
          .status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      CheckpointWriter::Create({.dir = "", .catalog = &catalog}).status()));
  auto writer = CheckpointWriter::Create({.dir = dir_, .catalog = &catalog});
  ASSERT_TRUE(writer.ok());
  std::vector<float> three = {1, 2, 3};
  absl::Status s = (*writer)->Save(1, {{"a", {2}, 0, three}});
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("does not fit its 2 elements"));
  // Shards that leave a gap are refused at the commit, naming the tensor.
  s = (*writer)->Save(1, {{"a", {4}, 0, absl::MakeSpan(three).subspan(0, 2)}});
  EXPECT_THAT(s.message(), HasSubstr("tensor 'a': shards cover 2 of its 4"));
  EXPECT_FALSE(catalog.Latest()->has_value());
}

}  // namespace
}  // namespace cohort
