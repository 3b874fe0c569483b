// EtcdLeadership against FakeEtcd (fake_etcd.h): candidates campaign over
// real gRPC against in-process etcd members; the test revokes leases,
// stops members, and decides when etcd lets a lease expire (the fake's
// clock), then asserts who leads and in which order the candidates heard.
#include "server/ha/etcd_leadership.h"

#include <algorithm>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/ha/fake_etcd.h"

namespace cohort::server {
namespace {

using ::testing::ElementsAre;

// How long a test waits for something it expects before failing: a guard
// against hanging, not a bound the test asserts.
constexpr absl::Duration kPatience = absl::Seconds(60);

// The candidates' lease; etcd (the fake) lets it expire only when the test
// advances its clock by this much.
constexpr absl::Duration kTtl = absl::Seconds(1);

constexpr absl::string_view kKey = "/cohort/leader";

// What every candidate heard, in the order they heard it:
// "a elected", "b follows a", "a follows nobody".
class Timeline {
 public:
  void Add(std::string event) {
    absl::MutexLock lock(&mu_);
    events_.push_back(std::move(event));
  }

  // Whether `event` was heard (false: not within kPatience).
  bool Await(const std::string& event) {
    absl::MutexLock lock(&mu_);
    auto heard = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return std::find(events_.begin(), events_.end(), event) != events_.end();
    };
    return mu_.AwaitWithTimeout(absl::Condition(&heard), kPatience);
  }

  std::vector<std::string> events() {
    absl::MutexLock lock(&mu_);
    return events_;
  }

  // What `candidate` heard, without its name.
  std::vector<std::string> Of(absl::string_view candidate) {
    std::vector<std::string> out;
    const std::string prefix = absl::StrCat(candidate, " ");
    for (const std::string& e : events()) {
      if (absl::StartsWith(e, prefix)) out.push_back(e.substr(prefix.size()));
    }
    return out;
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> events_ ABSL_GUARDED_BY(mu_);
};

std::unique_ptr<EtcdLeadership> Campaign(Timeline& timeline,
                                         const std::string& address,
                                         std::vector<std::string> endpoints) {
  EtcdLeadershipOptions o;
  o.endpoints = std::move(endpoints);
  o.key = std::string(kKey);
  o.address = address;
  o.ttl = kTtl;
  o.poll = absl::Milliseconds(20);
  o.elected = [&timeline, address] {
    timeline.Add(absl::StrCat(address, " elected"));
  };
  o.follows = [&timeline, address](const std::string& leader) {
    timeline.Add(
        absl::StrCat(address, " follows ", leader.empty() ? "nobody" : leader));
  };
  return std::make_unique<EtcdLeadership>(std::move(o));
}

// A fake etcd of some members, and the candidates "a" and "b".
class EtcdLeadershipTest : public ::testing::Test {
 protected:
  void StartEtcd(int members = 1) {
    absl::StatusOr<std::unique_ptr<FakeEtcd>> etcd = FakeEtcd::Start(members);
    ASSERT_TRUE(etcd.ok()) << etcd.status();
    etcd_ = std::move(*etcd);
  }

  // Starts a, waits until it leads, then b, until it follows a.
  void ElectAThenB(std::vector<std::string> a_endpoints,
                   std::vector<std::string> b_endpoints) {
    a_ = Campaign(timeline_, "a", std::move(a_endpoints));
    ASSERT_TRUE(timeline_.Await("a elected"));
    b_ = Campaign(timeline_, "b", std::move(b_endpoints));
    ASSERT_TRUE(timeline_.Await("b follows a"));
  }

  // The election key's value ("" while absent), and its lease.
  std::string Leader() const {
    std::optional<mvccpb::KeyValue> kv = etcd_->Get(kKey);
    return kv.has_value() ? kv->value() : "";
  }
  int64_t LeaderLease() const {
    std::optional<mvccpb::KeyValue> kv = etcd_->Get(kKey);
    return kv.has_value() ? kv->lease() : 0;
  }

