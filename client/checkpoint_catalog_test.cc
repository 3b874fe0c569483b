#include "client/checkpoint_catalog.h"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/file_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cohort {
namespace {

using ::testing::HasSubstr;

class CheckpointCatalogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = absl::StrCat(::testing::TempDir(), "/catalog_", info->name());
    std::remove(path_.c_str());
    auto store = FileStore::Open(path_);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
  }

  std::string path_;
  std::unique_ptr<FileStore> store_;
};

v1::CheckpointRecord Record(int64_t step) {
  v1::CheckpointRecord r;
  r.set_step(step);
  r.set_world_size(4);
  r.set_bytes(1000 + step);
  r.set_path(absl::StrCat("/ckpt/", CheckpointFolderName(step)));
  return r;
}

// Rank `rank` of `world` holding elements [rank*per, ...) of a tensor of
// `numel`, at offset 0 of its file.
v1::CheckpointPart Part(int rank, int world, uint64_t numel) {
  const uint64_t per = (numel + world - 1) / world;
  const uint64_t start = std::min<uint64_t>(numel, rank * per);
  const uint64_t count = std::min<uint64_t>(numel, start + per) - start;
  v1::CheckpointPart part;
  part.set_rank(rank);
  part.mutable_file()->set_name(absl::StrCat("rank-", rank, ".bin"));
  part.mutable_file()->set_bytes(count * sizeof(float));
  part.mutable_file()->set_rank(rank);
  if (count > 0) {
    v1::CheckpointTensor* t = part.add_tensors();
    t->set_name("w");
    t->set_dtype("f32");
    t->add_shape(numel);
    v1::CheckpointShard* s = t->add_shards();
    s->set_file(part.file().name());
    s->set_start(start);
    s->set_count(count);
  }
  return part;
}

TEST_F(CheckpointCatalogTest, NoCheckpointMeansNoLatestAndAnEmptyList) {
  CheckpointCatalog catalog(store_.get(), CheckpointPrefix("run1"));
  auto latest = catalog.Latest();
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_FALSE(latest->has_value());
  auto list = catalog.List();
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_TRUE(list->empty());
}

TEST_F(CheckpointCatalogTest, TheLatestIsTheHighestStepCommitted) {
  CheckpointCatalog catalog(store_.get(), CheckpointPrefix("run1"));
  EXPECT_FALSE(*catalog.IsCommitted(10));
  EXPECT_THAT(catalog.WaitCommitted(10, absl::Milliseconds(10)).message(),
              HasSubstr("checkpoint of step 10: not committed after 10ms"));
  ASSERT_TRUE(catalog.Commit(Record(10)).ok());
  EXPECT_TRUE(*catalog.IsCommitted(10));
  EXPECT_TRUE(catalog.WaitCommitted(10, absl::Milliseconds(10)).ok());
  ASSERT_TRUE(catalog.Commit(Record(5)).ok());  // A slow, older committer.
  // The same record again is fine; another record for a step is refused.
  EXPECT_TRUE(catalog.Commit(Record(5)).ok());
  v1::CheckpointRecord other = Record(5);
  other.set_bytes(1);
  EXPECT_EQ(catalog.Commit(other).code(), absl::StatusCode::kAlreadyExists);
  auto latest = catalog.Latest();
  ASSERT_TRUE(latest.ok() && latest->has_value());
  EXPECT_EQ((*latest)->step(), 10);
  ASSERT_TRUE(catalog.Commit(Record(20)).ok());
  latest = catalog.Latest();
  EXPECT_EQ((*latest)->step(), 20);
  auto list = catalog.List();
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->size(), 3u);
  EXPECT_EQ((*list)[0].step(), 5);
  EXPECT_EQ((*list)[1].step(), 10);
  EXPECT_EQ((*list)[2].step(), 20);
  EXPECT_EQ((*list)[2].bytes(), 1020u);
}

TEST_F(CheckpointCatalogTest, RacingCommittersLeaveTheNewestLatest) {
  CheckpointCatalog catalog(store_.get(), CheckpointPrefix("run1"));
  std::vector<std::thread> threads;
  for (int step = 1; step <= 8; ++step) {
    threads.emplace_back([&, step] {
      auto store = FileStore::Open(path_);
      ASSERT_TRUE(store.ok());
      CheckpointCatalog mine(store->get(), CheckpointPrefix("run1"));
      EXPECT_TRUE(mine.Commit(Record(step)).ok());
    });
  }
  for (auto& t : threads) t.join();
  auto latest = catalog.Latest();
  ASSERT_TRUE(latest.ok() && latest->has_value());
  EXPECT_EQ((*latest)->step(), 8);
  EXPECT_EQ(catalog.List()->size(), 8u);
}

TEST_F(CheckpointCatalogTest, RunsDoNotSeeEachOther) {
  CheckpointCatalog a(store_.get(), CheckpointPrefix("a"));
  CheckpointCatalog b(store_.get(), CheckpointPrefix("b"));
  ASSERT_TRUE(a.Commit(Record(3)).ok());
  EXPECT_FALSE(b.Latest()->has_value());
  EXPECT_TRUE(b.List()->empty());
}

