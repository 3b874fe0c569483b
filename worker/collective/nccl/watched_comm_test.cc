#include "worker/collective/nccl/watched_comm.h"

#include <memory>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/collective/nccl/fake_nccl_api.h"

namespace cohort {
namespace {

using ::testing::Contains;
using ::testing::HasSubstr;

// Records what the watchdog reports.
struct Reports {
  absl::Mutex mu;
  std::vector<absl::Status> statuses;
  WatchdogOptions Options() {
    WatchdogOptions options;
    options.interval = absl::Milliseconds(10);
    options.on_abort = [this](const absl::Status& s) {
      absl::MutexLock lock(&mu);
      statuses.push_back(s);
    };
    return options;
  }
  std::vector<absl::Status> Get() {
    absl::MutexLock lock(&mu);
    return statuses;
  }
  // The statuses once there are `n` (the watchdog reports an abort just
  // after it is visible); fewer if not after 30 s.
  std::vector<absl::Status> Await(size_t n) {
    absl::MutexLock lock(&mu);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      return statuses.size() >= n;
    };
    mu.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(30));
    return statuses;
  }
};

std::unique_ptr<NcclCommunicator> Init(FakeNcclApi& api, int nranks, int rank,
                                       const NcclUniqueId& id) {
  return std::move(api.InitRank(0, nranks, rank, {id})).value();
}

TEST(WatchedComm, CallsRunAndEventsComplete) {
  auto world = NewFakeNcclWorld();
  FakeNcclApi api(world);
  Reports reports;
  WatchedComm comm(Init(api, 1, 0, *api.GetUniqueId()), "test comm",
                   reports.Options());
  float x = 2;
  ASSERT_TRUE(comm.Call([&](NcclCommunicator& c) {
                    return c.AllReduce(&x, &x, 1, Dtype::kF32, ReduceOp::kSum);
                  })
                  .ok());
  std::unique_ptr<NcclEvent> event;
  ASSERT_TRUE(comm.Call([&](NcclCommunicator& c) {
                    event = std::move(c.RecordEvent()).value();
                    return absl::OkStatus();
                  })
                  .ok());
  EXPECT_TRUE(comm.Await(*event).ok());
  EXPECT_EQ(x, 2);
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_TRUE(comm.aborted().ok());
  EXPECT_TRUE(reports.Get().empty());
}

