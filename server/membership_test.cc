#include "server/membership.h"

#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "store/kv_engine.h"

namespace cohort::server {
namespace {

using ::testing::HasSubstr;

class MembershipTest : public ::testing::Test {
 protected:
  int64_t Join(const std::string& name, int rank, int64_t interval_ms = 1000) {
    v1::JoinGroupRequest req;
    req.set_group("job");
    req.set_name(name);
    req.set_rank(rank);
    req.set_host("host-" + name);
    req.set_heartbeat_interval_ms(interval_ms);
    req.set_missed_heartbeats(3);
    absl::StatusOr<v1::JoinGroupResponse> r = members_.Join(req);
    EXPECT_TRUE(r.ok()) << r.status();
    return r->incarnation();
  }

  struct Arrival {
    absl::Notification done;
    absl::StatusOr<int64_t> result;
  };
  Arrival& Arrive(const std::string& name, int64_t incarnation,
                  const std::string& id, int64_t timeout_ms = 10000) {
    auto& a = arrivals_.emplace_back(std::make_unique<Arrival>());
    Arrival* raw = a.get();
    v1::BarrierRequest req;
    req.set_group("job");
    req.set_barrier_id(id);
    req.set_name(name);
    req.set_incarnation(incarnation);
    req.set_timeout_ms(timeout_ms);
    members_.Barrier(req, [raw](absl::StatusOr<int64_t> r) {
      raw->result = r;
      raw->done.Notify();
    });
    return *raw;
  }

  std::vector<std::string> Live() {
    v1::ListMembersRequest req;
    req.set_group("job");
    std::vector<std::string> names;
    absl::StatusOr<v1::ListMembersResponse> live = members_.List(req);
    for (const auto& m : live->members()) names.push_back(m.name());
    return names;
  }

  // Arrivals outlive the membership, which fails pending barriers on exit.
  std::vector<std::unique_ptr<Arrival>> arrivals_;
  store::KvStore store_{store::NewMemoryEngine()};
  Membership members_{&store_, absl::Milliseconds(10)};
};

TEST_F(MembershipTest, MissedHeartbeatsFailAMember) {
  const int64_t a = Join("a", 0, 50);
  Join("b", 1, 1000);
  EXPECT_THAT(Live(), ::testing::ElementsAre("a", "b"));
  for (int i = 0; i < 5; ++i) {
    v1::HeartbeatRequest hb;
    hb.set_group("job");
    hb.set_name("a");
    hb.set_incarnation(a);
    ASSERT_TRUE(members_.Heartbeat(hb).ok());
    absl::SleepFor(absl::Milliseconds(40));
  }
  EXPECT_THAT(Live(), ::testing::ElementsAre("a", "b"));
  EXPECT_EQ(members_.stats().members_alive, 2u);
  absl::SleepFor(absl::Milliseconds(250));
  EXPECT_THAT(Live(), ::testing::ElementsAre("b"));
  EXPECT_EQ(members_.stats().members_alive, 1u);
  EXPECT_EQ(members_.stats().members_failed, 1u);
  v1::HeartbeatRequest hb;
  hb.set_group("job");
  hb.set_name("a");
  hb.set_incarnation(a);
  EXPECT_EQ(members_.Heartbeat(hb).code(), absl::StatusCode::kNotFound);
}

TEST_F(MembershipTest, RejoinGetsANewIncarnation) {
  const int64_t first = Join("a", 0);
  const int64_t second = Join("a", 0);
  EXPECT_GT(second, first);
  v1::HeartbeatRequest hb;
  hb.set_group("job");
  hb.set_name("a");
  hb.set_incarnation(first);
  EXPECT_EQ(members_.Heartbeat(hb).code(), absl::StatusCode::kNotFound);
  hb.set_incarnation(second);
  EXPECT_TRUE(members_.Heartbeat(hb).ok());
}

TEST_F(MembershipTest, BarrierPassesWhenAllArriveAndIsReusable) {
  const int64_t a = Join("a", 0), b = Join("b", 1);
  Arrival& first = Arrive("a", a, "sync");
  EXPECT_FALSE(first.done.HasBeenNotified());
  Arrival& second = Arrive("b", b, "sync");
  ASSERT_TRUE(first.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  ASSERT_TRUE(second.done.HasBeenNotified());
  EXPECT_EQ(*first.result, 1);
  Arrival& again_a = Arrive("a", a, "sync");
  Arrival& again_b = Arrive("b", b, "sync");
  ASSERT_TRUE(again_a.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(*again_b.result, 2);
}

TEST_F(MembershipTest, BarrierTimeoutNamesTheMissing) {
  const int64_t a = Join("a", 0);
  Join("b", 2);
  Arrival& waiting = Arrive("a", a, "init", 50);
  EXPECT_EQ(members_.stats().barrier_waiting, 1u);
  ASSERT_TRUE(waiting.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  const MembershipStats stats = members_.stats();
  EXPECT_EQ(stats.barrier_arrivals, 1u);
  EXPECT_EQ(stats.barrier_timeouts, 1u);
  EXPECT_EQ(stats.barrier_waiting, 0u);
  EXPECT_EQ(waiting.result.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(waiting.result.status().message(),
              HasSubstr("1/2 arrived; missing: rank 2 (host-b)"));
}

TEST_F(MembershipTest, DeadOrErringParticipantAbortsTheBarrier) {
  const int64_t a = Join("a", 0), b = Join("b", 1, 20);
  Arrival& waiting = Arrive("a", a, "sync");
  // b stops heartbeating and is declared failed.
  ASSERT_TRUE(waiting.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(waiting.result.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(waiting.result.status().message(),
              HasSubstr("rank 1 (host-b) failed: no heartbeat"));
  (void)b;

  const int64_t c = Join("c", 2);
  Arrival& next = Arrive("a", a, "other");
  // A barrier started with a dead member aborts at once.
  ASSERT_TRUE(next.done.WaitForNotificationWithTimeout(absl::Seconds(5)));

  Arrival& third = Arrive("a", a, "third", 10000);
  (void)third;
  v1::ReportErrorRequest err;
  err.set_group("job");
  err.set_name("c");
  err.set_incarnation(c);
  err.set_message("CUDA out of memory");
  ASSERT_TRUE(members_.ReportError(err).ok());
}

TEST_F(MembershipTest, ReportedErrorAbortsPendingBarriers) {
  const int64_t a = Join("a", 0), b = Join("b", 1);
  Arrival& waiting = Arrive("a", a, "step");
  v1::ReportErrorRequest err;
  err.set_group("job");
  err.set_name("b");
  err.set_incarnation(b);
  err.set_message("loss is NaN");
  ASSERT_TRUE(members_.ReportError(err).ok());
  ASSERT_TRUE(waiting.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(waiting.result.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(waiting.result.status().message(),
              HasSubstr("rank 1 (host-b) reported an error: loss is NaN"));
}

TEST_F(MembershipTest, MembersSurviveARestartWithGrace) {
  Join("a", 0, 1000);
  Membership reloaded(&store_, absl::Milliseconds(10));
  v1::ListMembersRequest req;
  req.set_group("job");
  absl::StatusOr<v1::ListMembersResponse> live = reloaded.List(req);
  ASSERT_TRUE(live.ok());
  ASSERT_EQ(live->members_size(), 1);
  EXPECT_EQ(live->members(0).host(), "host-a");
}

}  // namespace
}  // namespace cohort::server
