#include "client/flight_catalog.h"

#include <atomic>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "tests/testing/in_process_store.h"

namespace cohort {
namespace {

v1::FlightDump Dump(int rank, int world, int64_t request,
                    const std::string& run = "job") {
  v1::FlightDump dump;
  dump.set_run(run);
  dump.set_rank(rank);
  dump.set_world_size(world);
  dump.set_group("0");
  dump.set_round(1);
  dump.set_request(request);
  return dump;
}

TEST(FlightCatalogTest, RequestsCountFromOne) {
  InProcessStore store;
  FlightCatalog catalog(&store, "job");
  EXPECT_EQ(*catalog.CurrentRequest(), 0);
  EXPECT_EQ(*catalog.Request(), 1);
  EXPECT_EQ(*catalog.Request(), 2);
  EXPECT_EQ(*catalog.CurrentRequest(), 2);
}

TEST(FlightCatalogTest, AWatcherSeesEachRequest) {
  InProcessStore store;
  FlightCatalog catalog(&store, "job");
  std::atomic<int64_t> seen{0};
  absl::Notification second;
  auto watch = catalog.WatchRequests([&](int64_t n) {
    seen = n;
    if (n == 2) second.Notify();
  });
  ASSERT_TRUE(watch.ok()) << watch.status();
  ASSERT_TRUE(catalog.Request().ok());
  ASSERT_TRUE(catalog.Request().ok());
  second.WaitForNotification();
  EXPECT_EQ(seen.load(), 2);
}

TEST(FlightCatalogTest, ListReturnsPublishedDumpsAndNamesGarbage) {
  InProcessStore store;
  FlightCatalog catalog(&store, "job");
  ASSERT_TRUE(catalog.Publish(Dump(1, 2, 0)).ok());
  ASSERT_TRUE(catalog.Publish(Dump(0, 2, 0)).ok());
  ASSERT_TRUE(store.Set("runs/job/flight/dumps/000000000001/0/9", "junk").ok());
  ASSERT_TRUE(store.Set("runs/job/flight/answers/000000000001/0/9", "junk").ok());
  auto listing = catalog.List();
  ASSERT_TRUE(listing.ok()) << listing.status();
  ASSERT_EQ(listing->dumps.size(), 2u);
  EXPECT_EQ(listing->dumps[0].rank(), 0);
  EXPECT_EQ(listing->dumps[1].rank(), 1);
  ASSERT_EQ(listing->unreadable.size(), 1u);
  EXPECT_NE(listing->unreadable[0].find("/0/9"), std::string::npos);
  auto answers = catalog.ListAnswers();
  ASSERT_TRUE(answers.ok());
  EXPECT_EQ(answers->answers.size(), 2u);
  ASSERT_EQ(answers->unreadable.size(), 1u);
  EXPECT_NE(answers->unreadable[0].find("answers/000000000001/0/9"),
            std::string::npos);
}

TEST(FlightCatalogTest, EachDumpHasASmallAnswerAndRoundsListApart) {
  InProcessStore store;
  FlightCatalog catalog(&store, "job");
  auto d = Dump(2, 3, 5);
  d.set_reason("request");
  ASSERT_TRUE(catalog.Publish(d).ok());
  auto later = Dump(0, 1, 6);
  later.set_round(2);
  ASSERT_TRUE(catalog.Publish(later).ok());
  auto answers = catalog.ListAnswers(1);
  ASSERT_TRUE(answers.ok()) << answers.status();
  ASSERT_EQ(answers->answers.size(), 1u);
  EXPECT_EQ(answers->answers[0].rank, 2);
  EXPECT_EQ(answers->answers[0].request, 5);
  EXPECT_EQ(answers->answers[0].reason, "request");
  EXPECT_EQ(answers->answers[0].world_size, 3);
  EXPECT_EQ(catalog.ListAnswers()->answers.size(), 2u);
  auto round2 = catalog.List(2);
  ASSERT_TRUE(round2.ok());
  ASSERT_EQ(round2->dumps.size(), 1u);
  EXPECT_EQ(round2->dumps[0].rank(), 0);
}

TEST(FlightCatalogTest, ListReadsManyDumpsInBatches) {
  InProcessStore store;
  FlightCatalog catalog(&store, "job");
  for (int r = 0; r < 40; ++r) ASSERT_TRUE(catalog.Publish(Dump(r, 40, 0)).ok());
  auto listing = catalog.List();
  ASSERT_TRUE(listing.ok()) << listing.status();
  EXPECT_EQ(listing->dumps.size(), 40u);
}

TEST(FlightCatalogTest, APublishToAnotherRunIsRefused) {
  InProcessStore store;
  FlightCatalog catalog(&store, "job");
  EXPECT_EQ(catalog.Publish(Dump(0, 1, 0, "other")).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(FlightCatalogTest, WaitForAnswersNamesTheRanksThatDidNotAnswer) {
  InProcessStore store;
  FlightCatalog catalog(&store, "job");
  ASSERT_TRUE(catalog.Publish(Dump(0, 3, 1)).ok());
  ASSERT_TRUE(catalog.Publish(Dump(1, 3, 0)).ok());  // An older request's.
  auto answers = catalog.WaitForAnswers(1, absl::Milliseconds(100));
  ASSERT_TRUE(answers.ok()) << answers.status();
  ASSERT_EQ(answers->missing.size(), 1u);
  EXPECT_EQ(answers->missing[0], "group 0: ranks 1,2");

  ASSERT_TRUE(catalog.Publish(Dump(1, 3, 1)).ok());
  ASSERT_TRUE(catalog.Publish(Dump(2, 3, 1)).ok());
  answers = catalog.WaitForAnswers(1, absl::Seconds(60));
  ASSERT_TRUE(answers.ok()) << answers.status();
  EXPECT_TRUE(answers->missing.empty());
  EXPECT_EQ(answers->listing.dumps.size(), 3u);
}

}  // namespace
}  // namespace cohort
