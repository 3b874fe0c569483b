#include "server/rendezvous.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/c10d/rules.h"
#include "store/kv_engine.h"

namespace cohort::server {
namespace {

using ::testing::HasSubstr;

// One pending join and its outcome.
struct Joiner {
  absl::Notification done;
  absl::StatusOr<v1::JoinResponse> result;
};

class RendezvousTest : public ::testing::Test {
 protected:
  v1::JoinRequest Request(const std::string& node, int min, int max,
                          int local = 2) {
    v1::JoinRequest req;
    req.set_run_id("job");
    req.set_node_id(node);
    req.set_address(node + ".example:1");
    req.set_local_world_size(local);
    req.set_min_nodes(min);
    req.set_max_nodes(max);
    // Ten minutes: no join here ends by timing out unless its test says
    // so, however slowly the test runs.
    req.set_join_timeout_ms(10 * 60 * 1000);
    req.set_last_call_timeout_ms(100);
    return req;
  }

  Joiner& Join(const v1::JoinRequest& req) {
    auto& j = joiners_.emplace_back(std::make_unique<Joiner>());
    Joiner* raw = j.get();
    rdzv_.Join(req, [raw](absl::StatusOr<v1::JoinResponse> r) {
      raw->result = std::move(r);
      raw->done.Notify();
    });
    return *raw;
  }

