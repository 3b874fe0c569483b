#include "worker/collective/nccl/nccl_bootstrap.h"

#include <memory>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/in_process_store.h"
#include "worker/collective/nccl/fake_nccl_api.h"

namespace cohort {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(NcclRootRanks, OneRootUpToRanksPerRootThenEvenlySpread) {
  EXPECT_THAT(NcclRootRanks(1, 128), ElementsAre(0));
  EXPECT_THAT(NcclRootRanks(128, 128), ElementsAre(0));
  EXPECT_THAT(NcclRootRanks(129, 128), ElementsAre(0, 65));
  EXPECT_THAT(NcclRootRanks(300, 128), ElementsAre(0, 100, 200));
  EXPECT_THAT(NcclRootRanks(1024, 128),
              ElementsAre(0, 128, 256, 384, 512, 640, 768, 896));
  EXPECT_THAT(NcclRootRanks(5, 2), ElementsAre(0, 2, 4));
}

// Runs ExchangeNcclUniqueIds on `size` threads, each with its own fake api.
struct Exchanged {
  std::vector<absl::StatusOr<std::vector<NcclUniqueId>>> ids;
  std::vector<std::unique_ptr<FakeNcclApi>> apis;
};

Exchanged Exchange(Store& store, const std::string& comm, int size,
                   int ranks_per_root,
                   std::shared_ptr<FakeNcclWorld> world = NewFakeNcclWorld()) {
  Exchanged out;
  out.ids.resize(size, absl::UnknownError("not run"));
  for (int r = 0; r < size; ++r) {
    out.apis.push_back(std::make_unique<FakeNcclApi>(world));
  }
  std::vector<std::thread> threads;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      out.ids[r] = ExchangeNcclUniqueIds(*out.apis[r], store, comm, r, size,
                                         ranks_per_root, deadline);
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

TEST(ExchangeNcclUniqueIds, RankZeroPublishesOneIdEveryRankReads) {
  InProcessStore store;
  Exchanged x = Exchange(store, "comm/0", 4, 128);
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(x.ids[r].ok()) << x.ids[r].status();
    ASSERT_EQ(x.ids[r]->size(), 1u);
    EXPECT_EQ((*x.ids[r])[0].bytes, (*x.ids[0])[0].bytes);
    EXPECT_EQ(x.apis[r]->unique_ids(), r == 0 ? 1 : 0);
    EXPECT_TRUE(*store.Check({NcclArrivedKey("comm/0", r)}));
  }
  EXPECT_TRUE(*store.Check({"comm/0/unique_id/0"}));
}

TEST(ExchangeNcclUniqueIds, SeveralRootsAboveRanksPerRoot) {
  InProcessStore store;
  Exchanged x = Exchange(store, "comm/3", 6, 2);
  for (int r = 0; r < 6; ++r) {
    ASSERT_TRUE(x.ids[r].ok()) << x.ids[r].status();
    ASSERT_EQ(x.ids[r]->size(), 3u);
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ((*x.ids[r])[i].bytes, (*x.ids[0])[i].bytes);
    }
    // Roots 0, 2 and 4 each made one id.
    EXPECT_EQ(x.apis[r]->unique_ids(), r % 2 == 0 ? 1 : 0) << r;
  }
  EXPECT_NE((*x.ids[0])[0].bytes, (*x.ids[0])[1].bytes);
  EXPECT_TRUE(*store.Check(
      {"comm/3/unique_id/0", "comm/3/unique_id/1", "comm/3/unique_id/2"}));
}

TEST(ExchangeNcclUniqueIds, EachCommunicatorHasItsOwnKeys) {
  InProcessStore store;
  auto world = NewFakeNcclWorld();
  Exchanged first = Exchange(store, "comm/0", 2, 128, world);
  Exchanged second = Exchange(store, "comm/1", 2, 128, world);
  ASSERT_TRUE(first.ids[1].ok());
  ASSERT_TRUE(second.ids[1].ok());
  EXPECT_NE((*first.ids[1])[0].bytes, (*second.ids[1])[0].bytes);
}

TEST(ExchangeNcclUniqueIds, NamesTheRootThatNeverPublished) {
  InProcessStore store;
  auto world = NewFakeNcclWorld();
  FakeNcclApi api(world);
  const absl::Time start = absl::Now();
  // Rank 2 of 4 with 2 ranks per root: roots are 0 and 2; rank 0 never
  // comes. The deadline is the only one: an exchange that ignored it would
  // hang the test.
  absl::StatusOr<std::vector<NcclUniqueId>> ids = ExchangeNcclUniqueIds(
      api, store, "comm/0", 2, 4, 2, start + absl::Milliseconds(300));
  ASSERT_EQ(ids.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(ids.status().message(),
              HasSubstr("rank 0 (root 0 of 2, key 'comm/0/unique_id/0')"));
  EXPECT_THAT(ids.status().message(), ::testing::Not(HasSubstr("root 1 of")));
}

TEST(ExchangeNcclUniqueIds, RefusesAValueThatIsNotAnId) {
  InProcessStore store;
  ASSERT_TRUE(store.Set("comm/0/unique_id/0", "short").ok());
  auto world = NewFakeNcclWorld();
  FakeNcclApi api(world);
  absl::StatusOr<std::vector<NcclUniqueId>> ids = ExchangeNcclUniqueIds(
      api, store, "comm/0", 1, 2, 128, absl::Now() + absl::Seconds(5));
  EXPECT_EQ(ids.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(ids.status().message(), HasSubstr("holds 5 bytes"));
}

TEST(NcclMissingRanks, TheRanksWithoutAnArrivalKey) {
  InProcessStore store;
  ASSERT_TRUE(store.Set(NcclArrivedKey("comm/0", 0), "1").ok());
  ASSERT_TRUE(store.Set(NcclArrivedKey("comm/0", 2), "1").ok());
  EXPECT_THAT(NcclMissingRanks(store, "comm/0", 4), ElementsAre(1, 3));
}

}  // namespace
}  // namespace cohort
