#include "worker/collective/init/flight_dumper.h"

#include <signal.h>

#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/testing/in_process_store.h"

namespace cohort {
namespace {

// Polls the run's dumps until `ready` holds for the listing (the dumper
// publishes on its own thread); fails after a minute.
FlightCatalog::Listing WaitFor(
    FlightCatalog& catalog,
    const std::function<bool(const FlightCatalog::Listing&)>& ready) {
  const absl::Time deadline = absl::Now() + absl::Minutes(1);
  while (true) {
    auto listing = catalog.List();
    EXPECT_TRUE(listing.ok()) << listing.status();
    if (listing.ok() && ready(*listing)) return *listing;
    if (absl::Now() > deadline) {
      ADD_FAILURE() << "the dump never came";
      return {};
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
}

class FlightDumperTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = std::make_shared<InProcessStore>();
    recorder_ = std::make_shared<FlightRecorder>(16);
    const uint64_t a = recorder_->Queued(
        CollectiveOp::AllReduce(BufferView::Of(data_, 4), ReduceOp::kSum));
    recorder_->Started(a);
    recorder_->Ended(a, absl::OkStatus());
    const uint64_t b =
        recorder_->Queued(CollectiveOp::Broadcast(BufferView::Of(data_, 4), 1));
    recorder_->Started(b);  // Still running.
    FlightDumperOptions options;
    options.run = "job";
    options.round = 4;
    options.node = "node-a";
    auto dumper = FlightDumper::Start(store_, options);
    ASSERT_TRUE(dumper.ok()) << dumper.status();
    dumper_ = *std::move(dumper);
    FlightGroupInfo info;
    info.backend = "gloo";
    info.rank = 1;
    info.world_size = 2;
    EXPECT_EQ(dumper_->Add(recorder_, info), "0");
    // Add published the start dump before it returned.
    FlightCatalog catalog(store_.get(), "job");
    auto listing = catalog.List();
    ASSERT_TRUE(listing.ok());
    ASSERT_EQ(listing->dumps.size(), 1u);
    EXPECT_EQ(listing->dumps[0].reason(), FlightCatalog::kStartReason);
    EXPECT_EQ(listing->dumps[0].node(), "node-a");
  }

  float data_[4] = {};
  std::shared_ptr<InProcessStore> store_;
  std::shared_ptr<FlightRecorder> recorder_;
  std::unique_ptr<FlightDumper> dumper_;
};

TEST_F(FlightDumperTest, ARequestIsAnsweredWithEveryOpAndWhoDumped) {
  FlightCatalog catalog(store_.get(), "job");
  auto request = catalog.Request();
  ASSERT_TRUE(request.ok());
  auto listing = WaitFor(catalog, [&](const FlightCatalog::Listing& l) {
    return !l.dumps.empty() && l.dumps[0].request() == *request;
  });
  ASSERT_EQ(listing.dumps.size(), 1u);
  const v1::FlightDump& d = listing.dumps[0];
  EXPECT_EQ(d.reason(), "request");
  EXPECT_EQ(d.run(), "job");
  EXPECT_EQ(d.round(), 4);
  EXPECT_EQ(d.node(), "node-a");
  EXPECT_EQ(d.group(), "0");
  EXPECT_EQ(d.backend(), "gloo");
  EXPECT_EQ(d.rank(), 1);
  EXPECT_EQ(d.world_size(), 2);
  EXPECT_EQ(d.recorded(), 2u);
  ASSERT_EQ(d.ops_size(), 2);
  EXPECT_EQ(d.ops(0).op(), "AllReduce");
  EXPECT_EQ(d.ops(0).reduce(), "SUM");
  EXPECT_EQ(d.ops(0).dtype(), "f32");
  EXPECT_EQ(d.ops(0).count(), 4u);
  EXPECT_EQ(d.ops(0).state(), "done");
  EXPECT_EQ(d.ops(1).op(), "Broadcast");
  EXPECT_EQ(d.ops(1).root(), 1);
  EXPECT_EQ(d.ops(1).state(), "running");
  EXPECT_EQ(d.ops(1).ended_us(), 0);
  EXPECT_EQ(dumper_->dumps_published(), 2);  // The start dump, this one.
}

TEST_F(FlightDumperTest, AFailedOpDumpsWithTheFailure) {
  const uint64_t c = recorder_->Queued(
      CollectiveOp::AllReduce(BufferView::Of(data_, 4), ReduceOp::kSum));
  recorder_->Started(c);
  const absl::Status late = absl::DeadlineExceededError("rank 0 never came");
  recorder_->Ended(c, late);
  // The first failure's dump is made before OnOpFailure returns.
  dumper_->OnOpFailure(late);
  FlightCatalog catalog(store_.get(), "job");
  auto listing = *catalog.List();
  ASSERT_EQ(listing.dumps.size(), 1u);
  EXPECT_EQ(listing.dumps[0].reason(), "timeout");
  EXPECT_EQ(dumper_->dumps_published(), 2);
  // The next, within failure_interval, is dumped later by the thread.
  dumper_->OnOpFailure(absl::FailedPreconditionError("broken"));
  listing = WaitFor(catalog, [](const FlightCatalog::Listing& l) {
    return !l.dumps.empty() && l.dumps[0].reason() == "failed";
  });
  ASSERT_EQ(listing.dumps[0].ops_size(), 3);
  EXPECT_EQ(listing.dumps[0].ops(2).state(), "failed");
  EXPECT_NE(listing.dumps[0].ops(2).error().find("rank 0 never came"),
            std::string::npos);
}

TEST_F(FlightDumperTest, Sigusr1Dumps) {
  ASSERT_TRUE(dumper_->HandleSigusr1().ok());
  ASSERT_EQ(raise(SIGUSR1), 0);
  FlightCatalog catalog(store_.get(), "job");
  auto listing = WaitFor(catalog, [](const FlightCatalog::Listing& l) {
    return !l.dumps.empty() && l.dumps[0].reason() == "signal";
  });
  EXPECT_EQ(listing.dumps.size(), 1u);
}

TEST_F(FlightDumperTest, AGroupThatIsGoneIsNotDumped) {
  recorder_.reset();  // The dumper held it weakly: this frees it.
  ASSERT_TRUE(dumper_->DumpAll("request", 0).ok());
  EXPECT_EQ(dumper_->dumps_published(), 1);  // The start dump alone.
}

TEST_F(FlightDumperTest, ARequestMadeBeforeStartIsNotAnswered) {
  FlightCatalog catalog(store_.get(), "later");
  ASSERT_TRUE(catalog.Request().ok());
  FlightDumperOptions options;
  options.run = "later";
  auto late = FlightDumper::Start(store_, options);
  ASSERT_TRUE(late.ok());
  (*late)->Add(recorder_, FlightGroupInfo{});
  // A second request is answered, with its number: the first never was.
  ASSERT_TRUE(catalog.Request().ok());
  auto listing = WaitFor(catalog, [](const FlightCatalog::Listing& l) {
    return !l.dumps.empty() && l.dumps[0].reason() == "request";
  });
  EXPECT_EQ(listing.dumps[0].request(), 2);
}

}  // namespace
}  // namespace cohort