TEST_F(CheckpointCatalogTest, WaitForPartsNamesTheRanksMissing) {
  CheckpointCatalog catalog(store_.get(), CheckpointPrefix("run1"));
  for (int r : {0, 1, 3}) ASSERT_TRUE(catalog.ReportPart(7, "0", Part(r, 4, 10)).ok());
  auto parts = catalog.WaitForParts(7, "0", 4, absl::Milliseconds(50));
  ASSERT_TRUE(absl::IsDeadlineExceeded(parts.status())) << parts.status();
  EXPECT_THAT(parts.status().message(),
              HasSubstr("rank 2 of 4 had not reported"));
  ASSERT_TRUE(catalog.ReportPart(7, "0", Part(2, 4, 10)).ok());
  parts = catalog.WaitForParts(7, "0", 4, absl::Seconds(10));
  ASSERT_TRUE(parts.ok()) << parts.status();
  for (int r = 0; r < 4; ++r) EXPECT_EQ((*parts)[r].rank(), r);
  // Another step's parts, or another attempt's, are not this one's.
  auto other = catalog.WaitForParts(8, "0", 4, absl::Milliseconds(10));
  EXPECT_THAT(other.status().message(), HasSubstr("ranks 0, 1, 2, 3 of 4"));
  other = catalog.WaitForParts(7, "1", 4, absl::Milliseconds(10));
  EXPECT_THAT(other.status().message(), HasSubstr("ranks 0, 1, 2, 3 of 4"));
  ASSERT_TRUE(catalog.ForgetParts(7).ok());
  EXPECT_FALSE(catalog.WaitForParts(7, "0", 4, absl::Milliseconds(10)).ok());
}

TEST_F(CheckpointCatalogTest, WaitForPartsBlocksUntilTheLastRankReports) {
  CheckpointCatalog catalog(store_.get(), CheckpointPrefix("run1"));
  ASSERT_TRUE(catalog.ReportPart(1, "0", Part(0, 2, 10)).ok());
  std::thread late([&] {
    auto store = FileStore::Open(path_);
    ASSERT_TRUE(store.ok());
    CheckpointCatalog(store->get(), CheckpointPrefix("run1"))
        .ReportPart(1, "0", Part(1, 2, 10))
        .IgnoreError();
  });
  auto parts = catalog.WaitForParts(1, "0", 2, absl::Seconds(60));
  late.join();
  ASSERT_TRUE(parts.ok()) << parts.status();
  EXPECT_EQ((*parts)[1].tensors(0).shards(0).start(), 5u);
}

TEST(MergeCheckpointPartsTest, MergesShardsInOrderAndRoundTripsJson) {
  std::vector<v1::CheckpointPart> parts;
  // Ranks listed out of order; at world 4 over 10 elements rank 3 holds 1.
  for (int r : {2, 0, 3, 1}) parts.push_back(Part(r, 4, 10));
  auto m = MergeCheckpointParts(42, 4, parts, absl::FromUnixMillis(1234));
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->tensors_size(), 1);
  const v1::CheckpointTensor& t = m->tensors(0);
  ASSERT_EQ(t.shards_size(), 4);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(t.shards(i).start(), 3u * i);
  EXPECT_EQ(t.shards(3).count(), 1u);
  const std::string json = CheckpointMetadataToJson(*m);
  EXPECT_THAT(json, HasSubstr("\"worldSize\": 4"));
  EXPECT_THAT(json, HasSubstr("\"format\": \"cohort-checkpoint/1\""));
  auto back = CheckpointMetadataFromJson(json);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->SerializeAsString(), m->SerializeAsString());
}

TEST(MergeCheckpointPartsTest, RejectsGapsOverlapsAndDisagreements) {
  std::vector<v1::CheckpointPart> parts = {Part(0, 2, 10), Part(1, 2, 10)};
  auto gap = parts;
  gap[1].mutable_tensors(0)->mutable_shards(0)->set_start(6);
  gap[1].mutable_tensors(0)->mutable_shards(0)->set_count(4);
  EXPECT_THAT(MergeCheckpointParts(1, 2, gap, absl::Now()).status().message(),
              HasSubstr("a gap between shards at element 5"));
  auto overlap = parts;
  overlap[1].mutable_tensors(0)->mutable_shards(0)->set_start(4);
  overlap[1].mutable_tensors(0)->mutable_shards(0)->set_count(6);
  EXPECT_THAT(
      MergeCheckpointParts(1, 2, overlap, absl::Now()).status().message(),
      HasSubstr("shards overlap at element 4"));
  auto shape = parts;
  shape[1].mutable_tensors(0)->set_shape(0, 11);
  EXPECT_THAT(MergeCheckpointParts(1, 2, shape, absl::Now()).status().message(),
              HasSubstr("ranks 0 and 1 disagree on tensor 'w'"));
  auto short_file = parts;
  short_file[1].mutable_file()->set_bytes(4);
  EXPECT_THAT(
      MergeCheckpointParts(1, 2, short_file, absl::Now()).status().message(),
      HasSubstr("not a data file of this checkpoint or is shorter"));
}

TEST(CheckpointMetadataFromJsonTest, SaysWhatIsWrong) {
  EXPECT_THAT(CheckpointMetadataFromJson("{not json").status().message(),
              HasSubstr("metadata.json does not parse"));
  EXPECT_THAT(CheckpointMetadataFromJson(R"({"format": "other/9"})")
                  .status()
                  .message(),
              HasSubstr("format 'other/9' is not cohort-checkpoint/1"));
}

}  // namespace
}  // namespace cohort