TEST(WatchedComm, AbortsOnAnInjectedAsyncErrorAndReportsOnce) {
  auto world = NewFakeNcclWorld();
  FakeNcclApi api(world);
  Reports reports;
  WatchedComm comm(Init(api, 1, 0, *api.GetUniqueId()), "rank 0 of 1",
                   reports.Options());
  api.InjectAsyncError(absl::UnavailableError(
      "remote process exited or there was a network error"));
  // Nothing else aborts it; the report comes just before the abort.
  ASSERT_EQ(reports.Await(1).size(), 1u) << "no abort reported in 30 s";
  absl::Status why = comm.aborted();
  EXPECT_EQ(why.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(why.message(), HasSubstr("rank 0 of 1"));
  EXPECT_THAT(why.message(), HasSubstr("asynchronous error"));
  EXPECT_THAT(why.message(), HasSubstr("remote process exited"));
  EXPECT_EQ(api.AwaitAborts(1), 1);
  EXPECT_EQ(reports.Get()[0], why);
  // Every later call returns the same status without touching NCCL.
  EXPECT_EQ(comm.Call([](NcclCommunicator&) { return absl::OkStatus(); }), why);
  EXPECT_EQ(api.AwaitAborts(1), 1);
  EXPECT_EQ(reports.Get().size(), 1u);
}

TEST(WatchedComm, AbortsAnOpPastItsDeadline) {
  auto world = NewFakeNcclWorld();
  FakeNcclApi api0(world), api1(world);
  const NcclUniqueId id = *api0.GetUniqueId();
  auto comm1 = Init(api1, 2, 1, id);  // Joins, then never calls the op.
  Reports reports;
  WatchedComm comm(Init(api0, 2, 0, id), "rank 0 of 2", reports.Options());
  float x = 1;
  WatchedComm::Watch watch(comm, "AllReduce SUM of 1 f32",
                           absl::Milliseconds(100),
                           absl::Now() + absl::Milliseconds(100));
  std::unique_ptr<NcclEvent> event;
  ASSERT_TRUE(comm.Call([&](NcclCommunicator& c) {
                    absl::Status s =
                        c.AllReduce(&x, &x, 1, Dtype::kF32, ReduceOp::kSum);
                    event = std::move(c.RecordEvent()).value();
                    return s;
                  })
                  .ok());
  // Await has no timeout of its own: only the watchdog ends it.
  absl::Status status = comm.Await(*event);
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(
      status.message(),
      HasSubstr("AllReduce SUM of 1 f32 did not complete within 100ms"));
  EXPECT_THAT(status.message(), HasSubstr("rank 0 of 2"));
  EXPECT_THAT(api0.calls(), Contains("Abort"));
  EXPECT_EQ(reports.Await(1).size(), 1u);
}

TEST(WatchedComm, AbortsAnInitThatNeverCompletes) {
  auto world = NewFakeNcclWorld();
  FakeNcclApi api(world);
  Reports reports;
  // Rank 0 of 2: rank 1 never comes, so the init stays in progress.
  WatchedComm comm(Init(api, 2, 0, *api.GetUniqueId()), "rank 0 of 2",
                   reports.Options());
  WatchedComm::Watch watch(comm, "NCCL init", absl::Milliseconds(100),
                           absl::Now() + absl::Milliseconds(100));
  absl::Status status =
      comm.Call([](NcclCommunicator&) { return absl::OkStatus(); });
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(status.message(), HasSubstr("NCCL init did not complete"));
  EXPECT_EQ(api.AwaitAborts(1), 1);
}

TEST(WatchedComm, AFailedCallAbortsTheCommunicator) {
  auto world = NewFakeNcclWorld();
  FakeNcclApi api(world);
  Reports reports;
  WatchedComm comm(Init(api, 1, 0, *api.GetUniqueId()), "rank 0 of 1",
                   reports.Options());
  absl::Status status = comm.Call([](NcclCommunicator&) {
    return absl::InternalError("ncclAllReduce: invalid usage");
  });
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(status.message(), HasSubstr("rank 0 of 1: ncclAllReduce"));
  EXPECT_EQ(comm.aborted(), status);
  EXPECT_EQ(api.AwaitAborts(1), 1);
  ASSERT_EQ(reports.Get().size(), 1u);
  EXPECT_EQ(reports.Get()[0], status);
}

// Found on an H200: ncclCommAbort waits while the communicator's stream
// waits for work outside NCCL (here, a caller's stream held by a host
// function). The op's wait must end with the watchdog's status at the
// deadline all the same, not when the abort returns.
TEST(WatchedComm, AnOpFailsAtItsDeadlineWhileTheAbortIsStillBlocked) {
  auto world = NewFakeNcclWorld();
  FakeNcclApi api0(world), api1(world);
  const NcclUniqueId id = *api0.GetUniqueId();
  auto comm1 = Init(api1, 2, 1, id);  // Joins, then never calls the op.
  api0.HoldAborts();
  Reports reports;
  {
    WatchedComm comm(Init(api0, 2, 0, id), "rank 0 of 2", reports.Options());
    float x = 1;
    WatchedComm::Watch watch(comm, "AllReduce SUM of 1 f32",
                             absl::Milliseconds(100),
                             absl::Now() + absl::Milliseconds(100));
    std::unique_ptr<NcclEvent> event;
    ASSERT_TRUE(comm.Call([&](NcclCommunicator& c) {
                      absl::Status s =
                          c.AllReduce(&x, &x, 1, Dtype::kF32, ReduceOp::kSum);
                      event = std::move(c.RecordEvent()).value();
                      return s;
                    })
                    .ok());
    absl::Status status = comm.Await(*event);
    EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
    // The watchdog is inside the abort, which has not returned.
    EXPECT_EQ(api0.AwaitAborts(1), 1);
    EXPECT_EQ(reports.Await(1).size(), 1u);
    // Later calls and status reads do not wait for it either.
    EXPECT_EQ(comm.Call([](NcclCommunicator&) { return absl::OkStatus(); }),
              status);
    EXPECT_EQ(comm.aborted(), status);
    api0.ReleaseAborts();
  }  // The destructor waits for the watchdog, and so for the abort.
  EXPECT_EQ(api0.aborts(), 1);
}

}  // namespace
}  // namespace cohort