  std::unique_ptr<FakeEtcd> etcd_;
  Timeline timeline_;
  std::unique_ptr<EtcdLeadership> a_;
  std::unique_ptr<EtcdLeadership> b_;
};

TEST_F(EtcdLeadershipTest, OfTwoCandidatesExactlyOneLeadsAndTheOtherFollows) {
  ASSERT_NO_FATAL_FAILURE(StartEtcd());
  a_ = Campaign(timeline_, "a", etcd_->endpoints());
  b_ = Campaign(timeline_, "b", etcd_->endpoints());

  const absl::Time give_up = absl::Now() + kPatience;
  std::string winner;
  while (winner.empty() && absl::Now() < give_up) {
    const std::vector<std::string> a_heard = timeline_.Of("a");
    const std::vector<std::string> b_heard = timeline_.Of("b");
    if (a_heard == std::vector<std::string>{"elected"} &&
        b_heard == std::vector<std::string>{"follows a"}) {
      winner = "a";
    } else if (b_heard == std::vector<std::string>{"elected"} &&
               a_heard == std::vector<std::string>{"follows b"}) {
      winner = "b";
    } else {
      absl::SleepFor(absl::Milliseconds(10));
    }
  }
  ASSERT_FALSE(winner.empty())
      << "heard: " << testing::PrintToString(timeline_.events());
  EXPECT_EQ(Leader(), winner);
  EXPECT_TRUE(etcd_->HasLease(LeaderLease()));
}

// A leader that stops resigns: the other takes over at once, although the
// fake's clock never moved (so no lease expired).
TEST_F(EtcdLeadershipTest, ALeaderThatStopsResignsAndTheOtherTakesOver) {
  ASSERT_NO_FATAL_FAILURE(StartEtcd());
  ASSERT_NO_FATAL_FAILURE(ElectAThenB(etcd_->endpoints(), etcd_->endpoints()));
  const int64_t a_lease = LeaderLease();

  a_.reset();
  EXPECT_FALSE(etcd_->HasLease(a_lease));
  ASSERT_TRUE(timeline_.Await("b elected"));
  EXPECT_THAT(timeline_.events(),
              ElementsAre("a elected", "b follows a", "b elected"));
  EXPECT_EQ(Leader(), "b");
}

// The leader's lease revoked under it (an operator, etcdctl): the other
// candidate wins the free key; the old leader steps down and follows it.
TEST_F(EtcdLeadershipTest, ARevokedLeaseHandsLeadershipToTheOther) {
  ASSERT_NO_FATAL_FAILURE(StartEtcd());
  ASSERT_NO_FATAL_FAILURE(ElectAThenB(etcd_->endpoints(), etcd_->endpoints()));

  ASSERT_TRUE(etcd_->RevokeLease(LeaderLease()));
  ASSERT_TRUE(timeline_.Await("b elected"));
  ASSERT_TRUE(timeline_.Await("a follows b"));
  EXPECT_THAT(timeline_.Of("a"),
              ElementsAre("elected", "follows nobody", "follows b"));
  EXPECT_THAT(timeline_.Of("b"), ElementsAre("follows a", "elected"));
  EXPECT_EQ(Leader(), "b");
}

// The leader loses its etcd member (each candidate here knows one member
// only): it stops acting as leader on its own while its lease still holds
// the key, so that when etcd lets the lease expire and the other candidate
// wins, there never were two leaders.
TEST_F(EtcdLeadershipTest,
       ALeaderCutOffFromEtcdStepsDownBeforeItsLeaseExpires) {
  ASSERT_NO_FATAL_FAILURE(StartEtcd(2));
  ASSERT_NO_FATAL_FAILURE(
      ElectAThenB({etcd_->endpoint(0)}, {etcd_->endpoint(1)}));

  etcd_->Stop(0);
  ASSERT_TRUE(timeline_.Await("a follows nobody"));
  EXPECT_EQ(Leader(), "a");  // etcd still holds a's lease...
  EXPECT_THAT(timeline_.Of("b"), ElementsAre("follows a"));  // ...b waits.

  etcd_->AdvanceClock(kTtl);
  ASSERT_TRUE(timeline_.Await("b elected"));
  ASSERT_TRUE(etcd_->Restart(0).ok());
  ASSERT_TRUE(timeline_.Await("a follows b"));
  // The clock's jump can also expire the lease b has just been granted for
  // a campaign: its put then fails, and it follows nobody until its next.
  std::vector<std::string> events = timeline_.events();
  events.erase(std::remove(events.begin(), events.end(), "b follows nobody"),
               events.end());
  EXPECT_THAT(events,
              ElementsAre("a elected", "b follows a", "a follows nobody",
                          "b elected", "a follows b"));
}

// Knowing every member, a leader whose member loses its quorum (and
// refuses calls at once) renews its lease through the next one and stays
// leader. Not so for a member killed outright: a call to it waits out
// gRPC's reconnect backoff (1 s), which here is longer than what the
// leader allows itself without a renewal (2/3 of a 1 s ttl), so it steps
// down.
TEST_F(EtcdLeadershipTest, ALeaderKeepsLeadingThroughAnotherMember) {
  ASSERT_NO_FATAL_FAILURE(StartEtcd(2));
  ASSERT_NO_FATAL_FAILURE(ElectAThenB(etcd_->endpoints(), etcd_->endpoints()));
  const int64_t a_lease = LeaderLease();

  etcd_->Isolate(0);
  const absl::Time give_up = absl::Now() + kPatience;
  while (etcd_->calls(1, "LeaseKeepAlive") < 2 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_GE(etcd_->calls(1, "LeaseKeepAlive"), 2);
  EXPECT_THAT(timeline_.events(), ElementsAre("a elected", "b follows a"));
  EXPECT_EQ(Leader(), "a");
  EXPECT_EQ(LeaderLease(), a_lease);
}

// A replica restarted before its old lease ran out finds the key naming
// itself: it ends that lease and leads again at once, without waiting for
// etcd to expire it.
TEST_F(EtcdLeadershipTest, ARestartedReplicaTakesBackItsOwnKey) {
  ASSERT_NO_FATAL_FAILURE(StartEtcd());
  const int64_t old_lease = etcd_->GrantLease(60);
  ASSERT_TRUE(etcd_->Put(kKey, "a", old_lease).ok());

  a_ = Campaign(timeline_, "a", etcd_->endpoints());
  ASSERT_TRUE(timeline_.Await("a elected"));
  EXPECT_THAT(timeline_.events(), ElementsAre("a elected"));
  EXPECT_FALSE(etcd_->HasLease(old_lease));
  EXPECT_EQ(Leader(), "a");
  EXPECT_NE(LeaderLease(), old_lease);
}

}  // namespace
}  // namespace cohort::server
