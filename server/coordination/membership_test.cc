#include "server/coordination/membership.h"

#include <atomic>

#include "absl/strings/str_format.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "store/counting_engine.h"
#include "store/kv_engine.h"

namespace cohort::server {
namespace {

using ::testing::HasSubstr;

// Leases and barriers that only the mechanism under test may end: ten
// minutes (a test that wants one to expire passes its own).
constexpr int64_t kLongMs = 10 * 60 * 1000;

class MembershipTest : public ::testing::Test {
 protected:
  int64_t Join(const std::string& name, int rank,
               int64_t interval_ms = kLongMs) {
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
                  const std::string& id, int64_t timeout_ms = kLongMs,
                  const std::vector<std::string>& participants = {}) {
    auto& a = arrivals_.emplace_back(std::make_unique<Arrival>());
    Arrival* raw = a.get();
    v1::BarrierRequest req;
    req.set_group("job");
    req.set_barrier_id(id);
    req.set_name(name);
    req.set_incarnation(incarnation);
    req.set_timeout_ms(timeout_ms);
    for (const std::string& p : participants) req.add_participants(p);
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

absl::Status Heartbeat(Membership& members, int64_t incarnation) {
  v1::HeartbeatRequest hb;
  hb.set_group("job");
  hb.set_name("a");
  hb.set_incarnation(incarnation);
  return members.Heartbeat(hb);
}

TEST_F(MembershipTest, MissedHeartbeatsFailAMember) {
  // a's lease is 3 x 100 ms; b's outlasts the test.
  constexpr int64_t kIntervalMs = 100;
  const absl::Duration lease = absl::Milliseconds(3 * kIntervalMs);
  Join("b", 1);
  // Heartbeats keep a alive past its first lease. Each one is checked only
  // where it must have found a alive: when it returned less than a lease
  // after the one before it was sent (a lease is counted from inside each
  // call). On a machine that stalls this thread longer than that, a may
  // rightly be failed: then a joins again and the attempt starts over.
  int64_t a = 0;
  absl::Time last_sent;
  uint64_t failed_before = 0;
  for (int attempt = 0;; ++attempt) {
    ASSERT_LT(attempt, 100) << "this thread was stalled for a whole lease "
                               "in each of 100 attempts";
    failed_before = members_.stats().members_failed;
    last_sent = absl::Now();
    a = Join("a", 0, kIntervalMs);
    const absl::Time joined = last_sent;
    bool outlived_lease = false;
    for (;;) {
      absl::SleepFor(absl::Milliseconds(10));
      const absl::Time sent = absl::Now();
      const absl::Status beat = Heartbeat(members_, a);
      const absl::Time returned = absl::Now();
      const bool must_be_alive = returned - last_sent < lease;
      if (!beat.ok()) {
        ASSERT_FALSE(must_be_alive)
            << "a heartbeat that returned within a lease of when the one "
               "before it was sent found a failed: "
            << beat;
        break;
      }
      last_sent = sent;
      if (sent - joined > 2 * lease) {
        outlived_lease = true;
        break;
      }
    }
    if (outlived_lease) break;
  }
  EXPECT_THAT(Live(), ::testing::ElementsAre("a", "b"));
  EXPECT_EQ(members_.stats().members_alive, 2u);
  // Without heartbeats a is failed, once its lease has run out.
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (Live().size() != 1 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_GE(absl::Now() - last_sent, lease);
  EXPECT_THAT(Live(), ::testing::ElementsAre("b"))
      << "a was not failed 30 s after its last heartbeat";
  EXPECT_EQ(members_.stats().members_alive, 1u);
  EXPECT_EQ(members_.stats().members_failed, failed_before + 1);
  EXPECT_EQ(Heartbeat(members_, a).code(), absl::StatusCode::kNotFound);
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

TEST_F(MembershipTest, NamedParticipantsMustAgree) {
  const int64_t a = Join("a", 0), b = Join("b", 1), c = Join("c", 2);
  Arrival& first = Arrive("a", a, "pair", kLongMs, {"b", "a"});
  // The same set in another order, or with a name twice, is the same list.
  Arrival& other = Arrive("c", c, "pair", kLongMs, {"a", "c"});
  ASSERT_TRUE(other.done.HasBeenNotified());
  EXPECT_EQ(other.result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(other.result.status().message(),
              HasSubstr("started with participants [a, b], not [a, c]"));
  Arrival& outsider = Arrive("c", c, "pair");
  ASSERT_TRUE(outsider.done.HasBeenNotified());
  EXPECT_EQ(outsider.result.status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(first.done.HasBeenNotified());
  Arrival& second = Arrive("b", b, "pair", kLongMs, {"a", "b", "a"});
  ASSERT_TRUE(second.done.HasBeenNotified());
  ASSERT_TRUE(first.done.HasBeenNotified());
  EXPECT_EQ(*first.result, 1);
  EXPECT_EQ(*second.result, 1);
}

TEST_F(MembershipTest, ACancelledArrivalMustArriveAgain) {
  const int64_t a = Join("a", 0), b = Join("b", 1);
  Arrival* gone = nullptr;
  {
    auto& owned = arrivals_.emplace_back(std::make_unique<Arrival>());
    gone = owned.get();
  }
  v1::BarrierRequest req;
  req.set_group("job");
  req.set_barrier_id("sync");
  req.set_name("a");
  req.set_incarnation(a);
  req.set_timeout_ms(kLongMs);
  const Membership::BarrierId id =
      members_.Barrier(req, [gone](absl::StatusOr<int64_t> r) {
        gone->result = r;
        gone->done.Notify();
      });
  ASSERT_NE(id, 0u);
  EXPECT_EQ(members_.stats().barrier_waiting, 1u);
  members_.CancelBarrier(id);
  members_.CancelBarrier(id);  // Twice is harmless.
  EXPECT_EQ(members_.stats().barrier_waiting, 0u);
  Arrival& second = Arrive("b", b, "sync");
  EXPECT_FALSE(second.done.HasBeenNotified());
  Arrival& again = Arrive("a", a, "sync");
  ASSERT_TRUE(again.done.HasBeenNotified());
  ASSERT_TRUE(second.done.HasBeenNotified());
  EXPECT_EQ(*again.result, 1);
  EXPECT_FALSE(gone->done.HasBeenNotified());
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
  EXPECT_EQ(waiting.result.status().code(),
            absl::StatusCode::kDeadlineExceeded);
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
  // A barrier started with a dead member aborts at once.
  Arrival& next = Arrive("a", a, "other", kLongMs, {"a", "b"});
  ASSERT_TRUE(next.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(next.result.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(next.result.status().message(),
              HasSubstr("rank 1 (host-b) is not a live member"));

  // One of the live members (a and c) reports an error.
  Arrival& third = Arrive("a", a, "third");
  v1::ReportErrorRequest err;
  err.set_group("job");
  err.set_name("c");
  err.set_incarnation(c);
  err.set_message("CUDA out of memory");
  ASSERT_TRUE(members_.ReportError(err).ok());
  ASSERT_TRUE(third.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(third.result.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(
      third.result.status().message(),
      HasSubstr("rank 2 (host-c) reported an error: CUDA out of memory"));
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

TEST_F(MembershipTest, SnapshotShowsMembersEventsAndMissingParticipants) {
  const int64_t a = Join("a", 0);
  const int64_t b = Join("b", 1);
  const int64_t c = Join("c", 2);
  Join("d", 3);
  v1::LeaveGroupRequest leave;
  leave.set_group("job");
  leave.set_name("d");
  leave.set_incarnation(
      members_.Snapshot("job", 10)->listed[3].info.incarnation());
  ASSERT_TRUE(members_.Leave(leave).ok());
  v1::ReportErrorRequest error;
  error.set_group("job");
  error.set_name("c");
  error.set_incarnation(c);
  error.set_message("disk full");
  ASSERT_TRUE(members_.ReportError(error).ok());
  const absl::Time before = absl::Now();
  Arrive("a", a, "init", kLongMs, {"a", "b", "c"});
  Arrive("b", b, "init", kLongMs, {"a", "b", "c"});
  EXPECT_THAT(members_.GroupNames(), ::testing::ElementsAre("job"));

  absl::StatusOr<GroupSnapshot> snap = members_.Snapshot("job", 10);
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(snap->members, 4u);
  EXPECT_EQ(snap->alive, 3u);
  ASSERT_EQ(snap->listed.size(), 4u);
  EXPECT_EQ(snap->listed[0].info.incarnation(), a);
  EXPECT_TRUE(snap->listed[0].alive);
  EXPECT_EQ(snap->listed[0].last_event, v1::MemberEvent::JOINED);
  EXPECT_GT(snap->listed[0].lease_end, before);
  EXPECT_TRUE(snap->listed[2].alive);
  EXPECT_EQ(snap->listed[2].last_event, v1::MemberEvent::ERROR_REPORTED);
  EXPECT_EQ(snap->listed[2].message, "disk full");
  EXPECT_FALSE(snap->listed[3].alive);
  EXPECT_EQ(snap->listed[3].last_event, v1::MemberEvent::LEFT);
  ASSERT_EQ(snap->barriers.size(), 1u);
  const BarrierSnapshot& init = snap->barriers[0];
  EXPECT_EQ(init.id, "init");
  EXPECT_EQ(init.participants, 3u);
  EXPECT_EQ(init.arrived, 2u);
  ASSERT_EQ(init.missing.size(), 1u);
  EXPECT_EQ(init.missing[0].name(), "c");
  EXPECT_EQ(init.missing[0].rank(), 2);
  EXPECT_EQ(init.missing[0].host(), "host-c");
  EXPECT_GE(init.started, before);
  EXPECT_EQ(init.timeout, absl::Milliseconds(kLongMs));

  // The bound: one member listed, one missing participant named.
  snap = members_.Snapshot("job", 1);
  ASSERT_TRUE(snap.ok());
  EXPECT_EQ(snap->members, 4u);
  EXPECT_EQ(snap->listed.size(), 1u);
  EXPECT_EQ(snap->barriers[0].missing.size(), 1u);
  EXPECT_EQ(snap->barriers[0].missing_unlisted, 0u);
  snap = members_.Snapshot("job", 0);
  EXPECT_EQ(snap->barriers[0].missing_unlisted, 1u);
  EXPECT_EQ(members_.Snapshot("nope", 10).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(MembershipTest, SnapshotShowsWhyAMemberFailed) {
  Join("a", 0, 20);
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  absl::StatusOr<GroupSnapshot> snap = members_.Snapshot("job", 10);
  while (snap->listed[0].alive && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(10));
    snap = members_.Snapshot("job", 10);
  }
  EXPECT_FALSE(snap->listed[0].alive);
  EXPECT_EQ(snap->listed[0].last_event, v1::MemberEvent::FAILED);
  EXPECT_THAT(snap->listed[0].message, HasSubstr("no heartbeat for 60ms"));
  // A restart keeps the event.
  Membership reloaded(&store_, absl::Milliseconds(10));
  snap = reloaded.Snapshot("job", 10);
  ASSERT_TRUE(snap.ok());
  EXPECT_FALSE(snap->listed[0].alive);
  EXPECT_EQ(snap->listed[0].last_event, v1::MemberEvent::FAILED);
  EXPECT_THAT(snap->listed[0].message, HasSubstr("no heartbeat"));
}

// The store work of each membership operation, per member, in a group of
// `n`: what must not grow with n for a coordinator to scale.
struct WorkPerMember {
  store::EngineWork join, rejoin, heartbeat, barrier;
  int barrier_passed = 0;  // Arrivals whose callback said the barrier passed.
};

WorkPerMember MeasureWork(int n) {
  auto counting =
      std::make_unique<store::CountingEngine>(store::NewMemoryEngine());
  store::CountingEngine* engine = counting.get();
  store::KvStore store(std::move(counting));
  Membership members(&store);
  // Names, hosts and ranks of one width, so that every record has the same
  // size whatever n is (rank: a 3-byte varint for every member).
  auto join = [&](int i) {
    v1::JoinGroupRequest req;
    req.set_group("job");
    req.set_name(absl::StrFormat("node-%06d", i));
    req.set_host(absl::StrFormat("host-%06d", i));
    req.set_rank(1000000 + i);
    req.set_heartbeat_interval_ms(kLongMs);
    absl::StatusOr<v1::JoinGroupResponse> r = members.Join(req);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->incarnation() : 0;
  };
  auto per_member = [n](const store::EngineWork& w) {
    return store::EngineWork{w.applies / n, w.mutations / n,
                             w.bytes_written / n, w.gets / n, w.bytes_read / n};
  };
  WorkPerMember out;
  std::vector<int64_t> incarnations(n);
  store::EngineWork before = engine->work();
  for (int i = 0; i < n; ++i) incarnations[i] = join(i);
  out.join = per_member(engine->work() - before);

  before = engine->work();
  for (int i = 0; i < n; ++i) {
    v1::HeartbeatRequest hb;
    hb.set_group("job");
    hb.set_name(absl::StrFormat("node-%06d", i));
    hb.set_incarnation(incarnations[i]);
    EXPECT_TRUE(members.Heartbeat(hb).ok());
  }
  out.heartbeat = per_member(engine->work() - before);

  std::atomic<int> passed{0};
  before = engine->work();
  for (int i = 0; i < n; ++i) {
    v1::BarrierRequest req;
    req.set_group("job");
    req.set_barrier_id("step");
    req.set_name(absl::StrFormat("node-%06d", i));
    req.set_incarnation(incarnations[i]);
    req.set_timeout_ms(kLongMs);
    members.Barrier(req, [&passed](absl::StatusOr<int64_t> r) {
      if (r.ok()) ++passed;
    });
  }
  out.barrier = per_member(engine->work() - before);
  out.barrier_passed = passed;

  // Restarted members: each join replaces a live incarnation.
  before = engine->work();
  for (int i = 0; i < n; ++i) join(i);
  out.rejoin = per_member(engine->work() - before);
  EXPECT_EQ(members.stats().members_alive, static_cast<size_t>(n));
  return out;
}

void ExpectSameWork(const store::EngineWork& small,
                    const store::EngineWork& large, absl::string_view what) {
  SCOPED_TRACE(what);
  EXPECT_EQ(small.applies, large.applies);
  EXPECT_EQ(small.mutations, large.mutations);
  EXPECT_EQ(small.bytes_written, large.bytes_written);
  EXPECT_EQ(small.gets, large.gets);
  EXPECT_EQ(small.bytes_read, large.bytes_read);
}

// Counts store work rather than time: the same on every machine. A group
// four times as large must cost the same per member: one record written
// per join, two per replacing join (the old incarnation's FAILED, the new
// one's JOINED), and nothing for heartbeats or barrier arrivals.
TEST(MembershipWorkTest, StoreWorkPerMemberDoesNotGrowWithTheGroup) {
  const WorkPerMember small = MeasureWork(1000);
  const WorkPerMember large = MeasureWork(4000);
  ExpectSameWork(small.join, large.join, "join");
  ExpectSameWork(small.rejoin, large.rejoin, "rejoin");
  ExpectSameWork(small.heartbeat, large.heartbeat, "heartbeat");
  ExpectSameWork(small.barrier, large.barrier, "barrier");
  EXPECT_EQ(large.join.applies, 1u);
  EXPECT_EQ(large.join.mutations, 1u);
  EXPECT_EQ(large.rejoin.mutations, 2u);
  EXPECT_EQ(large.heartbeat.applies, 0u);
  EXPECT_EQ(large.barrier.applies, 0u);
  EXPECT_EQ(small.barrier_passed, 1000);
  EXPECT_EQ(large.barrier_passed, 4000);
}

}  // namespace
}  // namespace cohort::server