  // Joiners outlive the rendezvous, which fails pending joins on exit.
  std::vector<std::unique_ptr<Joiner>> joiners_;
  store::KvStore store_{store::NewMemoryEngine()};
  Rendezvous rdzv_{&store_};
};

TEST_F(RendezvousTest, CompletesAtMaxNodesWithDistinctRanks) {
  // A last call that outlasts the test: only the third node completes it.
  auto request = [&](const std::string& node, int local) {
    v1::JoinRequest req = Request(node, 2, 3, local);
    req.set_last_call_timeout_ms(10 * 60 * 1000);
    return req;
  };
  Joiner& c = Join(request("c", 1));
  Joiner& a = Join(request("a", 2));
  EXPECT_FALSE(a.done.HasBeenNotified());
  EXPECT_EQ(rdzv_.stats().waiting_nodes, 2u);
  EXPECT_EQ(rdzv_.stats().rounds_completed, 0u);
  Joiner& b = Join(request("b", 4));
  for (Joiner* j : {&a, &b, &c}) {
    ASSERT_TRUE(j->done.WaitForNotificationWithTimeout(absl::Seconds(5)));
    ASSERT_TRUE(j->result.ok()) << j->result.status();
    EXPECT_EQ(j->result->round(), 0);
    EXPECT_EQ(j->result->num_nodes(), 3);
    EXPECT_EQ(j->result->world_size(), 7);
    EXPECT_EQ(j->result->participants_size(), 3);
    EXPECT_EQ(j->result->store_prefix(), "runs/job/0");
  }
  // Node ranks follow node ids; global ranks are contiguous per node.
  EXPECT_EQ(a.result->node_rank(), 0);
  EXPECT_EQ(a.result->first_global_rank(), 0);
  EXPECT_EQ(b.result->node_rank(), 1);
  EXPECT_EQ(b.result->first_global_rank(), 2);
  EXPECT_EQ(c.result->node_rank(), 2);
  EXPECT_EQ(c.result->first_global_rank(), 6);
  EXPECT_EQ(a.result->participants(2).address(), "c.example:1");
  const RendezvousStats stats = rdzv_.stats();
  EXPECT_EQ(stats.rounds_completed, 1u);
  EXPECT_EQ(stats.waiting_nodes, 0u);
  EXPECT_EQ(stats.runs, 1u);
}

TEST_F(RendezvousTest, CompletesAfterLastCallWithMinNodes) {
  const absl::Time start = absl::Now();
  Joiner& a = Join(Request("a", 2, 4));
  Joiner& b = Join(Request("b", 2, 4));
  ASSERT_TRUE(a.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  ASSERT_TRUE(b.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(100));
  EXPECT_EQ(a.result->num_nodes(), 2);
  EXPECT_EQ(b.result->world_size(), 4);
}

TEST_F(RendezvousTest, JoinTimeoutSaysHowManyArrived) {
  v1::JoinRequest req = Request("lonely", 3, 3);
  req.set_join_timeout_ms(50);
  Joiner& j = Join(req);
  ASSERT_TRUE(j.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(j.result.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(j.result.status().message(),
              HasSubstr("1 of min_nodes=3 nodes arrived (lonely)"));
}

TEST_F(RendezvousTest, LateJoinerWaitsForTheNextRound) {
  Joiner& a = Join(Request("a", 2, 2));
  Joiner& b = Join(Request("b", 2, 2));
  ASSERT_TRUE(b.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  ASSERT_TRUE(a.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  Joiner& late = Join(Request("c", 2, 2));
  absl::StatusOr<v1::RunState> state = rdzv_.GetRunState("job");
  ASSERT_TRUE(state.ok());
  EXPECT_EQ(state->phase(), v1::RunState::COMPLETE);
  EXPECT_EQ(state->round(), 0);
  EXPECT_EQ(state->num_waiting(), 1);
  EXPECT_FALSE(late.done.HasBeenNotified());
  // One node of round 0 re-joins to let it in.
  Joiner& again = Join(Request("a", 2, 2));
  ASSERT_TRUE(late.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  ASSERT_TRUE(again.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(late.result->round(), 1);
  EXPECT_EQ(late.result->node_rank(), 1);
  EXPECT_EQ(late.result->store_prefix(), "runs/job/1");
}

TEST_F(RendezvousTest, ClosedRunRejectsJoins) {
  Joiner& pending = Join(Request("a", 2, 2));
  ASSERT_TRUE(rdzv_.CloseRun("job").ok());
  ASSERT_TRUE(pending.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(pending.result.status().code(),
            absl::StatusCode::kFailedPrecondition);
  Joiner& late = Join(Request("b", 2, 2));
  EXPECT_EQ(late.result.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(late.result.status().message(), HasSubstr("closed"));
}

TEST_F(RendezvousTest, BadRequestsAndConfigMismatch) {
  EXPECT_EQ(Join(Request("", 1, 1)).result.status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Join(Request("a", 3, 2)).result.status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Join(Request("a", 1, 1, 0)).result.status().code(),
            absl::StatusCode::kInvalidArgument);
  Join(Request("a", 2, 3));
  Joiner& other = Join(Request("b", 2, 4));
  EXPECT_EQ(other.result.status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(other.result.status().message(), HasSubstr("2:3"));
}

// Two joins of 2^31-1 processes each once made a world of -2.
TEST_F(RendezvousTest, WorldSizesThatWouldOverflowAreRefused) {
  Joiner& huge = Join(Request("a", 2, 2, 2147483647));
  EXPECT_EQ(huge.result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(huge.result.status().message(),
              HasSubstr("local_world_size must be 1 to 65536"));

  // Within the per-node bound, the sum is bounded too.
  std::vector<Joiner*> ok;
  for (int i = 0; i < 256; ++i) {
    ok.push_back(&Join(Request(absl::StrCat("n", 1000 + i), 300, 300, 65536)));
  }
  Joiner& over = Join(Request("z", 300, 300, 65536));
  ASSERT_TRUE(over.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(over.result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      over.result.status().message(),
      HasSubstr("a world of 16842752 ranks, over the limit of 16777216"));
  for (Joiner* j : ok) EXPECT_FALSE(j->done.HasBeenNotified());
}

TEST_F(RendezvousTest, CompletedRoundsSurviveARestart) {
  Join(Request("a", 1, 1));
  ASSERT_TRUE(
      joiners_.back()->done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  Rendezvous reloaded(&store_);
  absl::StatusOr<v1::RunState> state = reloaded.GetRunState("job");
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(state->phase(), v1::RunState::COMPLETE);
  EXPECT_EQ(state->participants(0).node_id(), "a");
  absl::Notification done;
  absl::StatusOr<v1::JoinResponse> next;
  reloaded.Join(Request("a", 1, 1), [&](absl::StatusOr<v1::JoinResponse> r) {
    next = std::move(r);
    done.Notify();
  });
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(next->round(), 1);
}

v1::ListParticipantsRequest Page(int page_size, const std::string& token) {
  v1::ListParticipantsRequest req;
  req.set_run_id("job");
  req.set_page_size(page_size);
  req.set_page_token(token);
  return req;
}

// A round too large for JoinResponse: every node reads the list in pages.
TEST_F(RendezvousTest, ListParticipantsPagesThroughALargeRound) {
  const int n = Rendezvous::kMaxInlineParticipants + 44;  // 300
  for (int i = 0; i < n; ++i) Join(Request(absl::StrCat("n", 1000 + i), n, n));
  for (auto& j : joiners_) {
    ASSERT_TRUE(j->done.WaitForNotificationWithTimeout(absl::Seconds(5)));
    ASSERT_TRUE(j->result.ok()) << j->result.status();
    EXPECT_EQ(j->result->participants_size(), 0);
    EXPECT_EQ(j->result->num_nodes(), n);
  }
  std::vector<std::string> listed;
  std::string token;
  int pages = 0;
  do {
    absl::StatusOr<v1::ListParticipantsResponse> page =
        rdzv_.ListParticipants(Page(128, token));
    ASSERT_TRUE(page.ok()) << page.status();
    EXPECT_EQ(page->round(), 0);
    EXPECT_EQ(page->num_nodes(), n);
    EXPECT_LE(page->participants_size(), 128);
    for (const v1::Participant& p : page->participants()) {
      EXPECT_EQ(p.node_rank(), static_cast<int>(listed.size()));
      EXPECT_EQ(p.first_global_rank(), 2 * p.node_rank());
      listed.push_back(p.node_id());
    }
    token = page->next_page_token();
    ++pages;
  } while (!token.empty());
  EXPECT_EQ(pages, 3);
  ASSERT_EQ(listed.size(), static_cast<size_t>(n));
  EXPECT_EQ(listed.front(), "n1000");
  EXPECT_EQ(listed.back(), absl::StrCat("n", 1000 + n - 1));

  // Page size 0 is the default (1000): one page.
  absl::StatusOr<v1::ListParticipantsResponse> all =
      rdzv_.ListParticipants(Page(0, ""));
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->participants_size(), n);
  EXPECT_TRUE(all->next_page_token().empty());
}

TEST_F(RendezvousTest, ListParticipantsErrors) {
  EXPECT_EQ(rdzv_.ListParticipants(Page(0, "")).status().code(),
            absl::StatusCode::kNotFound);
  Joiner& a = Join(Request("a", 2, 2));
  absl::StatusOr<v1::ListParticipantsResponse> collecting =
      rdzv_.ListParticipants(Page(0, ""));
  EXPECT_EQ(collecting.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(collecting.status().message(), HasSubstr("still collecting"));
  Join(Request("b", 2, 2));
  ASSERT_TRUE(a.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(rdzv_.ListParticipants(Page(-1, "")).status().code(),
            absl::StatusCode::kInvalidArgument);
  for (const char* bad : {"junk", "0:0", "0:2", "1:1", "0:-1", ":1"}) {
    EXPECT_EQ(rdzv_.ListParticipants(Page(1, bad)).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
  absl::StatusOr<v1::ListParticipantsResponse> first =
      rdzv_.ListParticipants(Page(1, ""));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->participants(0).node_id(), "a");
  ASSERT_EQ(first->next_page_token(), "0:1");

  // Round 1 completes before the second page is read.
  Joiner& a1 = Join(Request("a", 2, 2));
  Joiner& b1 = Join(Request("b", 2, 2));
  ASSERT_TRUE(a1.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  ASSERT_TRUE(b1.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  absl::StatusOr<v1::ListParticipantsResponse> stale =
      rdzv_.ListParticipants(Page(1, first->next_page_token()));
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(stale.status().message(),
              HasSubstr("completed round 1 while the participants of round 0 "
                        "were being listed"));

  // A closed run still lists its last round.
  ASSERT_TRUE(rdzv_.CloseRun("job").ok());
  absl::StatusOr<v1::ListParticipantsResponse> closed =
      rdzv_.ListParticipants(Page(0, ""));
  ASSERT_TRUE(closed.ok()) << closed.status();
  EXPECT_EQ(closed->round(), 1);
  EXPECT_EQ(closed->participants_size(), 2);
}

TEST_F(RendezvousTest, RunRecordsAreInTheReservedNamespace) {
  EXPECT_TRUE(
      absl::StartsWith(Rendezvous::RunKey("job"), c10d::kReservedPrefix));
}

}  // namespace
}  // namespace cohort::server
